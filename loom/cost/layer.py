"""Time of one transformer layer, the embedding and the output head, per micro-batch, on one device.

Each piece is a dict of named components in seconds, so that the simulator can report where time goes:
"matmul" (GEMMs), "elementwise" (memory-bound kernels: norms, activations, softmax, dropout, residuals),
"tp_comm" (tensor/sequence-parallel collectives, the ones `loom.cost.traffic` predicts, priced one by one,
not overlapped, as in Megatron without --tp-comm-overlap; with `ParallelPlan.overlap_tp_comm` what
`overlapped_tp_time` leaves exposed), "ep_comm" (expert-parallel all-to-alls) and "cp_comm"
(context-parallel attention's exchanges over the cp group, `loom.cost.context`: what compute leaves
exposed) and, with `fp8_matmuls`, "fp8_cast" (Transformer Engine's casts around the fp8 GEMMs,
`fp8_cast_times`). Backward runs two GEMMs per forward GEMM (input and weight gradients) and moves about
twice the bytes of each elementwise kernel.

With cp > 1 each rank holds seq / cp tokens of its sequences, which loom's GPT treats as rows of their own
(`loom.cost.traffic.shards_as_rows`): every piece but the attention core is priced on those rows. The core
attends the rank's queries to the whole sequence: Ulysses whole sequences for heads / cp heads, ring
attention cp steps of a block of seq / cp queries against one of seq / cp keys, the chunk pairs the causal
mask hides skipped (the head-tail cut gives every rank and every step the same work).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from loom.cost.collectives import GroupSpan, collective_time, group_span
from loom.cost.compute import (
    DTYPE_BYTES,
    fp8_quantize_bytes,
    fp8_quantize_kernels,
    fused_attention_time,
    matmul_time,
    memory_time,
)
from loom.cost.context import BACKWARD_FLOPS_PER_SCORE, FORWARD_FLOPS_PER_SCORE, exposed_time
from loom.cost.hardware import Cluster
from loom.cost.host import Segment, host_bound_pass
from loom.cost.memory import FP32_BYTES, cast_weight_bytes
from loom.cost.moe import deepep_layer_time, layer_moe_collectives
from loom.cost.plan import (
    DEEPEP_DISPATCHERS,
    RING_ATTENTIONS,
    TORCHTITAN_LAYER_EVERY,
    WHOLE_LAYER_RECOMPUTES,
    ParallelPlan,
)
from loom.cost.traffic import (
    StepCollective,
    attention_collectives,
    embedding_collectives,
    head_collectives,
    layer_collectives,
    shards_as_rows,
    stage_gather_bytes,
    stage_stream_bytes,
    stream_bytes,
)
from loom.cost.transformer import TransformerConfig, local_linear

__all__ = [
    "Costs", "PieceCosts", "UB_PIPELINE_SPLITS", "check_tp_overlap", "cp_span", "ep_span", "fp8_cast_times", "gemm_shapes",
    "MOE_KERNELS", "MoeKernels", "layer_kernels", "moe_kernels", "overlapped_tp_time", "piece_costs", "pipelined_scatter_time",
    "ring_exchange_time", "skips_mlp_out",
]  # fmt: skip

Costs = dict[str, float]
CAUSAL_SHARE = 0.5  # share of the s x s score blocks a fused causal attention kernel computes
BACKWARD_BYTES = 2.0  # an elementwise backward reads the output gradient and saved input, writes a gradient
UB_PIPELINE_SPLITS = 4  # Transformer Engine's `initialize_ub` default num_splits for its "pipeline" method
FP8_LINEARS = 4  # the first four of `_layer_gemms` run in fp8 with `fp8_matmuls`; a mixture's router does not
# memory-bound kernels of a layer's forward outside its attention core (`_elementwise_bytes`: residual adds,
# norms, activation, a mixture's permutations), and as many in its backward
ELEMENTWISE_KERNELS = 6


@dataclass(frozen=True, kw_only=True)
class PieceCosts:
    """Per-micro-batch costs of the pieces a pipeline stage is made of."""

    layer_fwd: Costs
    layer_bwd: Costs
    layer_recompute: Costs  # extra forward work in backward, per the plan's recompute policy
    embed_fwd: Costs
    embed_bwd: Costs
    head_fwd: Costs
    head_bwd: Costs
    p2p_s: float  # sending one micro-batch's activations to the next stage (and gathering them, if split)
    p2p_bytes: float
    layer_cp: tuple[StepCollective, ...] = ()  # one layer's attention exchanges over cp, one micro-batch


def _scaled(costs: Costs, factor: float) -> Costs:
    return {name: value * factor for name, value in costs.items()}


def _span(axis: str, plan: ParallelPlan, cluster: Cluster) -> GroupSpan:
    """Where a group over `axis` sits (Megatron's rank order: tp innermost, then dp)."""
    if axis == "tp":
        return group_span(plan.tp, 1, cluster.gpus_per_node)
    if axis == "dp":
        return group_span(plan.dp, plan.tp, cluster.gpus_per_node)
    return group_span(plan.dp * plan.tp, 1, cluster.gpus_per_node)


def _comm(collectives: list[StepCollective], phase: str, plan: ParallelPlan, cluster: Cluster) -> float:
    """Seconds of the predicted collectives of `phase` ("forward" or "backward"), one after the other (not
    overlapped, as in Megatron): the times come from the list `loom.cost.traffic` predicts, so the
    simulator prices exactly the collectives the prediction names."""
    return sum(
        c.count * collective_time(c.kind, c.nbytes, _span(c.axis, plan, cluster), cluster)
        for c in collectives
        if c.phase == phase
    )


def cp_span(plan: ParallelPlan, cluster: Cluster) -> GroupSpan:
    """Where a cp group sits: its ranks tp apart (the mesh orders its axes pp, dp, cp, tp, tp innermost),
    so cp fills a node after tp, before dp."""
    return group_span(plan.cp, plan.tp, cluster.gpus_per_node)


def _attention_core(model: TransformerConfig, plan: ParallelPlan, cluster: Cluster) -> Costs:
    """Scores, softmax, dropout and context of one layer's forward on one rank (what selective recomputation
    redoes); with cp > 1 the rank's queries against the whole sequence (see the module's docstring)."""
    if plan.cp > 1 and plan.attention in RING_ATTENTIONS:
        return _ring_core(model, plan, cluster)
    dev, dt, e = cluster.device, plan.dtype, DTYPE_BYTES[plan.dtype]
    s, b, d = plan.seq, plan.micro_batch, model.head_dim
    heads = b * model.heads / (plan.tp * plan.cp)  # Ulysses: whole sequences, the rank's share of the heads
    if plan.flash_attention:
        # a fused causal kernel computes only the score blocks on and below the diagonal, at its own
        # fraction of the GEMMs' speed (softmax and masking inside the kernel)
        fused = fused_attention_time(
            dev, s, d, s, dtype=dt, batch=heads, share=CAUSAL_SHARE, kernel=plan.attention_kernel
        )
        return {"matmul": fused, "elementwise": 0.0}
    matmul = 2 * matmul_time(dev, s, d, s, dtype=dt, batch=heads)
    scores = heads * s * s
    # scale+mask+softmax reads and writes the scores; dropout reads, writes and stores a byte mask
    moved = 2 * e * scores + ((2 * e + 1) * scores if model.dropout else 0.0)
    return {"matmul": matmul, "elementwise": memory_time(dev, moved, kernels=2)}


def _ring_core(model: TransformerConfig, plan: ParallelPlan, cluster: Cluster) -> Costs:
    """Ring attention's forward on one rank: cp steps, each a block of seq / cp queries against one of
    seq / cp keys, of which the head-tail cut leaves half the scores to compute (`loom.cost.context.
    attention_flops`: heads * seq^2 / (2 cp) scores per rank). Blockwise with a running log-sum-exp, it never
    holds the whole scores: a fused kernel's speed with flash attention, else explicit GEMMs and a softmax
    over the block's scores (no dropout)."""
    dev, dt, e, cp = cluster.device, plan.dtype, DTYPE_BYTES[plan.dtype], plan.cp
    block, heads = plan.seq / cp, plan.micro_batch * model.heads / plan.tp
    if plan.flash_attention:
        fused = fused_attention_time(
            dev, block, model.head_dim, block, dtype=dt, batch=heads, share=CAUSAL_SHARE,
            kernel=plan.attention_kernel,
        )  # fmt: skip
        return {"matmul": cp * fused, "elementwise": 0.0}
    matmul = cp * CAUSAL_SHARE * 2 * matmul_time(dev, block, model.head_dim, block, dtype=dt, batch=heads)
    scores = cp * CAUSAL_SHARE * heads * block * block
    return {"matmul": matmul, "elementwise": memory_time(dev, 2 * e * scores, kernels=2 * cp)}


def _layer_gemms(model: TransformerConfig, plan: ParallelPlan) -> list[tuple[float, float, float, float]]:
    """The linear layers' GEMMs of one layer's forward on one rank, as (m, k, n, batch): query/key/value and
    output projections, the MLP's (each local expert's) two, and a mixture's router."""
    h, t, tokens = model.hidden, plan.tp, plan.seq * plan.micro_batch
    q, kv, f = model.heads * model.head_dim, model.kv * model.head_dim, model.ffn
    mats = 2 if model.gated_mlp else 1
    experts_here = model.experts / plan.ep if model.is_moe else 1
    # with etp < tp each rank routes only its tp / etp share of the tokens, to experts cut etp ways
    et = plan.etp if model.is_moe else t
    per_expert = tokens * model.top_k * et / t / experts_here if model.is_moe else tokens
    gemms = [
        (tokens, h, (q + 2 * kv) / t, 1),
        (tokens, q / t, h, 1),
        (per_expert, h, mats * f / et, experts_here),
        (per_expert, f / et, h, experts_here),
    ]
    return gemms + ([(tokens * et / t, h, model.experts, 1)] if model.is_moe else [])


def gemm_shapes(model: TransformerConfig, plan: ParallelPlan) -> list[tuple[int, int, int]]:
    """The distinct (m, k, n) of the GEMMs the cost model prices for one micro-batch on one rank (a layer's
    linear layers, its attention scores, the output head): the sizes a calibration should measure matmul
    speed at (`loom.cost.calibrate.measure_rank`), so that the fitted shape curve holds where it is used."""
    rows = shards_as_rows(plan)
    tokens, block = (
        rows.seq * rows.micro_batch,
        plan.seq / plan.cp if plan.attention in RING_ATTENTIONS else plan.seq,
    )
    shapes = [(m, k, n) for m, k, n, _ in _layer_gemms(model, rows)]
    shapes += [(block, model.head_dim, block), (tokens, model.hidden, model.vocab / plan.tp)]
    return sorted({tuple(max(1, round(d)) for d in shape) for shape in shapes})


def _layer_forward(model: TransformerConfig, plan: ParallelPlan, cluster: Cluster) -> tuple[Costs, Costs]:
    """One layer's forward on one rank, and its attention core's share of it."""
    core = _attention_core(model, plan, cluster)
    plan = shards_as_rows(plan)  # with cp > 1, what follows is token-local: priced on the rank's rows
    # fp8 recipes run the linear layers' GEMMs in fp8; attention, norms and activations stay in `dtype`
    matmul = sum(_linear_times(model, plan, cluster))
    moved = _elementwise_bytes(model, plan)
    elementwise = memory_time(cluster.device, sum(moved.values()), kernels=ELEMENTWISE_KERNELS)
    costs = {
        "matmul": matmul + core["matmul"],
        "elementwise": elementwise + core["elementwise"],
        "tp_comm": _layer_tp_comm(model, plan, cluster, "forward"),
        "ep_comm": _ep_comm(model, plan, cluster, "forward"),
    }
    return costs, core


def _linear_times(model: TransformerConfig, plan: ParallelPlan, cluster: Cluster) -> list[float]:
    """Seconds of each linear layer's forward GEMM of one layer on one rank, in `_layer_gemms`' order (query/
    key/value, output projection, MLP in, MLP out, router); fp8 recipes run them in fp8, all but a mixture's
    router (Megatron's `TopKRouter` computes its logits with its own linear, not Transformer Engine's)."""
    dt = "fp8" if plan.fp8_matmuls else plan.dtype
    return [
        matmul_time(cluster.device, m, k, n, dtype=dt if i < FP8_LINEARS else plan.dtype, batch=batch)
        for i, (m, k, n, batch) in enumerate(_layer_gemms(model, plan))
    ]


def fp8_cast_times(model: TransformerConfig, plan: ParallelPlan, cluster: Cluster) -> tuple[float, float]:
    """Seconds of the casts Transformer Engine's current scaling runs around one layer's fp8 GEMMs on one
    rank (`plan` with its rows as `_layer_forward` prices them), (forward, backward); (0, 0) without
    `fp8_matmuls`. Each fp8 linear quantizes its input in the forward and its output gradient in the
    backward (`loom.cost.compute.fp8_quantize_bytes`): query/key/value and a dense MLP's first linear are
    TE's LayerNormLinear, whose norm computes the amax; the output projection, the MLP's second linear and
    a mixture's grouped expert linears quantize a tensor of their own, the experts one slice per local
    expert (`split_quantize` runs each current-scaling quantizer alone: its kernels once per expert). With
    sequence parallelism the column-parallel inputs and the row-parallel output gradients are quantized on
    this rank's 1/tp of the tokens and all-gathered in fp8, their amax all-reduced over tp first (a
    blocking 4-byte all-reduce, `with_amax_reduction`). Not priced: the weights' casts, once per step (the
    perf recipes keep fp8 parameters, `fp8_param_gather`, cast by the optimizer), and the router, which
    stays in `dtype`.

    With `fp8_scaling = "delayed"` (DelayedScaling, Transformer Engine 1.x's recipe: NeMo 24.07) the scale comes
    from the amax history: no amax pass and no amax all-reduce before a cast (the cast records the amax; the
    history is reduced once per step, not priced), and a LayerNormLinear's norm writes its fp8 output itself
    (no cast; the backward transposes it)."""
    passes = _fp8_cast_passes(model, plan, cluster)
    fwd, bwd = (sum(seconds for p, seconds, _ in passes if p == phase) for phase in ("forward", "backward"))
    return fwd, bwd


def _fp8_cast_passes(
    model: TransformerConfig, plan: ParallelPlan, cluster: Cluster
) -> list[tuple[str, float, int]]:
    """The work `fp8_cast_times` prices, pass by pass: (phase, seconds, kernels launched); none without
    `fp8_matmuls`."""
    if not plan.fp8_matmuls:
        return []
    dev, dt = cluster.device, plan.dtype
    delayed = plan.fp8_scaling == "delayed"
    sp = plan.tp if plan.sequence_parallel and plan.tp > 1 else 1
    span = _span("tp", plan, cluster)
    amax_reduce = collective_time("all_reduce", 4, span, cluster) if sp > 1 and not delayed else 0.0
    passes: list[tuple[str, float, int]] = []

    def cast(phase: str, nbytes: float, kernels: int) -> None:
        passes.append((phase, memory_time(dev, nbytes, kernels=kernels), kernels))

    for i, (m, k, n, batch) in enumerate(_layer_gemms(model, plan)[:FP8_LINEARS]):
        expert = model.is_moe and i >= 2  # grouped linears: no gather, one quantizer per local expert
        column = i in (0, 2)  # query/key/value and the MLP's first linear gather their input over tp
        norm_fed = i == 0 or (i == 2 and not model.is_moe)  # a LayerNormLinear: its norm computes the amax
        fused = norm_fed or delayed  # delayed scaling's cast records the amax itself
        ranks_in, ranks_grad = (1, 1) if expert else ((sp, 1) if column else (1, sp))
        if norm_fed and delayed:
            # Transformer Engine 1.x's LayerNormLinear: the norm writes fp8 itself, and the backward transposes
            # the (gathered) fp8 input for the weight gradient (`fp8_transpose`: 1 byte read, 1 written)
            cast("backward", 2.0 * m * k * batch, 1)
        else:
            made, transposed = fp8_quantize_bytes(
                m * k * batch / ranks_in, dtype=dt, amax_fused=fused, gathered=ranks_in
            )
            cast("forward", made, round(batch * fp8_quantize_kernels(amax_fused=fused, delayed=delayed)))
            if transposed:
                cast("backward", transposed, 1)
        made, transposed = fp8_quantize_bytes(
            m * n * batch / ranks_grad, dtype=dt, amax_fused=delayed, gathered=ranks_grad
        )
        kernels = round(batch * fp8_quantize_kernels(amax_fused=delayed, delayed=delayed)) + int(
            ranks_grad > 1
        )
        cast("backward", made + transposed, kernels)
        if amax_reduce and ranks_in > 1:
            passes.append(("forward", amax_reduce, 1))
        if amax_reduce and ranks_grad > 1:
            passes.append(("backward", amax_reduce, 1))
    return passes


def _layer_tp_comm(model: TransformerConfig, plan: ParallelPlan, cluster: Cluster, phase: str) -> float:
    """Seconds of one layer's tensor-parallel collectives in `phase` left on its critical path: all of them,
    one after the other, or with `overlap_tp_comm` the sequence-parallel ones of each overlapped block hidden
    behind the GEMMs they are pipelined with (`overlapped_tp_time`)."""
    exposed = _comm(layer_collectives(model, plan), phase, plan, cluster)
    if not plan.overlap_tp_comm:
        return exposed
    check_tp_overlap(plan, cluster)
    span = _span("tp", plan, cluster)
    nbytes = stream_bytes(model, plan)
    gather, scatter = (
        collective_time(kind, nbytes, span, cluster) for kind in ("all_gather", "reduce_scatter")
    )
    times = _linear_times(model, plan, cluster)
    # (column-parallel GEMM, row-parallel GEMM) of each block Transformer Engine's userbuffers serve: the
    # attention's, and a dense MLP's (a mixture's experts run TE's grouped linears, which have none)
    blocks = [(times[0], times[1])] + ([] if model.is_moe else [(times[2], times[3])])
    for column, row in blocks:
        # the pair was priced above one after the other; what is left exposed is the overlapped time beyond
        # the GEMMs it runs beside (priced in "matmul"): forward the two GEMMs, backward the row-parallel
        # one's input gradient and the column-parallel one's weight gradient, each its forward's time
        exposed += overlapped_tp_time(column, row, gather, scatter, plan.tp, phase) - (column + row)
        exposed -= gather + scatter
    return exposed


def check_tp_overlap(plan: ParallelPlan, cluster: Cluster) -> None:
    """A ValueError naming the fix when `plan.overlap_tp_comm` cannot run on `cluster`: userbuffers map the
    tp ranks' buffers into each other over NVLink, so the tp group must fit in a node."""
    if plan.overlap_tp_comm and _span("tp", plan, cluster).crosses_nodes:
        raise ValueError(
            f"overlap_tp_comm: Transformer Engine's userbuffers exchange over NVLink, so the tp group must fit in "
            f"a node (tp={plan.tp}, {cluster.gpus_per_node} GPUs per node): lower tp, or leave overlap_tp_comm off"
        )


def overlapped_tp_time(
    column: float, row: float, gather: float, scatter: float, tp: int, phase: str
) -> float:
    """Seconds of one tensor-parallel block's overlapped GEMMs and collectives under Transformer Engine's
    userbuffers (`initialize_ub`'s default methods, which NeMo's and Megatron-Bridge's H100 configs keep):
    `column`, `row` the block's column- and row-parallel GEMMs (one pass, seconds), `gather`, `scatter` its
    sequence-parallel all-gather and reduce-scatter of the stream over `tp` ranks.

    forward: the all-gather before the column-parallel GEMM is a ring exchange (`ring_exchange_time`), the
    reduce-scatter after the row-parallel GEMM is pipelined in `UB_PIPELINE_SPLITS` chunks
    (`pipelined_scatter_time`). backward: the output gradient's all-gather before the row-parallel GEMM's
    input gradient is a ring exchange again; the column-parallel input gradient's reduce-scatter runs whole
    beside that layer's weight-gradient GEMM ("bulk": the longer of the two). No slowdown of the GEMMs while
    they share the GPU with the communication kernels is priced (none is published)."""
    if phase not in ("forward", "backward"):
        raise ValueError(f"overlapped_tp_time: phase {phase!r} is not 'forward' or 'backward'")
    if phase == "forward":
        return ring_exchange_time(column, gather, tp) + pipelined_scatter_time(
            row, scatter, UB_PIPELINE_SPLITS
        )
    return ring_exchange_time(row, gather, tp) + max(column, scatter)


def ring_exchange_time(gemm: float, gather: float, tp: int) -> float:
    """Seconds of a GEMM on an all-gathered input done as userbuffers' ring exchange: tp steps, each the GEMM
    of one rank's chunk (gemm / tp) while the next chunk arrives from the neighbour (gather / (tp - 1) per
    hop); the first chunk is the rank's own, so only the last GEMM chunk cannot overlap a transfer."""
    step, hop = gemm / tp, gather / (tp - 1)
    return (tp - 1) * max(step, hop) + step


def pipelined_scatter_time(gemm: float, scatter: float, splits: int) -> float:
    """Seconds of a GEMM whose output is reduce-scattered in `splits` chunks (userbuffers' "pipeline"):
    each chunk's reduce-scatter runs beside the next chunk's GEMM; the first GEMM chunk and the last
    reduce-scatter chunk cannot overlap anything."""
    step, piece = gemm / splits, scatter / splits
    return step + (splits - 1) * max(step, piece) + piece


def _elementwise_bytes(model: TransformerConfig, plan: ParallelPlan) -> Costs:
    """Bytes the memory-bound kernels of one layer's forward move on one rank (`plan` with its rows as
    `_layer_forward` prices them), by kernel: the two residual adds (and dropouts), the two norms, the MLP's
    activation (and gate) and a mixture's permutations."""
    e, t, h = DTYPE_BYTES[plan.dtype], plan.tp, model.hidden
    tokens = plan.seq * plan.micro_batch
    replicated = tokens / t if plan.sequence_parallel else tokens
    routed = tokens * model.top_k  # token-expert pairs this tensor-parallel group computes
    # with etp < tp each rank routes and permutes only its own tp / etp share of them
    own = routed * plan.etp / t if model.is_moe else routed
    dropout = 1 if model.dropout else 0  # a byte mask per element
    return {
        "residual": (3 * e + dropout) * replicated * h * 2,  # (dropout +) residual add, twice
        "norms": 2 * e * replicated * h * 2,
        "activation": (3 if model.gated_mlp else 2) * e * routed * model.ffn / t,
        "permute": 4 * e * own * h if model.is_moe else 0.0,
    }


def _op_sac_recompute(model: TransformerConfig, plan: ParallelPlan, cluster: Cluster) -> Costs:
    """What torchtitan's op-level selective checkpointing re-runs of one layer in its backward, on one rank.

    The matmuls it does not save (`TransformerConfig.op_sac_matmuls`: wk, wo, w3 of a Llama layer), each its
    own GEMM as torchtitan's separate linears run them; every memory-bound kernel (norms, activation, the
    first residual add), as no elementwise op is in its save list; and the tensor-parallel collectives other
    than the reduce-scatters it saves (sequence parallelism's all-gathers). The fused attention kernel is
    saved. torch's non-reentrant checkpoint stops recomputing once the last tensor the backward needs is
    rebuilt (`set_checkpoint_early_stop`, on by default): w2's input, so the layer's last residual add and,
    without sequence parallelism, the MLP's all-reduce after w2 are not re-run."""
    dt, t, tokens = plan.dtype, plan.tp, plan.seq * plan.micro_batch
    matmul = sum(
        matmul_time(cluster.device, tokens, *local_linear(name, k, n, t), dtype=dt)
        for name, k, n in model.op_sac_matmuls()[1]
    )  # fmt: skip
    moved = _elementwise_bytes(model, plan)
    moved["residual"] /= 2  # the first of the two residual adds
    rerun = []
    for c in layer_collectives(model, plan):
        if c.phase == "forward" and c.kind == "all_gather":
            rerun.append(c)
        elif c.phase == "forward" and c.kind == "all_reduce" and c.count > 1:
            rerun.append(dataclasses.replace(c, count=c.count - 1))  # the MLP's comes after the stop
    return {
        "matmul": matmul,
        "elementwise": memory_time(cluster.device, sum(moved.values()), kernels=5),
        "tp_comm": _comm(rerun, "forward", plan, cluster),
    }


def skips_mlp_out(model: TransformerConfig, plan: ParallelPlan) -> bool:
    """Whether full recomputation leaves out each layer's MLP output projection: torch's non-reentrant
    checkpoint stops once the last tensor the backward needs is rebuilt (`set_checkpoint_early_stop`, on by
    default; `ParallelPlan.recompute_early_stop`), and a plain matmul packs the tensors it saves (its input
    and weight) before it runs, so the projection, whose output feeds only the residual add (which saves
    nothing), is never re-run. Not with dropout after it (its mask is rebuilt from that output), nor in a
    mixture (the combine weighs each expert's output by its routing probability, saving the output), nor
    where the projection is an autograd function that saves after computing (fp8 linears, Transformer
    Engine's userbuffers of `overlap_tp_comm`)."""
    dense_plain = not (model.is_moe or model.dropout or plan.fp8_matmuls or plan.overlap_tp_comm)
    return plan.recompute in WHOLE_LAYER_RECOMPUTES and plan.recompute_early_stop and dense_plain


def _stopped_early(forward: Costs, model: TransformerConfig, plan: ParallelPlan, cluster: Cluster) -> Costs:
    """A layer's `forward` re-run by a recomputation that `skips_mlp_out`: less the output projection's
    GEMM, the tensor-parallel sum after it (the row-parallel all-reduce, or sequence parallelism's
    reduce-scatter) and the residual add."""
    rows = shards_as_rows(plan)  # as `_layer_forward` priced the layer
    mlp_out = _linear_times(model, rows, cluster)[3]
    add = memory_time(cluster.device, _elementwise_bytes(model, rows)["residual"] / 2, kernels=1)
    kind = "reduce_scatter" if rows.sequence_parallel else "all_reduce"
    after = [
        dataclasses.replace(c, count=1)
        for c in layer_collectives(model, rows)
        if c.phase == "forward" and c.kind == kind
    ]
    stopped = dict(forward)
    stopped["matmul"] -= mlp_out
    stopped["elementwise"] -= add
    stopped["tp_comm"] -= _comm(after, "forward", rows, cluster)
    return stopped


def _cp_comm(
    layer_cp: list[StepCollective], plan: ParallelPlan, cluster: Cluster, phase: str, core_s: float
) -> float:
    """Seconds of one layer's cp exchanges in `phase` left exposed: ring attention's key/value exchanges
    hide behind one ring step's block (`core_s`, the phase's attention core, over cp steps)."""
    step_s = core_s / plan.cp if plan.attention in RING_ATTENTIONS else 0.0
    return exposed_time(layer_cp, cp_span(plan, cluster), cluster, phase=phase, step_s=step_s)


def ep_span(plan: ParallelPlan, cluster: Cluster) -> GroupSpan:
    """Where an expert-parallel group sits: ep ranks, expert tp apart (Megatron's order)."""
    return group_span(plan.ep, plan.etp, cluster.gpus_per_node)


def _ep_comm(model: TransformerConfig, plan: ParallelPlan, cluster: Cluster, phase: str) -> float:
    """Seconds of one MoE layer's expert-parallel all-to-alls in `phase` (`loom.cost.moe`: the counts and
    two token exchanges forward, their reverses backward), over ep groups of ranks etp apart; under DeepEP
    or Hybrid-EP (`moe_dispatcher`) its dispatch and combine (`loom.cost.moe.deepep_layer_time`)."""
    span = ep_span(plan, cluster)
    if plan.moe_dispatcher in DEEPEP_DISPATCHERS:
        return deepep_layer_time(model, plan, span, cluster, phase)
    return sum(
        c.count * collective_time(c.kind, c.nbytes, span, cluster)
        for c in layer_moe_collectives(model, plan)
        if c.phase == phase
    )


def _embedding(model: TransformerConfig, plan: ParallelPlan, cluster: Cluster) -> tuple[Costs, Costs]:
    e, tokens = DTYPE_BYTES[plan.dtype], plan.seq * plan.micro_batch
    replicated = tokens / plan.tp if plan.sequence_parallel else tokens
    moved = 2 * e * tokens * model.hidden + (3 * e + 1) * replicated * model.hidden * model.dropout
    comm = embedding_collectives(model, plan)
    fwd = {"elementwise": memory_time(cluster.device, moved, kernels=2)}
    bwd = _backward(fwd)
    fwd["tp_comm"], bwd["tp_comm"] = (_comm(comm, phase, plan, cluster) for phase in ("forward", "backward"))
    return fwd, bwd


def _head(model: TransformerConfig, plan: ParallelPlan, cluster: Cluster) -> tuple[Costs, Costs]:
    dev, e, tokens = cluster.device, DTYPE_BYTES[plan.dtype], plan.seq * plan.micro_batch
    replicated = tokens / plan.tp if plan.sequence_parallel else tokens
    logits = tokens * model.vocab / plan.tp
    # final norm; cross entropy upcasts the vocabulary-parallel logits to fp32 and writes fp32 softmax
    moved = 2 * e * replicated * model.hidden + (e + 4 + 4) * logits
    fwd = {
        "matmul": matmul_time(dev, tokens, model.hidden, model.vocab / plan.tp, dtype=plan.dtype),
        "elementwise": memory_time(dev, moved, kernels=3),
    }
    bwd = _backward(fwd)
    # Megatron's loss is a plain mean per micro-batch: no count of targets to sum over dp
    comm = head_collectives(model, plan, counted_loss=False)
    fwd["tp_comm"], bwd["tp_comm"] = (_comm(comm, phase, plan, cluster) for phase in ("forward", "backward"))
    return fwd, bwd


def _weight_cast_times(
    copy_bytes: float, kernels: int, plan: ParallelPlan, cluster: Cluster
) -> tuple[float, float]:
    """Seconds per micro-batch of autocast's casts around a piece whose 16-bit weight copies weigh
    `copy_bytes` per device (`cast_weight_bytes`), in `kernels` weight tensors, as loom's runtime runs
    autocast: the forward reads the fp32 weights and writes the copies, in every micro-batch's forward
    without a pipeline (each forward is an autocast region of its own), once a step with one (the whole
    schedule is one region, whose cache serves every micro-batch and recomputation: priced as 1/m of a cast
    per micro-batch); the backward casts each 16-bit weight gradient to fp32 and, from a step's second
    micro-batch on, adds it into the fp32 gradient (reads both, writes one)."""
    e = DTYPE_BYTES[plan.dtype]
    weights, later = copy_bytes / e, (plan.micro_batches - 1) / plan.micro_batches
    casts = 1.0 if plan.pp == 1 else 1 / plan.micro_batches
    forward = casts * memory_time(cluster.device, weights * (FP32_BYTES + e), kernels)
    backward = memory_time(cluster.device, weights * (e + FP32_BYTES + 3 * FP32_BYTES * later), 2 * kernels)
    return forward, backward


def _backward(forward: Costs) -> Costs:
    """Compute of a backward pass from its forward's; its collectives are predicted, not scaled."""
    factors = {"matmul": 2.0, "elementwise": BACKWARD_BYTES}
    return {name: value * factors[name] for name, value in forward.items() if name in factors}


def piece_costs(model: TransformerConfig, plan: ParallelPlan, cluster: Cluster) -> PieceCosts:
    """Per-micro-batch forward, backward and recomputation costs of every piece of the model under `plan`."""
    fwd, core = _layer_forward(model, plan, cluster)
    layer_bwd = _backward(fwd)
    if plan.fp8_matmuls:  # the casts around the fp8 GEMMs: token-local, priced on the rank's rows
        fwd["fp8_cast"], layer_bwd["fp8_cast"] = fp8_cast_times(model, shards_as_rows(plan), cluster)
    core_bwd = _backward(core)
    if plan.cp > 1 and plan.attention == "ring":
        # loom's ring attention's backward recomputes each block's scores before its four gradient GEMMs
        # (Megatron's p2p runs each block's fused backward kernel, priced as the fused kernel's everywhere)
        extra = (BACKWARD_FLOPS_PER_SCORE / FORWARD_FLOPS_PER_SCORE - 2) * core["matmul"]
        layer_bwd["matmul"] += extra
        core_bwd["matmul"] += extra
    layer_cp = attention_collectives(model, plan)
    if plan.cp > 1:
        fwd["cp_comm"] = _cp_comm(layer_cp, plan, cluster, "forward", _total(core))
        layer_bwd["cp_comm"] = _cp_comm(layer_cp, plan, cluster, "backward", _total(core_bwd))
    if plan.recompute in WHOLE_LAYER_RECOMPUTES:
        recompute = dict(fwd)  # the whole forward again, its collectives included
        if skips_mlp_out(model, plan):
            recompute = _stopped_early(recompute, model, plan, cluster)
    elif plan.recompute == "selective":
        recompute = {"matmul": 0.0, "elementwise": _total(core)}  # attention core; priced as one lump
    elif plan.recompute == "torchtitan_op":
        recompute = _op_sac_recompute(model, plan, cluster)  # cp is 1 (`ParallelPlan` checks it)
    else:
        recompute = {}
    rows = shards_as_rows(plan)  # with cp > 1 the rest is token-local: priced on the rank's rows
    # what loom sends between stages (the prediction's figure): without sequence parallelism every
    # tensor-parallel rank sends the whole stream, not Megatron's 1/tp scatter and gather
    p2p_bytes = stage_stream_bytes(model, rows)
    span = group_span(2, rows.tp * rows.dp, cluster.gpus_per_node)  # stages tp * cp * dp ranks apart
    (embed_fwd, embed_bwd), (head_fwd, head_bwd) = (
        _embedding(model, rows, cluster),
        _head(model, rows, cluster),
    )
    layer_bwd["tp_comm"] = _layer_tp_comm(model, rows, cluster, "backward")
    layer_bwd["ep_comm"] = _ep_comm(model, rows, cluster, "backward")
    layer_casts, head_casts = cast_weight_bytes(model, plan)
    if layer_casts:  # autocast's weight casts (`_weight_cast_times`)
        kernels = 4 + (3 if model.gated_mlp else 2) + int(model.is_moe)  # weight tensors of a layer
        fwd["weight_cast"], layer_bwd["weight_cast"] = _weight_cast_times(layer_casts, kernels, plan, cluster)
        # a whole-layer recomputation without a pipeline re-runs in an autocast region of its own: cast again
        if plan.pp == 1 and plan.recompute in WHOLE_LAYER_RECOMPUTES:
            recompute["weight_cast"] = fwd["weight_cast"]
    if head_casts:
        head_fwd["weight_cast"], head_bwd["weight_cast"] = _weight_cast_times(head_casts, 1, plan, cluster)
    if model.is_moe and plan.moe_sync == "dropless":
        # each MoE layer's forward waits on the host for its per-expert counts, so each layer pass runs at
        # the pace the host launches its kernels when that is slower than the device (`loom.cost.host`); the
        # backward reuses the forward's counts, but starts with the host level with the device after the sync
        kernels = layer_kernels(model, plan, cluster)
        fwd["host_bound"] = _host_bound(_total(fwd), kernels["forward"], cluster)
        layer_bwd["host_bound"] = _host_bound(_total(layer_bwd), kernels["backward"], cluster)
        if plan.recompute in WHOLE_LAYER_RECOMPUTES:  # the re-run forward dispatches, and syncs, again
            recompute["host_bound"] = fwd["host_bound"]
    if plan.recompute == "torchtitan_layer":  # one layer in TORCHTITAN_LAYER_EVERY re-runs: priced on average
        recompute = _scaled(recompute, 1 / TORCHTITAN_LAYER_EVERY)
    return PieceCosts(
        layer_fwd=fwd,
        layer_bwd=layer_bwd,
        layer_recompute=recompute,
        embed_fwd=embed_fwd,
        embed_bwd=embed_bwd,
        head_fwd=head_fwd,
        head_bwd=head_bwd,
        p2p_s=_p2p_time(p2p_bytes, stage_gather_bytes(model, rows), plan.tp, span, cluster)
        if plan.pp > 1
        else 0.0,
        p2p_bytes=p2p_bytes,
        layer_cp=tuple(layer_cp),
    )


@dataclass(frozen=True)
class MoeKernels:
    """Kernels one piece of Megatron-Core's MoE layer launches in a layer's forward and in its backward, beyond
    the work loom prices (`MOE_KERNELS`); `piece` says what launches them, and where in the code."""

    piece: str
    forward: int
    backward: int


# What Megatron-Core's MoE layer launches in a layer pass beyond the work loom prices as such (the linears' GEMMs,
# the router's among them; one permutation and the activation, of `ELEMENTWISE_KERNELS`; the ep exchanges of
# `_ep_launches`), read in megatron/core/transformer/moe/ at core_v0.15.0 (to February 2026 for Hybrid-EP) with
# Transformer Engine 2.8, as the published MoE runs configure it: force-balanced routing
# (`--moe-router-force-load-balancing`, every Qwen3 row), TE's fused router (`moe_router_fusion`, Megatron-
# Bridge's perf configs) in fp32 with the aux loss, TE's fused permutation (`moe_permute_fusion`), the grouped
# GEMM, the fused weighted SwiGLU. One kernel per PyTorch op that writes a tensor; three per boolean-mask
# selection or tensor-sized repeat_interleave (the count, its copy to the host, the selection). A table of
# launches, not a fitted factor: what the host enqueues after each sync (`moe_kernels` picks the rows).
MOE_KERNELS = {
    # router.py `TopKRouter.forward` / `routing`, moe_utils.py; every dispatcher
    "router": (
        MoeKernels("random logits: RandomSTE.forward's clone and normal_", 2, 0),
        MoeKernels("top-k of the softmax: TE fused_topk_with_score_function (forward, backward)", 1, 1),
        MoeKernels("aux-loss scores: TE fused_compute_score_for_moe_aux_loss", 1, 1),
        MoeKernels("tokens per expert for the aux loss: routing_map.sum", 1, 0),
        MoeKernels("aux loss: TE fused_moe_aux_loss", 1, 1),
        MoeKernels("aux-loss logging: loss / coefficient, the tracker's +=", 2, 0),
        MoeKernels("aux-loss gradient: MoEAuxLossAutoScaler.backward's ones_like and scale", 0, 2),
        MoeKernels("the logits' gradients from top-k and from the aux loss summed", 0, 1),
        MoeKernels(
            "fp32 router: RouterGatingLinearFunction.backward's casts (weight, input, two gradients)", 0, 4
        ),
    ),
    # `_apply_aux_loss`: the tokens per expert summed over tp x cp
    "router_tp": (MoeKernels("all-reduce of the aux loss's tokens per expert over tp x cp", 1, 0),),
    # experts.py `TEGroupedMLP`: fusions/fused_bias_swiglu.py's weighted SwiGLU
    "experts": (MoeKernels("weighted SwiGLU's probs gradient: its backward's row sum", 0, 1),),
    # moe_utils.py `permute` / `unpermute` with fused=True (TE pytorch/triton/permutation.py), where the
    # dispatcher does not permute the rows itself (all-to-all, DeepEP)
    "permutation": (
        MoeKernels("row-id map: make_row_id_map's three Triton passes", 3, 0),
        MoeKernels(
            "unpermute (and in backward the permute that reverses it): TE unpermute_with_mask_map", 1, 1
        ),
    ),
    # `TEGroupedMLP.forward` under fp8: TE Fp8Padding / Fp8Unpadding (moe_router_padding_for_fp8 off); Hybrid-EP
    # pads each expert's rows itself (`pad_multiple`)
    "fp8_padding": (MoeKernels("rows and probs padded per expert, the output unpadded", 3, 3),),
    # token_dispatcher.py `MoEAlltoAllTokenDispatcher.preprocess` / `token_dispatch` without a capacity factor
    "all_to_all": (
        MoeKernels(
            "split sizes: routing_map.sum and .long, per-rank, per-tp, per-local-expert sums, a slice", 7, 0
        ),
        MoeKernels("the sync's copies to the host: tokens per expert, input, output and tp splits", 4, 0),
        MoeKernels("probs' all-to-all beside the tokens' (the dispatch, and in backward its reverse)", 1, 1),
    ),
    # `dispatch_postprocess` / `combine_preprocess` with expert tp: the probs gathered, fp32 around the combine
    "all_to_all_etp": (
        MoeKernels("probs' all-gather over expert tp; casts around the reduce-scatter", 3, 3),
    ),
    # `sort_chunks_by_idxs` fused: rows sorted by local expert after the dispatch, back before the combine
    "all_to_all_sort": (
        MoeKernels("chunks sorted by local expert: make_chunk_sort_map, sort_chunks_by_map", 4, 2),
    ),
    # token_dispatcher.py `_DeepepManager` (the flex dispatcher's DeepEP backend)
    "deepep": (
        MoeKernels("top-k indices of the probs: torch.topk's selection and sort", 2, 0),
        MoeKernels(
            "multihot map of the received indices: _indices_to_multihot's zeros x2, mask, two boolean "
            "selections, sum, arange, repeat_interleave, two index_puts, bool (backward: the probs' gather "
            "and masked scatter)",
            17,
            3,
        ),
    ),
    # `MoEFlexTokenDispatcher._initialize_metadata` (DeepEP and Hybrid-EP): map and probs expanded over expert tp
    "flex_etp": (MoeKernels("routing map and probs expanded over expert tp: two contiguous copies", 2, 0),),
}
# the dispatchers' own kernels per layer pass, by phase (`_ep_launches`). DeepEP's normal kernels
# (csrc/deep_ep.cpp): forward the dispatch layout, a dispatch (notify, dispatch) and a combine (notify, combine);
# backward the combine and the dispatch reversed, 2 each. Hybrid-EP (DeepEP's hybrid-ep branch, csrc/hybrid_ep/
# executor/executor.cu, as Megatron-Core's `_HybridEPManager` calls it): forward the routing map's all-gather,
# the metadata preprocessing, the row-id map (permute_preprocessing), the dispatch and, in the combine, the
# unpermute and the combine; its permute kernel is the permutation of `ELEMENTWISE_KERNELS`; backward the
# unpermute, the combine and the dispatch (the handle's maps reused)
DISPATCH_LAUNCHES = {"deepep": {"forward": 5, "backward": 4}, "hybridep": {"forward": 6, "backward": 3}}


# each piece's launches per phase, summed once (`layer_kernels` reads them on every MoE layer pass it prices)
_MOE_LAUNCHES = {
    name: {phase: sum(getattr(kernels, phase) for kernels in pieces) for phase in ("forward", "backward")}
    for name, pieces in MOE_KERNELS.items()
}


def moe_kernels(model: TransformerConfig, plan: ParallelPlan) -> dict[str, tuple[MoeKernels, ...]]:
    """The pieces of `MOE_KERNELS` one MoE layer launches on one rank under `plan`: the router and the experts'
    always; the counts' all-reduce with tp x cp > 1; the permutation and, with `fp8_matmuls`, the padding
    unless Hybrid-EP does both; the dispatcher's own with ep or expert tp above 1 (Megatron-Core's dispatchers
    skip their exchanges at 1)."""
    if not model.is_moe:
        return {}
    hybrid = plan.moe_dispatcher == "hybridep"
    names = ["router", "experts"]
    names += ["router_tp"] if plan.tp * plan.cp > 1 else []
    names += [] if hybrid else ["permutation", *(["fp8_padding"] if plan.fp8_matmuls else [])]
    if plan.ep * plan.etp > 1:
        if plan.moe_dispatcher == "all_to_all":
            names.append("all_to_all")
            names += ["all_to_all_etp"] if plan.etp > 1 else []
            names += ["all_to_all_sort"] if model.experts > plan.ep else []
        else:
            names += [] if hybrid else ["deepep"]
            names += ["flex_etp"] if plan.etp > 1 else []
    return {name: MOE_KERNELS[name] for name in names}


def layer_kernels(model: TransformerConfig, plan: ParallelPlan, cluster: Cluster) -> dict[str, int]:
    """Kernels the host launches for one layer pass on one rank, by phase ("forward", "backward"): the linear
    layers' GEMMs (a mixture's experts one per local expert and linear, as Transformer Engine's grouped GEMM
    launches them from host-side counts; two per GEMM backward, input and weight gradients), the attention
    core's kernels, `ELEMENTWISE_KERNELS`, fp8 casts (`fp8_cast_times`), one per collective over tp, ep and cp
    (`_ep_launches`), and a mixture's router, permutation and dispatcher kernels (`moe_kernels`)."""
    rows = shards_as_rows(plan)
    gemms = sum(round(batch) for *_, batch in _layer_gemms(model, rows))
    if plan.cp > 1 and plan.attention in RING_ATTENTIONS:
        core = plan.cp if plan.flash_attention else 4 * plan.cp  # per ring step: fused, or 2 GEMMs + softmax
    else:
        core = 1 if plan.flash_attention else 4
    casts = _fp8_cast_passes(model, rows, cluster)
    collectives = layer_collectives(model, rows) + attention_collectives(model, plan)
    moe = moe_kernels(model, plan)
    out = {}
    for phase, per_gemm in (("forward", 1), ("backward", 2)):
        exchanges = sum(c.count for c in collectives if c.phase == phase) + _ep_launches(model, plan, phase)
        launches = per_gemm * gemms + core + ELEMENTWISE_KERNELS + exchanges
        launches += sum(_MOE_LAUNCHES[name][phase] for name in moe)
        out[phase] = launches + sum(kernels for p, _, kernels in casts if p == phase)
    return out


def _ep_launches(model: TransformerConfig, plan: ParallelPlan, phase: str) -> int:
    """Expert-parallel exchanges of one MoE layer in `phase` (`_ep_comm`'s): the all-to-alls, or DeepEP's or
    Hybrid-EP's kernels (`DISPATCH_LAUNCHES`: they compute their layouts on the device, and their notify
    kernels exchange the per-expert counts, whose time `loom.cost.moe.deepep_layer_time` prices as the counts'
    all-to-all: no NCCL launch of its own)."""
    if not model.is_moe or plan.ep == 1:
        return 0
    if plan.moe_dispatcher in DISPATCH_LAUNCHES:
        return DISPATCH_LAUNCHES[plan.moe_dispatcher][phase]
    return sum(c.phase == phase for c in layer_moe_collectives(model, plan))


def _host_bound(device_s: float, kernels: int, cluster: Cluster) -> float:
    """Seconds a layer pass of `device_s` on the device and `kernels` launches takes beyond `device_s` when
    it starts right after a host-device sync (`loom.cost.host.host_bound_pass`)."""
    segment = Segment(device_s=device_s, kernels=kernels)
    return host_bound_pass([segment], cluster.device.host_kernel_s).exposed


def _p2p_time(send_bytes: float, gather_bytes: float, tp: int, span: GroupSpan, cluster: Cluster) -> float:
    """Seconds from a stage's send of one micro-batch's stream (`send_bytes` over `span`) to the next stage
    holding it whole: with the stream sent in 1/tp shares (`scatter_gather_p2p`), the all-gather over tp of
    `gather_bytes` that rebuilds it (over NVLink when tp fits in a node: the point of sending only 1/tp
    between nodes)."""
    send = collective_time("send_recv", send_bytes, span, cluster)
    tp_span = group_span(tp, 1, cluster.gpus_per_node)
    return send + collective_time("all_gather", gather_bytes, tp_span, cluster)


def _total(costs: Costs) -> float:
    return sum(costs.values())
