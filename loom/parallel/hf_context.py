"""Context parallelism for Hugging Face causal LMs: the unedited model with its sequences cut over `cp`.

A Hugging Face attention module hands its query, key and value to the function its config names
(`config._attn_implementation`, looked up in transformers' `AttentionInterface`). loom registers one more,
`ATTENTION`, which runs `ulysses_attention` or `ring_attention` over the `cp` group on each rank's sequence
shards; `apply_context_parallel` points the model's config at it and gives each attention module its
`ContextAttention` (the group and the exchange), found by the family's recipe (`Recipe.attention`).

Everything else in a decoder works token by token, so the rest follows from cutting the inputs: a forward
pre-hook takes each replica's whole sequences, as one device takes them, and gives this rank its piece of
every per-token input (`shard_causal_lm_inputs`), cut by `shard_sequence` as the attention expects:
- token ids (or embeddings) and position ids, the latter global (0 .. seq - 1 before the cut, unless given),
  so that rotary tables and learned positions follow the tokens and the causal mask is the global one;
- the labels shifted on the whole sequence first (`shift_labels`: the label of position t is token t + 1,
  -100 after the last token), so that no pair crosses a shard boundary. The model's own loss then takes
  `shift_labels` as they are, and its mean runs over every labelled token of the dp x cp ranks
  (`loom.parallel.lift.local_cross_entropy`): one device's mean.

The cp ranks' shards are rows of their own (the batch is cut over dp x cp, `parallelize`'s default batch
axes), so the parameters' gradients are reduced over dp x cp by the usual gradient sync. The outputs
(logits) are each rank's piece of the sequence, rows of the global output.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from loom.dist.mesh import Mesh
from loom.models.recipes import RECIPES
from loom.parallel.context import chunk_count, sequence_layout, shard_sequence, ulysses_attention
from loom.parallel.lift import attention_on_local_shards
from loom.parallel.module_plan import matching
from loom.parallel.ring import ring_attention

__all__ = [
    "ATTENTION",
    "ContextAttention",
    "apply_context_parallel",
    "check_context_config",
    "context_attention",
    "shard_causal_lm_inputs",
]

ATTENTION = "loom_context_parallel"
"""The name loom's attention function is registered under in transformers' `AttentionInterface`."""

ATTENTION_FUNCTIONS = {"ulysses": ulysses_attention, "ring": ring_attention}

# per-token inputs of a causal LM's forward, cut along dim 1 (the sequence) like the token ids
_PER_TOKEN = ("input_ids", "inputs_embeds", "position_ids", "labels", "shift_labels")
_IGNORE_INDEX = -100  # the label transformers' causal LM loss ignores


@dataclass(frozen=True)
class ContextAttention:
    """What an attention module needs to attend over a sequence cut over cp: the `cp` process group and
    the exchange ("ulysses" or "ring"), whose sequence layout the inputs are cut by."""

    group: dist.ProcessGroup
    attention: str

    def __deepcopy__(self, memo: dict) -> ContextAttention:
        # a handle on a process group every rank built together: copies of the model (the dry run's meta
        # copy, a user's deepcopy) share it, as they share the mesh
        return self

    @property
    def layout(self) -> str:
        """How the sequence is cut over the group (`loom.parallel.context.sequence_layout`)."""
        return sequence_layout(self.attention)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None) -> torch.Tensor:
        """Causal attention of this rank's shards [batch, heads, seq / cp, head_dim] over the whole sequence;
        DTensors (a semi_auto model) run on their local shards (rows cut over dp x cp, heads over tp)."""
        attend = functools.partial(
            ATTENTION_FUNCTIONS[self.attention],
            group=self.group,
            causal=True,
            scale=scale,
            layout=self.layout,
        )
        if isinstance(q, DTensor):
            return attention_on_local_shards(attend, q, k, v)
        return attend(q, k, v)


def context_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature (`AttentionInterface`): query [batch, heads, seq, dim],
    key and value [batch, kv_heads, seq, dim] (grouped-query heads unrepeated); returns the output as
    [batch, seq, heads, dim] and no weights. Causal over the global positions; no padding mask, dropout or
    sliding window (each refused with what to change)."""
    context = getattr(module, "loom_context", None)
    if context is None:
        raise ValueError(
            f"{type(module).__name__}: config._attn_implementation is {ATTENTION!r}, but this module was not "
            f"given a cp group by loom.parallelize(model, plan=Plan(cp=...)); set the model's attention back "
            f"with model.set_attn_implementation('sdpa')"
        )
    if dropout:
        raise ValueError(
            f"{type(module).__name__}: attention dropout {dropout} with cp > 1: loom's context-parallel "
            "attention has no dropout; set the config's attention dropout (attention_dropout, attn_pdrop) to 0"
        )
    if attention_mask is not None:  # the mask interface has no entry for ATTENTION: this is a custom mask
        raise ValueError(
            f"{type(module).__name__}: an attention mask reached attention with cp > 1; loom's context-parallel "
            "attention is causal over the whole sequence and takes no mask: drop the attention_mask"
        )
    if kwargs.get("sliding_window") is not None:
        raise ValueError(
            f"{type(module).__name__}: sliding-window attention (sliding_window = {kwargs['sliding_window']}) "
            "does not run with cp > 1; set the config's sliding_window to None or use cp = 1"
        )
    out = context.attend(query, key, value, scaling)
    return out.transpose(1, 2).contiguous(), None


def check_context_config(
    config: Any, name: str, modules: str | None, *, cp: int, key: str, source: str
) -> None:
    """The rules a Hugging Face model's config must meet for its sequences to be cut over `cp`, checked
    once for both surfaces (`loom train`'s config, `apply_context_parallel`): its family's recipe names its
    attention modules (`modules`, None when it does not), and the config asks for nothing a cut sequence
    cannot run (a sliding window, attention dropout). `key` names the cp setting ("parallel.cp",
    "plan.cp") and `source` where the config comes from, in the errors."""
    if modules is None:
        known = sorted(n for n, r in RECIPES.items() if getattr(r, "attention", None) is not None)
        raise ValueError(
            f"{key} = {cp}: loom knows no attention modules of {name}, so it cannot cut its sequences "
            f"(models it can: {known}, and loom's GPT built with Strategies(cp=...)); set {key} = 1"
        )
    if getattr(config, "sliding_window", None) is not None:
        raise ValueError(
            f"{key} = {cp}: {source} sets sliding_window = {config.sliding_window}, which loom's "
            f'context-parallel attention does not apply; set sliding_window to None ("sliding_window": null '
            f"in a config.json), or {key} = 1"
        )
    for dropout in ("attention_dropout", "attn_pdrop"):
        if getattr(config, dropout, 0.0):
            raise ValueError(
                f"{key} = {cp}: {source} sets {dropout} = {getattr(config, dropout)}, and loom's "
                f'context-parallel attention has no dropout; set "{dropout}": 0.0 there, or {key} = 1'
            )


@functools.cache
def _register() -> None:
    """Register `context_attention` with transformers (once per process)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, context_attention)


def apply_context_parallel(
    model: nn.Module, mesh: Mesh, *, attention: str, modules: str | None, tp: int = 1
) -> None:
    """Make the Hugging Face causal LM `model` run with each sequence cut over the `cp` axis of `mesh` by
    `attention` ("ulysses" or "ring"): its attention modules (the module-path pattern `modules`, from the
    family's recipe) attend over the cp group, and a forward pre-hook cuts its inputs
    (`shard_causal_lm_inputs`). Call it before `loom.parallelize` lays the model out, so that the cut comes
    before the inputs become DTensors. `tp`: the tensor-parallel size, which with Ulysses cuts the heads
    first."""
    cp = mesh.axis_size("cp")
    name = type(model).__name__
    config = getattr(model, "config", None)
    check_context_config(config, name, modules, cp=cp, key="plan.cp", source=f"{name}'s config")
    if config is None or not hasattr(model, "set_attn_implementation"):
        raise ValueError(f"plan.cp = {cp}: {name} is not a Hugging Face model (no config); use cp = 1")
    heads = config.num_attention_heads
    if attention == "ulysses" and heads % (tp * cp):
        raise ValueError(
            f"plan.attention = 'ulysses' cuts each tp rank's heads over cp: tp x cp = {tp * cp} must divide "
            f"num_attention_heads = {heads} of {name}; use attention = 'ring' (any head count) or a smaller cp"
        )
    loss = getattr(model, "loss_function", None)
    if loss is None:
        raise ValueError(
            f"plan.cp = {cp}: {name} has no loss_function taking shift_labels, so loom cannot give it labels "
            "shifted on the whole sequence; use a transformers causal LM, or cp = 1"
        )
    if "shift_labels" not in inspect.signature(loss).parameters:
        raise ValueError(
            f"plan.cp = {cp}: {name}'s loss ({getattr(loss, '__name__', loss)}) takes no shift_labels, so labels "
            "cut over cp would be shifted inside each piece and lose a token at every cut; use a transformers "
            "version whose causal-LM loss takes shift_labels, or cp = 1"
        )
    _register()
    context = ContextAttention(group=mesh.axis_group("cp"), attention=attention)
    names = [path for path, _ in model.named_modules()]
    for path in matching(modules, names, "the recipe's attention modules", model):
        model.get_submodule(path).loom_context = context
    model.set_attn_implementation(ATTENTION)
    calls = [0]  # forwards so far: every rank checks its inputs against its cp peers' on the first

    def cut_inputs(_: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
        kwargs = shard_causal_lm_inputs(args, kwargs, context.group, context.layout, check=calls[0] == 0)
        calls[0] += 1
        return (), kwargs

    model.register_forward_pre_hook(cut_inputs, with_kwargs=True)


def shard_causal_lm_inputs(
    args: tuple,
    kwargs: dict[str, Any],
    group: dist.ProcessGroup,
    layout: str,
    check: bool = False,
) -> dict[str, Any]:
    """A causal LM's forward arguments (each replica's whole sequences) as this rank's keyword arguments:
    every per-token input cut along the sequence as `layout` cuts it over `group`, position ids global, the
    labels shifted on the whole sequence before the cut (`shift_labels`, which the model's loss takes as
    they are). Refuses what a cut sequence cannot take: a padding mask, a cache, unnamed extra arguments,
    DTensors; and, with `check` (every rank of `group` passes the same), inputs that differ between the ranks
    of `group` (one all-gather: they must all bring the replica's same sequences)."""
    if len(args) > 1:
        raise ValueError(
            f"with cp > 1 pass the model's inputs by name (input_ids=..., labels=...); got {len(args)} "
            "positional arguments"
        )
    kwargs = dict(kwargs, **({"input_ids": args[0]} if args else {}))
    if kwargs.get("attention_mask") is not None:
        raise ValueError(
            "attention_mask with cp > 1: loom's context-parallel attention is causal over whole sequences "
            "and takes no padding mask; drop attention_mask (pack or pad the sequences to full length)"
        )
    for key in ("past_key_values", "cache"):
        if kwargs.get(key) is not None:
            raise ValueError(f"{key} with cp > 1: a sequence cut over cp keeps no cache; leave it out")
    kwargs.pop("attention_mask", None)
    kwargs["use_cache"] = False
    others = [
        key
        for key, x in kwargs.items()
        if isinstance(x, torch.Tensor) and x.ndim > 1 and key not in _PER_TOKEN
    ]
    if others:
        raise ValueError(
            f"with cp > 1 loom cuts the per-token inputs {list(_PER_TOKEN)} over the sequence, but not "
            f"{others}; leave them out or use cp = 1"
        )
    given = "input_ids" if kwargs.get("input_ids") is not None else "inputs_embeds"
    tokens = kwargs.get(given)
    if tokens is None:
        raise ValueError("with cp > 1 the model needs input_ids (or inputs_embeds): the sequences to cut")
    for key in _PER_TOKEN:
        if isinstance(kwargs.get(key), DTensor):
            raise ValueError(
                f"{key} is a DTensor: with cp > 1 pass plain tensors, each replica's whole sequences (loom cuts "
                "them over cp itself)"
            )
    if check:  # before any refusal that depends on this rank's inputs: every rank reaches the gather
        _check_same_sequences(kwargs, group)
    batch, seq = tokens.shape[:2]
    cp = dist.get_world_size(group)
    chunks = chunk_count(cp, layout)
    if seq % chunks:
        raise ValueError(
            f"{given}: a sequence of {seq} tokens does not cut over cp = {cp} ({layout!r} layout: {chunks} "
            f"equal chunks); pad the sequences to a multiple of {chunks}"
        )
    if kwargs.get("position_ids") is None:  # the global positions, cut below like the tokens
        kwargs["position_ids"] = torch.arange(seq, device=tokens.device).expand(batch, seq)
    if kwargs.get("labels") is not None and kwargs.get("shift_labels") is None:
        labels = kwargs["labels"]
        kwargs["shift_labels"] = nn.functional.pad(labels, (0, 1), value=_IGNORE_INDEX)[:, 1:]
    if kwargs.get("shift_labels") is not None:
        kwargs["labels"] = kwargs["shift_labels"]  # the loss reads shift_labels; labels only ask for it
    for key in _PER_TOKEN:
        if kwargs.get(key) is not None:
            x = kwargs[key].expand(batch, *kwargs[key].shape[1:]) if key == "position_ids" else kwargs[key]
            kwargs[key] = shard_sequence(x, 1, group, layout=layout).contiguous()
    return kwargs


def _check_same_sequences(kwargs: dict[str, Any], group: dist.ProcessGroup) -> None:
    """Every rank of the cp `group` brings the same per-token inputs (each replica's whole sequences), else a
    ValueError on every rank. Ranks that each brought other rows would attend across unrelated sequences and
    train on a wrong loss without any other sign. One all-gather of a fixed-size summary per rank (for each
    per-token key: given or not, its shape, a digest of its values), so ranks whose inputs differ in any way,
    even in which keys they pass, still meet in it."""
    summary = torch.zeros(len(_PER_TOKEN), 4, dtype=torch.int64)
    for row, key in enumerate(_PER_TOKEN):
        x = kwargs.get(key)
        if isinstance(x, torch.Tensor) and not isinstance(x, DTensor) and x.device.type != "meta":
            shape = list(x.shape[:2]) + [1] * (2 - min(x.ndim, 2))
            summary[row] = torch.tensor([1, *shape, int(_fingerprint(x))])
    tensors = [x for x in kwargs.values() if isinstance(x, torch.Tensor) and x.device.type != "meta"]
    summary = summary.to(tensors[0].device if tensors else "cpu")  # where the group's backend gathers
    gathered = [torch.empty_like(summary) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, summary, group=group)
    differ = [
        key
        for row, key in enumerate(_PER_TOKEN)
        if any(not torch.equal(g[row], summary[row]) for g in gathered)
    ]
    if differ:
        raise ValueError(
            f"{', '.join(differ)} differ across the cp ranks of one replica: with cp > 1 every cp rank passes the "
            "replica's same whole sequences (loom cuts them); split the rows over the data-parallel ranks only"
        )


_GOLDEN = -7046029254386353131  # 0x9E3779B97F4A7C15 as a signed int64: weights that spread every position
_DIGEST_CHUNK = 1 << 20  # elements digested at a time (bounded memory for large embeddings)


def _fingerprint(x: torch.Tensor) -> torch.Tensor:
    """An int64 digest of `x`'s values and their positions (equal tensors give equal digests on any machine:
    floating values are taken by their bits; products wrap, as int64 arithmetic does)."""
    flat = x.detach().reshape(-1)
    if flat.is_floating_point():
        flat = flat.view({1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[flat.element_size()])
    digest = torch.zeros((), dtype=torch.int64)
    for start in range(0, flat.numel(), _DIGEST_CHUNK):
        part = flat[start : start + _DIGEST_CHUNK].long()
        weights = torch.arange(start + 1, start + 1 + part.numel(), dtype=torch.int64, device=part.device)
        digest += (part * (weights * _GOLDEN)).sum().cpu()
    return digest
