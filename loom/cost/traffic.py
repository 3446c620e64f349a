"""The collectives of one training step, predicted from the model's description and the plan.

One step of a decoder transformer laid out as Megatron does (loom's `tensor_plan` recipes, loom's GPT):
forward, backward, the data-parallel gradient sync and the optimizer step at levels 0-3, on one micro-batch
per data-parallel replica and one pipeline stage, or a pipeline's step (below). Each entry says what runs,
over which mesh axes (as the mesh names the group: its axes of size 1 left out), how many bytes (the
convention of `loom.dist.comm`: all-reduce the buffer, all-gather the gathered output, reduce-scatter the
input, send and receive the buffer) and how many times. `loom.cost.layer` prices the pieces with these
lists, so the simulator and the prediction are one model; `tests/test_step_collectives.py` and
`tests/test_pipeline_collectives.py` check them against what runs.

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

A pipeline's step (pp > 1: `loom.parallel.pipeline`, one `Trainer` step of one or several pipeline runs of
`micro_batches` micro-batches each, under any of loom's schedules), per pipeline rank, for each of its
stages (stage v on rank v % pp; zbv's V: stages v and 2pp-1-v on rank v):
- per micro-batch, the stage's forward and backward: its layers' tensor-parallel collectives as above, the
  embedding's on the first stage, the head's and the loss's on the last; only on a stage mesh (tp > 1),
  the count of targets over dp (the loss itself is not reduced per micro-batch: each rank keeps its share;
  the first stage checks its input's rows once per input shape, in the first step, not in the steady step
  predicted here); the residual stream (`stage_stream_bytes`: this rank's rows, whole over tp, with
  sequence parallelism its cut of the sequence) received from the stage before and sent to the one after,
  and its gradient the other way (send and receive over pp; none between two stages of one rank);
- gradient sync (once, in the step's last run): one `GradSync` over the rank's stages, buckets as above
  over the stage's ranks (dp+tp; with tp = 1 every gradient over dp, one group); a table tied to the head
  (copies on the first and the last stage) in its own bucket over both holders' replicas ("pp+dp"; zbv
  holds both on one rank: one tensor, reduced as the token table is); the agreement over dp+tp. A plain
  stage (tp = 1) fixes its buckets in registration order, which the description knows by piece (blocks,
  then embedding, norm, head) but not inside a layer (a Hugging Face Llama registers its norms last): its
  buckets are exact when none is cut inside a layer (the default 25 MB holds a small stage whole);
- optimizer: levels 1-2 as above (a stage run by one rank alone keeps a plain optimizer); at level 3 a
  stage is one unit, gathered before each forward and each backward pass of each micro-batch (a
  zero-bubble schedule's backward is two: input, then weight gradient), and a tied table is gathered once
  per run;
- the step: the loss summed over the world (`Pipeline.global_loss`), and the squared gradient norm
  (`Trainer`'s global norm).

Context parallelism (cp > 1, loom's GPT without pipelines): each rank holds seq / cp tokens of each of its
sequences, which count as rows of their own, so the tensor-parallel collectives above move seq / cp tokens,
what went over dp goes over dp+cp (the gradient sync, the loss's count) and the even-batch check over the
whole mesh; each layer adds its attention's exchanges over cp (`loom.cost.context`: Ulysses' all-to-alls or
ring attention's sends and receives).

Not predicted: experts, context parallelism with learned positions or pipelines, gradient accumulation
without a pipeline, recomputation (its forward collectives run again in backward), mixed precision's fp32
gradients.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from loom.cost.buckets import assign_buckets, bucket_bytes
from loom.cost.compute import DTYPE_BYTES
from loom.cost.plan import ParallelPlan
from loom.cost.transformer import TransformerConfig

__all__ = [
    "AGREE_BYTES_PER_PARAMETER",
    "StepCollective",
    "attention_collectives",
    "axis_name",
    "embedding_collectives",
    "gradient_collectives",
    "group_size",
    "head_collectives",
    "layer_collectives",
    "pipeline_collectives",
    "shards_as_rows",
    "stage_layers",
    "stage_gather_bytes",
    "stage_stream_bytes",
    "stream_bytes",
    "step_collectives",
    "summary",
]

AGREE_BYTES_PER_PARAMETER = (
    32  # GradSync's flags: 2 rows (any rank, minus every rank) x 2 float64 per parameter
)
CHECK_BYTES_PER_INPUT = 8  # loom's even-batch check: a float32 size and its negation per tensor input
ROW_BYTES = 4  # cross entropy's per-row numbers are fp32 (the logits are upcast for the loss)

DP, CP, TP, PP, WORLD = "dp", "cp", "tp", "pp", "dp+tp"
PIPELINE_WORLD = "pp+dp+tp"  # every rank of a pipeline run
TIED = "pp+dp"  # the replicas of the pipeline ranks that hold a tied table's copies (the first and the last)
LOSS_BYTES, NORM_BYTES = 4, 8  # the step's loss (fp32) and its squared gradient norm (fp64), summed
SPLIT_BACKWARD = ("zero_bubble", "zbv")  # schedules whose backward is two passes (input, then weight)


@dataclass(frozen=True, kw_only=True)
class StepCollective:
    """`count` collectives of one `kind` (`loom.dist.comm.KINDS`: "all_reduce", ..., "send", "recv") over
    mesh `axis` ("dp", "tp", "dp+tp", with pipelines also "pp", "pp+dp", "pp+dp+tp"), `nbytes` each, issued
    in `phase` ("forward", "backward", "grad_sync", "optimizer", "step") by `source` (what issues them)."""

    kind: str
    axis: str
    nbytes: int
    count: int
    phase: str
    source: str


def _axis_sizes(axis: str, plan: ParallelPlan) -> dict[str, int]:
    """The size of each mesh axis of `axis` (axes joined by "+")."""
    sizes = {PP: plan.pp, DP: plan.dp, CP: plan.cp, TP: plan.tp}
    return {name: sizes[name] for name in axis.split("+")}


def group_size(axis: str, plan: ParallelPlan) -> int:
    """Ranks of a group over `axis`, mesh axes joined by "+" ("dp", "tp", "dp+tp", "pp+dp+tp", ...)."""
    return math.prod(_axis_sizes(axis, plan).values())


def axis_name(axis: str, plan: ParallelPlan) -> str:
    """`axis` as the mesh names its group (`loom.dist.comm.mesh_axes` over the axes of size > 1): without
    its axes of size 1 ("dp+tp" with dp = 1 is "tp"), "" for a group of one."""
    return "+".join(name for name, size in _axis_sizes(axis, plan).items() if size > 1)


def _keep(items: Iterable[StepCollective], plan: ParallelPlan) -> list[StepCollective]:
    """Only what runs: no collective over a group of one, none issued zero times."""
    return [c for c in items if c.count > 0 and group_size(c.axis, plan) > 1]


def _named(items: Iterable[StepCollective], plan: ParallelPlan) -> list[StepCollective]:
    """What runs, each over its group as the mesh names it (`axis_name`)."""
    return [dataclasses.replace(c, axis=axis_name(c.axis, plan)) for c in _keep(items, plan)]


def _times(items: Iterable[StepCollective], n: int) -> list[StepCollective]:
    """`items` issued `n` times as often (per layer, per micro-batch)."""
    return [dataclasses.replace(c, count=c.count * n) for c in items]


def stream_bytes(model: TransformerConfig, plan: ParallelPlan) -> int:
    """The residual stream of one micro-batch on one data-parallel replica (tokens x hidden): what each
    sequence-parallel all-gather and reduce-scatter of a layer moves."""
    return DTYPE_BYTES[plan.dtype] * plan.micro_batch * plan.seq * model.hidden


def stage_stream_bytes(model: TransformerConfig, plan: ParallelPlan) -> int:
    """What one rank sends to the next pipeline stage per micro-batch (and receives back as the gradient):
    its piece of the residual stream, its rows whole over tp (every tp rank sends the same stream: loom
    moves plain tensors between stages and does not split them over tp), with sequence parallelism its cut
    of the sequence, with `scatter_gather_p2p` its 1/tp share (`stage_gather_bytes` rebuilds the stream).
    `loom.cost.layer` prices pipeline sends with it."""
    return stream_bytes(model, plan) // (plan.tp if plan.sequence_parallel or plan.scatter_gather_p2p else 1)


def stage_gather_bytes(model: TransformerConfig, plan: ParallelPlan) -> int:
    """The all-gather over tp that rebuilds a received stream sent in 1/tp shares (`scatter_gather_p2p`
    without sequence parallelism, whose layers take the cut stream as it is); 0 when none runs."""
    split = plan.scatter_gather_p2p and not plan.sequence_parallel and plan.tp > 1
    return stream_bytes(model, plan) if split else 0


def _norm_backward(model: TransformerConfig, plan: ParallelPlan, count: int, source: str) -> list:
    """Summing `count` pending input gradients over tp where they meet a norm's backward."""
    nbytes, sp = stream_bytes(model, plan), plan.sequence_parallel
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
    nbytes, e, sp = stream_bytes(model, plan), DTYPE_BYTES[plan.dtype], plan.sequence_parallel
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
    nbytes, sp = stream_bytes(model, plan), plan.sequence_parallel
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
    nbytes, sp = stream_bytes(model, plan), plan.sequence_parallel
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
    ranks: int = 0  # ranks of its reduction group when the axis does not say (a tied table's holders)


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


def _embedding_params(model: TransformerConfig, plan: ParallelPlan) -> list[_Param]:
    """The token table (its own unit; with tied embeddings the root's) and learned positions, in
    registration order. Learned positions are the only parameter of their reduction group, so their unit
    never changes a bucket; with sequence parallelism DTensor reduces them (no bucket: see `_unbucketed`)."""
    table = "root" if model.tied_embeddings else "embedding"
    params = [_Param(model.vocab * model.hidden // plan.tp, DP, 1, table)]
    if model.learned_positions and not plan.sequence_parallel:
        params.append(_Param(model.learned_positions * model.hidden, WORLD, 1, "positions"))
    return params


def _unbucketed(model: TransformerConfig, plan: ParallelPlan) -> int:
    """Parameters next to the embedding that get a gradient outside the buckets (sequence-parallel learned
    positions, which DTensor reduces): the agreement still counts them."""
    return 1 if model.learned_positions and plan.sequence_parallel else 0


def _final_params(model: TransformerConfig, plan: ParallelPlan) -> list[_Param]:
    """The final norm (its own unit) and an untied head (its own unit), in registration order."""
    norms = 2 if model.norm == "layernorm" else 1
    params = [_Param(model.hidden, WORLD, 1, "norm")] * norms
    if not model.tied_embeddings:
        params.append(_Param(model.vocab * model.hidden // plan.tp, DP, 1, "head"))
    return params


def _parameters(model: TransformerConfig, plan: ParallelPlan) -> list[_Param]:
    """Every parameter in a gradient bucket, in registration order, with its level-3 unit (each layer; the
    embedding, the final norm and an untied head alone; a tied table in the root)."""
    params = _embedding_params(model, plan)
    for layer in range(model.layers):
        params += _layer_params(model, plan, f"layer{layer}")
    return params + _final_params(model, plan)


def gradient_collectives(
    model: TransformerConfig, plan: ParallelPlan, *, bucket_mb: float = 25.0
) -> list[StepCollective]:
    """The data-parallel gradient sync and the optimizer level's gathers of one step (see the module's
    docstring): each level-3 unit gathered once before its forward and once before its backward."""
    params = _parameters(model, plan)
    once = [("forward", 1), ("backward", 1)]
    return _sync_collectives(
        params, plan, bucket_mb=bucket_mb, gathers=lambda unit: once,
        agreed=len(params) + _unbucketed(model, plan),
    )  # fmt: skip


def _sync_collectives(
    params: list[_Param],
    plan: ParallelPlan,
    *,
    bucket_mb: float,
    gathers: Callable[[str], list[tuple[str, int]]],
    agreed: int,
) -> list[StepCollective]:
    """The buckets of `params` (registration order) and what each costs at the plan's optimizer level, then
    the agreement on which of `agreed` parameters got a gradient (over the ranks that run them: "dp+tp").
    Buckets come from `loom.cost.buckets.assign_buckets` over the parameters in reverse registration order
    (about the order backward produces gradients), keyed by their reduction group as the mesh names it
    (with tp = 1 the norms' dp+tp is dp: one group), their copies and, at level 3, their unit;
    `gathers(unit)` says how often a level-3 unit is gathered, as (phase, count) pairs."""
    e, level = DTYPE_BYTES[plan.dtype], plan.optimizer_level
    params = list(reversed(params))
    keys = [
        ((axis_name(p.axis, plan), p.copies, p.unit if level == 3 else None), p.numel * e) for p in params
    ]
    out: list[StepCollective] = []
    for indices in assign_buckets(keys, bucket_bytes(bucket_mb)):
        first = params[indices[0]]
        numel = sum(params[i].numel for i in indices)
        ranks = first.ranks or group_size(first.axis, plan)
        padded = -(-numel // ranks) * ranks * e  # split evenly over the group, the last chunk padded
        axis = first.axis
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
                StepCollective(kind="all_gather", axis=axis, nbytes=padded, count=count, phase=phase,
                               source="a unit's parameters gathered before its " + phase + " (level 3)")
                for phase, count in gathers(first.unit)
            ]  # fmt: skip
    out.append(StepCollective(kind="all_reduce", axis=WORLD, nbytes=AGREE_BYTES_PER_PARAMETER * agreed,
                              count=1, phase="grad_sync", source="which parameters got a gradient"))  # fmt: skip
    return _keep(out, plan)


def step_collectives(
    model: TransformerConfig,
    plan: ParallelPlan,
    *,
    bucket_mb: float = 25.0,
    inputs: int = 2,
    counted_loss: bool = True,
    pp_rank: int = 0,
    schedule: str | None = None,
    accumulation: int = 1,
) -> list[StepCollective]:
    """Every collective of one training step of `model` under `plan` on one rank (see the module's
    docstring): `plan.micro_batch` sequences of `plan.seq` tokens per data-parallel replica, Megatron's
    layouts over tp (tp > 1: loom lays the model out with DTensor), gradient buckets of `bucket_mb`, a
    forward that takes `inputs` tensors (token ids and labels), and a loss that is a mean over counted
    targets (`counted_loss`, Hugging Face's) or a plain mean (loom's GPT). With pp > 1: one `Trainer` step
    of a rank of pipeline rank `pp_rank` under `schedule` (default the plan's), in `accumulation` runs
    (`pipeline_collectives`)."""
    if plan.grad_accumulation != "fused":
        raise ValueError(
            f"step_collectives predicts loom's own runtime, whose gradients accumulate fused; grad_accumulation "
            f"{plan.grad_accumulation!r} prices another system's run (loom simulate): use 'fused'"
        )
    if plan.cp > 1 and plan.pp > 1:
        raise ValueError("step_collectives predicts context parallelism without pipelines (pp = 1)")
    if plan.pp > 1:
        return pipeline_collectives(
            model, plan, pp_rank, bucket_mb=bucket_mb, counted_loss=counted_loss, schedule=schedule,
            accumulation=accumulation,
        )  # fmt: skip
    if plan.ep > 1 or plan.micro_batches > 1:
        raise ValueError(
            "step_collectives predicts one micro-batch per replica on dp x tp (pp = ep = 1), or a "
            f"pipeline; got pp={plan.pp}, ep={plan.ep}, {plan.micro_batches} micro-batches"
        )
    if plan.tp == 1:
        raise ValueError("step_collectives predicts tensor-parallel layouts (tp > 1, loom's semi_auto mode)")
    if plan.cp > 1 and model.learned_positions:
        raise ValueError("step_collectives predicts context parallelism with rotary positions only")
    rows = shards_as_rows(plan)
    check = StepCollective(kind="all_reduce", axis=WORLD, nbytes=CHECK_BYTES_PER_INPUT * inputs, count=1,
                           phase="forward", source="even-batch check of the inputs' sizes")  # fmt: skip
    layer = layer_collectives(model, rows) + attention_collectives(model, plan)
    return _named(
        _batch_over_cp(
            [check, *embedding_collectives(model, rows), *_times(layer, model.layers),
             *head_collectives(model, rows, counted_loss=counted_loss),
             *gradient_collectives(model, rows, bucket_mb=bucket_mb)],
            plan,
        ),
        plan,
    )  # fmt: skip


def shards_as_rows(plan: ParallelPlan) -> ParallelPlan:
    """The plan as loom's GPT runs it under cp > 1: each rank's piece of a sequence (seq / cp tokens) is a
    row of its own, the batch cut over dp * cp (named back to dp+cp by `_batch_over_cp`). The simulator
    prices everything but attention on it: token-local work, tensor-parallel collectives, and the gradient
    reduction over dp x cp (ranks tp apart, as the mesh orders pp, dp, cp, tp). The plan itself for cp = 1."""
    if plan.cp == 1:
        return plan
    if plan.seq % plan.cp:
        raise ValueError(f"a sequence of {plan.seq} tokens does not cut into cp = {plan.cp} equal shards")
    return dataclasses.replace(
        plan, dp=plan.dp * plan.cp, cp=1, global_batch=plan.global_batch * plan.cp, seq=plan.seq // plan.cp
    )


def _batch_over_cp(items: list[StepCollective], plan: ParallelPlan) -> list[StepCollective]:
    """With cp > 1 the collectives of `shards_as_rows`' batch axis run over dp+cp."""
    if plan.cp == 1:
        return items
    return [dataclasses.replace(c, axis=c.axis.replace(DP, f"{DP}+{CP}")) for c in items]


def attention_collectives(model: TransformerConfig, plan: ParallelPlan) -> list[StepCollective]:
    """One layer's context-parallel attention exchanges over cp, forward and backward (none for cp = 1):
    each tp rank's heads, on the rank's micro-batch."""
    if plan.cp == 1:
        return []
    # imported here: loom.cost.context builds on this module's StepCollective
    from loom.cost.context import megatron_p2p_collectives, ring_collectives, ulysses_collectives

    formulas = {
        "ulysses": ulysses_collectives,
        "ring": ring_collectives,
        "megatron_p2p": megatron_p2p_collectives,
    }
    formula = formulas[plan.attention]
    return formula(
        batch=plan.micro_batch, seq=plan.seq, heads=model.heads // plan.tp, kv_heads=model.kv // plan.tp,
        head_dim=model.head_dim, cp=plan.cp, dtype_bytes=DTYPE_BYTES[plan.dtype],
    )  # fmt: skip


def stage_layers(model: TransformerConfig, plan: ParallelPlan) -> list[int]:
    """Layers of each pipeline stage in model order: the plan's `stage_layers`, else an even split (as
    loom cuts a model whose layers divide evenly)."""
    if not plan.stage_layers and model.layers % plan.virtual_stages:
        raise ValueError(
            f"{model.layers} layers do not split evenly into {plan.virtual_stages} pipeline stages; give "
            "the plan's stages as layer counts"
        )
    return plan.chunk_layers(model.layers)


def _stage_rank(plan: ParallelPlan, schedule: str, stage: int) -> int:
    """The pipeline rank that runs stage `stage`: stage v on rank v % pp, or, in zbv's V placement, stage v
    on rank v for v < pp and on rank 2pp-1-v after (`loom.parallel.pipeline.stage_indices`)."""
    if schedule == "zbv" and stage >= plan.pp:
        return 2 * plan.pp - 1 - stage
    return stage % plan.pp


def _rank_stages(plan: ParallelPlan, schedule: str, pp_rank: int) -> list[int]:
    """The stages pipeline rank `pp_rank` runs, in the order its `Pipeline` takes them."""
    if not 0 <= pp_rank < plan.pp:
        raise ValueError(f"pp_rank {pp_rank} is not a pipeline rank of pp = {plan.pp}")
    if schedule == "zbv":
        return [pp_rank, 2 * plan.pp - 1 - pp_rank]
    return list(range(pp_rank, plan.virtual_stages, plan.pp))


def _stage_params(
    model: TransformerConfig, plan: ParallelPlan, stage: int, layers: list[int], *, tied_here: bool = False
) -> list[_Param]:
    """Stage `stage`'s parameters in the order its buckets take them reversed: a plain stage's buckets are
    fixed in its registration order (a `BlockStage`: its layers, then the embedding on the first stage, the
    final norm and the head on the last), a stage mesh's (tp > 1) learnt from backward's order, the model's
    reversed. At level 3 a stage is one unit; a tied table (a copy on the first and on the last stage) is
    its own, reduced over both holders' replicas, or, when one rank runs both stages (`tied_here`: zbv's V),
    one tensor reduced over the stage's ranks as the token table is; the last stage's use adds none."""
    start, last = sum(layers[:stage]), len(layers) - 1
    params = [p for layer in range(start, start + layers[stage]) for p in _layer_params(model, plan, "")]
    if stage == 0:
        embedding = _embedding_params(model, plan)
        params = embedding + params if plan.tp > 1 else params + embedding
    if stage == last:
        params += _final_params(model, plan)
        params += _embedding_params(model, plan)[:1] if model.tied_embeddings and not tied_here else []
    tied = dict(unit="shared") if tied_here else dict(axis=TIED, unit="shared", ranks=2 * plan.dp)
    return [
        dataclasses.replace(p, **tied) if p.unit == "root" else dataclasses.replace(p, unit=f"stage{stage}")
        for p in params
    ]


def pipeline_collectives(
    model: TransformerConfig,
    plan: ParallelPlan,
    pp_rank: int,
    *,
    bucket_mb: float = 25.0,
    counted_loss: bool = True,
    schedule: str | None = None,
    accumulation: int = 1,
) -> list[StepCollective]:
    """Every collective of one `Trainer` step of a pipeline (`loom.parallel.pipeline.model_pipeline` or
    `gpt_pipeline`) on a rank of pipeline rank `pp_rank`: `plan.micro_batches` micro-batches of
    `plan.micro_batch` sequences per replica through this rank's stages (see the module's docstring), in
    `accumulation` runs of the pipeline (the `Trainer`'s micro-batches, each one schedule run of
    `plan.micro_batches / accumulation` micro-batches; the gradients reduced in the last). `schedule`: any
    of loom's (`loom.plan.SCHEDULES`; default the plan's), the zero-bubble ones included."""
    schedule = schedule or plan.schedule
    stages, layers = _rank_stages(plan, schedule, pp_rank), stage_layers(model, plan)
    if plan.ep > 1:
        raise ValueError("pipeline_collectives does not predict experts (ep > 1)")
    if accumulation < 1 or plan.micro_batches % accumulation:
        raise ValueError(
            f"{plan.micro_batches} micro-batches per replica do not split into {accumulation} pipeline runs"
        )
    if plan.dp * plan.tp == 1:  # a stage run by one rank: a plain optimizer, nothing to shard over
        plan = plan.replace(optimizer_level=0)
    micro_batches, out = plan.micro_batches, []
    for stage in stages:
        work = _stage_work(model, plan, stage, layers, counted_loss, lambda v: _stage_rank(plan, schedule, v))
        out += _times(work, micro_batches)
    tied_here = len(layers) - 1 in stages and 0 in stages and model.tied_embeddings
    params = [p for stage in stages for p in _stage_params(model, plan, stage, layers, tied_here=tied_here)]
    # level 3: a stage is gathered around each of its pieces of work (a zero-bubble schedule's backward is
    # two: the input gradient, then the weight gradient); a table two stages use once per run (pinned)
    passes = 2 if schedule in SPLIT_BACKWARD else 1
    pieces = [("forward", micro_batches), ("backward", passes * micro_batches)]
    agreed = len(params) + (_unbucketed(model, plan) if 0 in stages else 0)
    out += _sync_collectives(
        params, plan, bucket_mb=bucket_mb, agreed=agreed,
        gathers=lambda unit: [("forward", accumulation)] if unit == "shared" else pieces,
    )  # fmt: skip
    out += [
        StepCollective(kind="all_reduce", axis=PIPELINE_WORLD, nbytes=LOSS_BYTES, count=1, phase="step",
                       source="the step's loss, from the last stage to every rank (Pipeline.global_loss)"),
        StepCollective(kind="all_reduce", axis=PIPELINE_WORLD, nbytes=NORM_BYTES, count=1, phase="step",
                       source="the squared gradient norm summed (Trainer's global norm)"),
    ]  # fmt: skip
    return _named(out, plan)


def _stage_work(
    model: TransformerConfig,
    plan: ParallelPlan,
    stage: int,
    layers: list[int],
    counted_loss: bool,
    rank_of: Callable[[int], int],
) -> list[StepCollective]:
    """One micro-batch through stage `stage`, forward and backward: its tensor-parallel collectives (its
    layers, the embedding on the first stage, the head and loss on the last: a loss over counted targets
    sums their count over dp only on a stage mesh, tp > 1) and its sends and receives of the residual stream
    (`stage_stream_bytes`) to and from the neighbouring stages that another pipeline rank runs (`rank_of`:
    a stage's pipeline rank; a neighbour on this rank takes the stream in memory)."""
    first, last = stage == 0, stage == len(layers) - 1
    out = _times(layer_collectives(model, plan), layers[stage])
    if first:
        out += embedding_collectives(model, plan)
    if last:
        out += head_collectives(model, plan, counted_loss=counted_loss and plan.tp > 1)
    here = rank_of(stage)
    p2p = [("recv", "forward"), ("send", "backward")] if not first and rank_of(stage - 1) != here else []
    p2p += [("send", "forward"), ("recv", "backward")] if not last and rank_of(stage + 1) != here else []
    source = "the residual stream between pipeline stages (an activation forward, its gradient backward)"
    out += [
        StepCollective(kind=kind, axis=PP, nbytes=stage_stream_bytes(model, plan), count=1, phase=phase,
                       source=source)
        for kind, phase in p2p
    ]  # fmt: skip
    gather_bytes = stage_gather_bytes(model, plan)
    if gather_bytes:
        gather = "the received 1/tp shares of the stream gathered whole (scatter_gather_p2p)"
        out += [
            StepCollective(kind="all_gather", axis=TP, nbytes=gather_bytes, count=1,
                           phase=phase, source=gather)
            for kind, phase in p2p
            if kind == "recv"
        ]  # fmt: skip
    return out


def summary(collectives: Iterable[StepCollective]) -> Counter:
    """Counter of (kind, axis, bytes) -> calls: what `loom.dist.comm.CollectiveRecorder.summary` records."""
    counts: Counter = Counter()
    for c in collectives:
        counts[(c.kind, c.axis, c.nbytes)] += c.count
    return counts
