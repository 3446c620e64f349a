"""The collectives of one training step, predicted from the model's description and the plan.

One step of a decoder transformer laid out as Megatron does (loom's `tensor_plan` recipes, loom's GPT):
forward, backward, the data-parallel gradient sync and the optimizer step at levels 0-3, on one micro-batch
per data-parallel replica and one pipeline stage. Each entry says what runs, over which mesh axes, how many
bytes (the convention of `loom.dist.comm`: all-reduce the buffer, all-gather the gathered output,
reduce-scatter the input) and how many times. `loom.cost.layer` prices the pieces with these lists, so the
simulator and the prediction are one model; `tests/test_step_collectives.py` checks them against what runs.

What runs, per micro-batch (h hidden, t tokens per data-parallel replica, e bytes per element):
- forward: a tiny all-reduce of the input sizes over the whole mesh (loom's even-batch check); one
  all-reduce of t*h*e over tp after the vocabulary-cut embedding and after each row-parallel matrix; with
  sequence parallelism a reduce-scatter there instead, and an all-gather before each column-parallel block and
  the head; three all-reduces of one fp32 number per row (max, sum of exponentials, target logit) in the
  vocabulary-parallel cross entropy, and, for a mean over counted targets, one of the count over dp;
- backward: the conjugates. The column-parallel inputs' gradients (two per layer, one for the head) are
  summed over tp: one all-reduce after an RMSNorm (its backward is elementwise on the pending sum); after a
  LayerNorm, DTensor's rule reduce-scatters the pending gradient before the norm and all-gathers it after
  (the same bytes, one more collective than Megatron's all-reduce). With sequence parallelism: an all-gather
  per forward reduce-scatter and a reduce-scatter per forward all-gather;
- gradient sync: buckets (`loom.cost.buckets`, the rule `GradSync` applies) per reduction group: tp-cut
  parameters over dp, parameters whose gradient is also pending over tp (norms, learned positions) over
  dp+tp, replicated ones (row-parallel biases) over dp; all-reduced at levels 0-1, reduce-scattered at 2-3;
  then one all-reduce over the whole mesh on which parameters got gradients (32 bytes per parameter);
- optimizer: at levels 1-2 one all-gather per bucket of the updated parameters; at level 3 none after the
  step, but one all-gather per bucket before each unit's forward and again before its backward.

Not predicted: pipelines (pp > 1), experts, context parallelism, gradient accumulation, recomputation (its
forward collectives run again in backward), mixed precision's fp32 gradients.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

from loom.cost.buckets import assign_buckets, bucket_bytes
from loom.cost.compute import DTYPE_BYTES
from loom.cost.plan import ParallelPlan
from loom.cost.transformer import TransformerConfig

__all__ = [
    "AGREE_BYTES_PER_PARAMETER",
    "StepCollective",
    "embedding_collectives",
    "gradient_collectives",
    "group_size",
    "head_collectives",
    "layer_collectives",
    "step_collectives",
    "summary",
]

AGREE_BYTES_PER_PARAMETER = (
    32  # GradSync's flags: 2 rows (any rank, minus every rank) x 2 float64 per parameter
)
CHECK_BYTES_PER_INPUT = 8  # loom's even-batch check: a float32 size and its negation per tensor input
ROW_BYTES = 4  # cross entropy's per-row numbers are fp32 (the logits are upcast for the loss)

DP, TP, WORLD = "dp", "tp", "dp+tp"


@dataclass(frozen=True, kw_only=True)
class StepCollective:
    """`count` collectives of one `kind` over mesh `axis` ("dp", "tp" or "dp+tp"), `nbytes` each, issued in
    `phase` ("forward", "backward", "grad_sync", "optimizer") by `source` (what issues them)."""

    kind: str
    axis: str
    nbytes: int
    count: int
    phase: str
    source: str


def group_size(axis: str, plan: ParallelPlan) -> int:
    """Ranks of a group over `axis` ("dp", "tp", "dp+tp") under `plan`."""
    return {DP: plan.dp, TP: plan.tp, WORLD: plan.dp * plan.tp}[axis]


def _keep(items: Iterable[StepCollective], plan: ParallelPlan) -> list[StepCollective]:
    """Only what runs: no collective over a group of one, none issued zero times."""
    return [c for c in items if c.count > 0 and group_size(c.axis, plan) > 1]


def _stream_bytes(model: TransformerConfig, plan: ParallelPlan) -> int:
    """The residual stream of one micro-batch on one data-parallel replica (tokens x hidden)."""
    return DTYPE_BYTES[plan.dtype] * plan.micro_batch * plan.seq * model.hidden


def _norm_backward(model: TransformerConfig, plan: ParallelPlan, count: int, source: str) -> list:
    """Summing `count` pending input gradients over tp where they meet a norm's backward."""
    nbytes, sp = _stream_bytes(model, plan), plan.sequence_parallel
    if sp:  # Megatron's conjugate of the forward all-gather
        return [StepCollective(kind="reduce_scatter", axis=TP, nbytes=nbytes, count=count, phase="backward",
                               source=source)]  # fmt: skip
    if model.norm == "rmsnorm":
        return [StepCollective(kind="all_reduce", axis=TP, nbytes=nbytes, count=count, phase="backward",
                               source=source)]  # fmt: skip
    lnorm = f"{source} (LayerNorm backward: DTensor reduce-scatters the pending gradient, gathers it after)"
    return [
        StepCollective(
            kind="reduce_scatter", axis=TP, nbytes=nbytes, count=count, phase="backward", source=lnorm
        ),
        StepCollective(
            kind="all_gather", axis=TP, nbytes=nbytes, count=count, phase="backward", source=lnorm
        ),
    ]


def layer_collectives(model: TransformerConfig, plan: ParallelPlan) -> list[StepCollective]:
    """Tensor-parallel collectives of one transformer layer, one micro-batch, forward and backward."""
    nbytes, e, sp = _stream_bytes(model, plan), DTYPE_BYTES[plan.dtype], plan.sequence_parallel
    tokens = plan.micro_batch * plan.seq
    out: list[StepCollective] = []
    if sp:
        out += [
            StepCollective(kind="all_gather", axis=TP, nbytes=nbytes, count=2, phase="forward",
                           source="sequence parallel: the stream gathered before each column-parallel block"),
            StepCollective(kind="reduce_scatter", axis=TP, nbytes=nbytes, count=2, phase="forward",
                           source="sequence parallel: row-parallel outputs summed and scattered over sequence"),
            StepCollective(kind="all_gather", axis=TP, nbytes=nbytes, count=2, phase="backward",
                           source="sequence parallel: conjugate of the row-parallel reduce-scatters"),
        ]  # fmt: skip
    else:
        out.append(StepCollective(kind="all_reduce", axis=TP, nbytes=nbytes, count=2, phase="forward",
                                  source="row-parallel outputs summed (attention, MLP)"))  # fmt: skip
    out += _norm_backward(model, plan, 2, "column-parallel input gradients summed (attention, MLP)")
    if model.fused_qkv:
        qkv = e * tokens * (model.heads + 2 * model.kv) * model.head_dim
        source = "fused query/key/value output gathered at its split (a column cut of one matrix)"
        out += [
            StepCollective(kind="all_gather", axis=TP, nbytes=qkv, count=1, phase="forward", source=source),
            StepCollective(kind="all_gather", axis=TP, nbytes=nbytes, count=1, phase="backward",
                           source=source + ": DTensor gathers one piece's gradient for the split's backward"),
        ]  # fmt: skip
    return _keep(out, plan)


def embedding_collectives(model: TransformerConfig, plan: ParallelPlan) -> list[StepCollective]:
    """The vocabulary-cut embedding's tensor-parallel collectives, one micro-batch."""
    nbytes, sp = _stream_bytes(model, plan), plan.sequence_parallel
    kind = "reduce_scatter" if sp else "all_reduce"
    out = [StepCollective(kind=kind, axis=TP, nbytes=nbytes, count=1, phase="forward",
                          source="vocabulary-cut embedding's partial rows summed")]  # fmt: skip
    if sp:
        out.append(StepCollective(kind="all_gather", axis=TP, nbytes=nbytes, count=1, phase="backward",
                                  source="sequence parallel: conjugate of the embedding's reduce-scatter"))  # fmt: skip
        if model.learned_positions:
            positions = DTYPE_BYTES[plan.dtype] * plan.seq * model.hidden
            source = (
                "learned positions' gradient, cut by sequence, gathered and summed by DTensor (no bucket)"
            )
            out += [
                StepCollective(kind="all_gather", axis=TP, nbytes=positions, count=1, phase="backward",
                               source=source),
                StepCollective(kind="all_reduce", axis=DP, nbytes=positions, count=1, phase="backward",
                               source=source),
            ]  # fmt: skip
    return _keep(out, plan)


def head_collectives(
    model: TransformerConfig, plan: ParallelPlan, *, counted_loss: bool = True
) -> list[StepCollective]:
    """The final norm's, vocabulary-parallel head's and cross entropy's collectives, one micro-batch.
    `counted_loss`: the loss is a mean over the targets that are not ignored (Hugging Face's), whose count
    is summed over dp."""
    nbytes, sp = _stream_bytes(model, plan), plan.sequence_parallel
    rows = ROW_BYTES * plan.micro_batch * plan.seq
    out = [StepCollective(kind="all_reduce", axis=TP, nbytes=rows, count=3, phase="forward",
                          source="vocabulary-parallel cross entropy: per-row max, sum of exponentials, target")]  # fmt: skip
    if sp:
        out.append(StepCollective(kind="all_gather", axis=TP, nbytes=nbytes, count=1, phase="forward",
                                  source="sequence parallel: the stream gathered before the head"))  # fmt: skip
    if counted_loss:
        out.append(StepCollective(kind="all_reduce", axis=DP, nbytes=4, count=1, phase="forward",
                                  source="cross entropy: the count of targets summed over dp"))  # fmt: skip
    out += _norm_backward(model, plan, 1, "the head's input gradient summed")
    return _keep(out, plan)


@dataclass(frozen=True)
class _Param:
    """One parameter as the gradient sync sees it: local elements, reduction group, level-3 unit."""

    numel: int
    axis: str
    copies: int
    unit: str


def _layer_params(model: TransformerConfig, plan: ParallelPlan, unit: str) -> list[_Param]:
    """One layer's parameters in registration order (attention norm, projections, MLP norm, MLP)."""
    t, h, d, f = plan.tp, model.hidden, model.head_dim, model.ffn
    q, kv = model.heads * d, model.kv * d
    norm = [_Param(h, WORLD, 1, unit)] * (2 if model.norm == "layernorm" else 1)
    widths = [q + 2 * kv] if model.fused_qkv else [q, kv, kv]  # one matrix, or three
    cut = [_Param(h * w // t, DP, 1, unit) for w in widths]
    if model.biases:
        cut += [_Param(w // t, DP, 1, unit) for w in widths]
    attention = cut + [_Param(q * h // t, DP, 1, unit)]
    mats = 3 if model.gated_mlp else 2
    mlp = [_Param(h * f // t, DP, 1, unit) for _ in range(mats)]
    if model.biases:  # column-parallel biases are cut; row-parallel ones are replicated over tp
        mlp += [_Param(f // t, DP, 1, unit) for _ in range(mats - 1)]
        attention.append(_Param(h, DP, t, unit))
        mlp.append(_Param(h, DP, t, unit))
    return norm + attention + norm + mlp


def _parameters(model: TransformerConfig, plan: ParallelPlan) -> list[_Param]:
    """Every parameter in a gradient bucket, in registration order, with its level-3 unit (each layer; the
    embedding, the final norm and an untied head alone; a tied table in the root). Learned positions are
    the only parameter of their reduction group, so their unit never changes a bucket."""
    t, h = plan.tp, model.hidden
    table = "root" if model.tied_embeddings else "embedding"
    params = [_Param(model.vocab * h // t, DP, 1, table)]
    if model.learned_positions and not plan.sequence_parallel:  # with it DTensor reduces them (no bucket)
        params.append(_Param(model.learned_positions * h, WORLD, 1, "positions"))
    for layer in range(model.layers):
        params += _layer_params(model, plan, f"layer{layer}")
    norms = 2 if model.norm == "layernorm" else 1
    params += [_Param(h, WORLD, 1, "norm")] * norms
    if not model.tied_embeddings:
        params.append(_Param(model.vocab * h // t, DP, 1, "head"))
    return params


def gradient_collectives(
    model: TransformerConfig, plan: ParallelPlan, *, bucket_mb: float = 25.0
) -> list[StepCollective]:
    """The data-parallel gradient sync and the optimizer level's gathers of one step (see the module's
    docstring). Buckets come from `loom.cost.buckets.assign_buckets` over the parameters in reverse
    registration order (about the order backward produces gradients)."""
    e, level = DTYPE_BYTES[plan.dtype], plan.optimizer_level
    params = list(reversed(_parameters(model, plan)))
    keys = [((p.axis, p.copies, p.unit if level == 3 else None), p.numel * e) for p in params]
    out: list[StepCollective] = []
    for indices in assign_buckets(keys, bucket_bytes(bucket_mb)):
        axis = params[indices[0]].axis
        numel = sum(params[i].numel for i in indices)
        ranks = group_size(axis, plan)
        padded = -(-numel // ranks) * ranks * e  # split evenly over the group, the last chunk padded
        if level < 2:
            out.append(StepCollective(kind="all_reduce", axis=axis, nbytes=numel * e, count=1,
                                      phase="grad_sync", source="gradient bucket"))  # fmt: skip
        else:
            out.append(StepCollective(kind="reduce_scatter", axis=axis, nbytes=padded, count=1,
                                      phase="grad_sync", source="gradient bucket, sharded (level 2-3)"))  # fmt: skip
        if level in (1, 2):
            out.append(StepCollective(kind="all_gather", axis=axis, nbytes=padded, count=1,
                                      phase="optimizer", source="updated parameters of a bucket (level 1-2)"))  # fmt: skip
        if level == 3:
            out += [
                StepCollective(kind="all_gather", axis=axis, nbytes=padded, count=1, phase=phase,
                               source="a unit's parameters gathered before its " + phase + " (level 3)")
                for phase in ("forward", "backward")
            ]  # fmt: skip
    count = len(params) + (1 if model.learned_positions and plan.sequence_parallel else 0)
    out.append(StepCollective(kind="all_reduce", axis=WORLD, nbytes=AGREE_BYTES_PER_PARAMETER * count,
                              count=1, phase="grad_sync", source="which parameters got a gradient"))  # fmt: skip
    return _keep(out, plan)


def step_collectives(
    model: TransformerConfig,
    plan: ParallelPlan,
    *,
    bucket_mb: float = 25.0,
    inputs: int = 2,
    counted_loss: bool = True,
) -> list[StepCollective]:
    """Every collective of one training step of `model` under `plan` on one rank (see the module's
    docstring): `plan.micro_batch` sequences of `plan.seq` tokens per data-parallel replica, Megatron's
    layouts over tp (tp > 1: loom lays the model out with DTensor), gradient buckets of `bucket_mb`, a
    forward that takes `inputs` tensors (token ids and labels), and a loss that is a mean over counted
    targets (`counted_loss`, Hugging Face's) or a plain mean (loom's GPT)."""
    if plan.pp > 1 or plan.ep > 1 or plan.micro_batches > 1:
        raise ValueError(
            "step_collectives predicts one micro-batch per replica on dp x tp (pp = ep = 1); "
            f"got pp={plan.pp}, ep={plan.ep}, {plan.micro_batches} micro-batches"
        )
    if plan.tp == 1:
        raise ValueError("step_collectives predicts tensor-parallel layouts (tp > 1, loom's semi_auto mode)")
    check = StepCollective(kind="all_reduce", axis=WORLD, nbytes=CHECK_BYTES_PER_INPUT * inputs, count=1,
                           phase="forward", source="even-batch check of the inputs' sizes")  # fmt: skip
    layer = [
        StepCollective(**{**vars(c), "count": c.count * model.layers}) for c in layer_collectives(model, plan)
    ]
    return _keep(
        [check, *embedding_collectives(model, plan), *layer,
         *head_collectives(model, plan, counted_loss=counted_loss),
         *gradient_collectives(model, plan, bucket_mb=bucket_mb)],
        plan,
    )  # fmt: skip


def summary(collectives: Iterable[StepCollective]) -> Counter:
    """Counter of (kind, axis, bytes) -> calls: what `loom.dist.comm.CollectiveRecorder.summary` records."""
    counts: Counter = Counter()
    for c in collectives:
        counts[(c.kind, c.axis, c.nbytes)] += c.count
    return counts
