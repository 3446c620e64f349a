"""The whole-step simulator: one training iteration of a transformer under a plan on a cluster.

Order of a simulated step, the way Megatron-LM runs one:
1. the pipeline schedule plays as events (per-stage forward/backward with tensor-parallel collectives
   inside, recomputation inside backward, point-to-point transfers between stages);
2. data-parallel gradient synchronisation: each chunk's gradients are reduced when its last backward ends
   (overlapped) or after the whole pipeline (not overlapped), one collective at a time;
3. the optimizer step (memory-bound) and, from optimizer level 1, the all-gather of updated parameters.
The iteration time is the slowest device's end.

Context parallelism (cp > 1, inside pipeline stages too): each layer's attention adds its exchanges
over the cp group (`loom.cost.context`, loom's Ulysses or ring or Megatron's p2p ring, the list `loom.cost.traffic` predicts; the breakdown's cp_comm row
is the part compute leaves exposed), and the gradients are reduced (from level 1, sharded) over dp x cp,
each rank's sequence pieces counting as rows of their own (`loom.cost.traffic.shards_as_rows`).
"""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass, field

from loom.cost.collectives import collective_time, group_span
from loom.cost.compute import DTYPE_BYTES, memory_time
from loom.cost.hardware import GIB, Cluster
from loom.cost.layer import Costs, PieceCosts, check_tp_overlap, ep_span, piece_costs, skips_mlp_out
from loom.cost.memory import state_bytes
from loom.cost.plan import DEEPEP_DISPATCHERS, LOOM_SYSTEM, RING_ATTENTIONS, UNIT_COPIES, ParallelPlan
from loom.cost.traffic import shards_as_rows
from loom.cost.transformer import TransformerConfig
from loom.cost.zero3 import (
    UnitBytes,
    embedding_unit_bytes,
    head_unit_bytes,
    layer_unit_bytes,
    unit_copy_bytes,
)
from loom.sim.engine import Playback, play
from loom.sim.memory import chunk_parameters, stage_memory, stage_parameters
from loom.sim.overlap import sharded_pass
from loom.sim.schedule import device_orders, peak_in_flight

__all__ = ["PlanError", "SimResult", "check_plan", "compute_bound", "simulate", "stage_memories"]


# The one definition of the pipeline bubble that `loom simulate` prints (summary and breakdown alike).
BUBBLE_DEFINITION = (
    "pipeline bubble: time the slowest device waits inside the pipeline schedule with no forward or "
    "backward pass to run, as a share of the whole iteration (the breakdown's pipeline_bubble row)"
)


class PlanError(ValueError):
    """A plan that cannot run at all; `.reasons` says why, one line each."""

    def __init__(self, reasons: list[str]) -> None:
        super().__init__("; ".join(reasons))
        self.reasons = reasons


@dataclass(kw_only=True)
class SimResult:
    """What one simulated iteration costs. Times in seconds, memory in GiB per device (the fullest stage)."""

    iteration_s: float
    tokens_per_s: float
    tflops_per_device: float  # hardware FLOPs (recomputation included), as Megatron-LM reports
    model_tflops_per_device: float
    mfu: float
    hfu: float
    bubble_fraction: float  # breakdown["pipeline_bubble"] / iteration_s: see BUBBLE_DEFINITION
    memory_per_device_gib: float
    memory_capacity_gib: float
    fits: bool
    reason: str = ""
    breakdown: dict[str, float] = field(default_factory=dict)  # seconds on the slowest device
    memory_breakdown_gib: dict[str, float] = field(default_factory=dict)
    stage_memory_gib: list[float] = field(default_factory=list)  # per pipeline rank, in rank order
    # bytes one rank sends over cp per layer and micro-batch, forward and backward (all-to-all send buffers,
    # ring sends: `loom.cost.context`'s formulas); 0 without context parallelism
    cp_bytes_per_layer: int = 0
    timeline: list[tuple[int, str, int, int, float, float]] = field(default_factory=list, repr=False)

    def to_dict(self) -> dict:
        """Plain data for JSON (without the timeline)."""
        data = asdict(self)
        data.pop("timeline")
        return data


def check_plan(model: TransformerConfig, plan: ParallelPlan, cluster: Cluster) -> list[str]:
    """Why `plan` cannot run `model` on `cluster` (empty when it can, memory aside)."""
    reasons = []
    if plan.devices != cluster.gpus:
        cp, cps = ("*cp", f"*{plan.cp}") if plan.cp > 1 else ("", "")
        reasons.append(
            f"dp*tp*pp{cp} = {plan.dp}*{plan.tp}*{plan.pp}{cps} = {plan.devices} devices, but the cluster has "
            f"{cluster.gpus}"
        )
    if plan.stage_layers and sum(plan.stage_layers) != model.layers:
        reasons.append(
            f"the stages hold {sum(plan.stage_layers)} layers ({', '.join(map(str, plan.stage_layers))}), but "
            f"the model has {model.layers}"
        )
    elif not plan.stage_layers and model.layers % plan.virtual_stages:
        reasons.append(
            f"{model.layers} layers do not split into pp*interleave = {plan.virtual_stages} equal stages: "
            "give the layers of each stage (--stage-layers, e.g. light-ends)"
        )
    if model.heads % plan.tp:
        reasons.append(f"{model.heads} attention heads do not split over tp={plan.tp}")
    if model.kv % plan.tp and plan.tp % model.kv:
        reasons.append(f"{model.kv} key/value heads neither split over nor replicate evenly on tp={plan.tp}")
    if model.ffn % plan.tp:
        reasons.append(f"MLP size {model.ffn} does not split over tp={plan.tp}")
    if plan.ep > 1 and model.experts % plan.ep:
        reasons.append(f"{model.experts} experts do not split over ep={plan.ep}")
    if plan.ep > 1 and not model.is_moe:
        reasons.append(f"ep={plan.ep} needs a mixture-of-experts model (--experts)")
    for name in ("moe_sync", "moe_dispatcher"):
        if getattr(plan, name) != LOOM_SYSTEM[name] and not model.is_moe:
            flag = "--" + name.replace("_", "-")
            reasons.append(
                f"{flag} {getattr(plan, name)} says how MoE layers dispatch: it needs a mixture-of-experts model (--experts)"
            )
    if plan.moe_dispatcher in DEEPEP_DISPATCHERS and model.is_moe:
        reasons += _deepep_reasons(plan, cluster)
    if plan.schedule == "interleaved" and plan.interleave > 1 and plan.micro_batches % plan.pp:
        reasons.append(
            f"the interleaved schedule needs micro-batches ({plan.micro_batches}) to be a multiple of pp={plan.pp}"
        )
    if plan.cp > 1:
        reasons += _cp_reasons(model, plan)
    if plan.recompute == "torchtitan_op":
        try:
            model.op_sac_matmuls()
        except ValueError as error:
            reasons.append(f"--recompute torchtitan_op: {error}")
    try:
        check_tp_overlap(plan, cluster)
    except ValueError as error:
        reasons.append(str(error))
    return reasons


def _deepep_reasons(plan: ParallelPlan, cluster: Cluster) -> list[str]:
    """Why DeepEP (or Hybrid-EP) cannot dispatch over `plan`'s ep groups: across nodes its internode kernels
    pair each rank with its counterpart in every other node, so the group must fill whole nodes alike."""
    flag = f"--moe-dispatcher {plan.moe_dispatcher}"
    if plan.ep == 1:
        return [f"{flag} dispatches over the ep group: give --ep above 1"]
    span = ep_span(plan, cluster)
    if span.crosses_nodes and span.size % span.per_node:
        return [
            f"{flag} across nodes needs the ep group in whole nodes alike, but ep={plan.ep} "
            f"({plan.etp} apart) holds {span.per_node} ranks in some of its {span.nodes} nodes and "
            f"{span.size % span.per_node} in the last: use an ep that is a multiple of {span.per_node}, or one "
            "inside a node"
        ]
    return []


def _cp_reasons(model: TransformerConfig, plan: ParallelPlan) -> list[str]:
    """Why loom cannot cut `plan`'s sequences over cp (the rules `loom train` applies to `[parallel]`)."""
    reasons, cp = [], plan.cp
    if plan.attention in RING_ATTENTIONS and plan.seq % (2 * cp):
        reasons.append(
            f"{plan.attention} attention cuts each sequence head-tail into 2*cp = {2 * cp} chunks, but seq {plan.seq} is "
            f"not a multiple of {2 * cp}; use a multiple, or a smaller cp"
        )
    elif plan.seq % cp:
        reasons.append(f"seq {plan.seq} does not cut into cp={cp} equal pieces; use a multiple of {cp}")
    if plan.attention == "ulysses" and model.heads % (plan.tp * cp):
        reasons.append(
            f"Ulysses attention cuts each tp rank's heads over cp: tp*cp = {plan.tp}*{cp} must divide the "
            f"{model.heads} heads; use --attention ring or a smaller cp"
        )
    if plan.sequence_parallel and plan.tp > 1 and plan.seq % (plan.tp * cp):
        reasons.append(
            f"sequence parallelism cuts each rank's seq/cp tokens over tp: seq {plan.seq} must be a multiple "
            f"of tp*cp = {plan.tp * cp}"
        )
    return reasons


def _total(costs: Costs) -> float:
    return sum(costs.values())


def _stage_durations(model: TransformerConfig, plan: ParallelPlan, cluster: Cluster, pieces: PieceCosts):
    layer_f, layer_b = _total(pieces.layer_fwd), _total(pieces.layer_bwd) + _total(pieces.layer_recompute)
    chunks = plan.chunk_layers(model.layers)
    forward, backward = [n * layer_f for n in chunks], [n * layer_b for n in chunks]
    forward[0] += _total(pieces.embed_fwd)
    backward[0] += _total(pieces.embed_bwd)
    forward[-1] += _total(pieces.head_fwd)
    backward[-1] += _total(pieces.head_bwd)
    for v, seconds in enumerate(_grad_accumulation(model, plan, cluster)):
        backward[v] += seconds
    for v, seconds in enumerate(_copy_out(model, plan, cluster)):
        forward[v] += seconds
        backward[v] += seconds * (_gathers(plan) - 1)
    return forward, backward


def _gathers(plan: ParallelPlan) -> int:
    """All-gathers of each unit per micro-batch of a unit-sharded plan (`unit_sharded`): before its forward
    and again before its backward at optimizer level 3; only before its forward at level 2."""
    return 2 if plan.optimizer_level == 3 else 1


def _grad_accumulation(model: TransformerConfig, plan: ParallelPlan, cluster: Cluster) -> list[float]:
    """Seconds per micro-batch each virtual stage's backward spends on memory-bound gradient passes of its
    own: adding its gradients into the accumulation buffer (`grad_accumulation = "separate"`: it reads
    the fresh `dtype` gradients and reads and writes the `grad_dtype` buffer), or copying each unit's
    gradients into its flat gradient ("flat_copy") or into the reduce-scatter input ("copy_in_out"), the
    compute stream's part of `loom.cost.zero3.unit_copy_bytes`; 0 when fused."""
    if plan.grad_accumulation == "fused":
        return [0.0] * plan.virtual_stages
    if plan.grad_accumulation in UNIT_COPIES:
        return [sum(_unit_copy_times(model, plan, cluster, v)[1]) for v in range(plan.virtual_stages)]
    e, g = DTYPE_BYTES[plan.dtype], DTYPE_BYTES[plan.grad_precision]
    return [
        memory_time(cluster.device, sum(chunk_parameters(model, plan, v)) * (e + 2 * g))
        for v in range(plan.virtual_stages)
    ]


def _copy_out(model: TransformerConfig, plan: ParallelPlan, cluster: Cluster) -> list[float]:
    """Seconds per micro-batch each virtual stage's forward, and again its backward, spends copying its
    units' gathered parameters out of the all-gather buffers (FSDP2, `grad_accumulation = "copy_in_out"`:
    the gather part of `loom.cost.zero3.unit_copy_bytes`); 0 for every other system."""
    if plan.grad_accumulation != "copy_in_out":
        return [0.0] * plan.virtual_stages
    return [sum(_unit_copy_times(model, plan, cluster, v)[0]) for v in range(plan.virtual_stages)]


def _stage_units(model: TransformerConfig, plan: ParallelPlan, stage: int) -> list[UnitBytes]:
    """The sharded units (`unit_sharded`) of virtual stage `stage` in forward order, by their gathered bytes per device:
    the embedding (first stage), its layers, the head (last stage)."""
    units = [layer_unit_bytes(model, plan)] * plan.chunk_layers(model.layers)[stage]
    if stage == 0:
        units.insert(0, embedding_unit_bytes(model, plan))
    if stage == plan.virtual_stages - 1:
        units.append(head_unit_bytes(model, plan))
    return units


def _unit_copy_times(
    model: TransformerConfig, plan: ParallelPlan, cluster: Cluster, stage: int
) -> tuple[list[float], list[float], list[float]]:
    """Per unit of virtual stage `stage` (forward order) and micro-batch, the seconds FSDP's copies take
    (`loom.cost.zero3.unit_copy_bytes`; dense parameters over dp, experts over edp): on the compute stream
    after each all-gather, on the compute stream after the unit's backward, and on the stream the unit's
    reduce-scatter waits for; zeros unless `grad_accumulation` is "flat_copy" or "copy_in_out"."""
    units = _stage_units(model, plan, stage)
    if plan.grad_accumulation not in UNIT_COPIES:
        return [0.0] * len(units), [0.0] * len(units), [0.0] * len(units)
    e, device = DTYPE_BYTES[plan.param_precision], cluster.device  # the units' bytes per element
    gather, compute, reduce = [], [], []
    for unit in units:
        groups = ((unit.dense, plan.dp), (unit.expert, plan.edp))
        parts = [unit_copy_bytes(nbytes / e, world, plan) for nbytes, world in groups if nbytes > 0]
        copied = sum(p.gather for p in parts)  # one copy-out kernel, none where FSDP1 gathers in place
        gather.append(memory_time(device, copied, kernels=int(copied > 0)))
        compute.append(memory_time(device, sum(p.compute for p in parts)))
        reduce.append(
            memory_time(device, sum(p.reduce for p in parts), kernels=sum(p.reduce_kernels for p in parts))
        )
    return gather, compute, reduce


def _fsdp_exposed(
    plan: ParallelPlan, rank: int, plain: tuple[list, list], sharded: tuple[list, list]
) -> float:
    """Seconds pipeline rank `rank` spends per iteration waiting on the sharded units' all-gathers and reduce-scatters
    that compute did not hide (its tasks' sharded durations beyond their compute)."""
    stages = range(rank, plan.virtual_stages, plan.pp)
    extra = sum(sharded[k][v] - plain[k][v] for k in (0, 1) for v in stages)
    return plan.micro_batches * extra


def _unit_collective(kind: str, unit: UnitBytes, plan: ParallelPlan, cluster: Cluster) -> float:
    """Seconds of one unit's all-gather or reduce-scatter: dense parameters over the data-parallel group,
    experts over the expert-data-parallel group, one after the other on the communication stream."""
    dp_span = group_span(plan.dp, plan.tp, cluster.gpus_per_node)
    edp_span = group_span(plan.edp, plan.etp * plan.ep, cluster.gpus_per_node)
    return collective_time(kind, unit.dense, dp_span, cluster) + collective_time(
        kind, unit.expert, edp_span, cluster
    )


def _sharded_durations(model, plan, cluster, pieces: PieceCosts, chunks: list[int]):
    """Forward and backward task durations of each virtual stage where the plan runs unit by unit
    (`ParallelPlan.unit_sharded`): every unit (embedding, layers, head) gathers its parameters before its
    forward and, at optimizer level 3, again before its backward, and reduce-scatters its gradients after
    its backward, prefetched one unit ahead (`loom.sim.overlap`); a task lasts until both its compute and
    its communication are done."""
    layer = (_total(pieces.layer_fwd), _total(pieces.layer_bwd) + _total(pieces.layer_recompute))
    embed = (_total(pieces.embed_fwd), _total(pieces.embed_bwd))
    head = (_total(pieces.head_fwd), _total(pieces.head_bwd))
    forward, backward = [], []
    for stage, n in enumerate(chunks):
        costs = [embed] * (stage == 0) + [layer] * n + [head] * (stage == len(chunks) - 1)
        units = _stage_units(model, plan, stage)
        gather = [_unit_collective("all_gather", b, plan, cluster) for b in units]
        # gradients are reduce-scattered in their own precision (FSDP2's reduce_dtype)
        scale = DTYPE_BYTES[plan.grad_precision] / DTYPE_BYTES[plan.param_precision]
        scatter = [_unit_collective("reduce_scatter", b.scaled(scale), plan, cluster) for b in units]
        copy_out, copy, prepare = _unit_copy_times(model, plan, cluster, stage)
        forward.append(sharded_pass([c[0] + out for c, out in zip(costs, copy_out, strict=True)], gather).end)
        regathered = gather[::-1]
        if _gathers(plan) == 1:  # level 2 unit by unit: the units stay gathered from forward to backward
            regathered, copy_out = None, [0.0] * len(units)
        computes = [c[1] + out + seconds for c, out, seconds in zip(costs, copy_out, copy, strict=True)]
        backward.append(sharded_pass(computes[::-1], regathered, scatter[::-1], prepare=prepare[::-1]).end)
    return forward, backward


def _grad_sync_end(model, plan, cluster, rank: int, playback: Playback) -> tuple[float, float]:
    """(end of gradient synchronisation, end of the optimizer step) on pipeline rank `rank`."""
    g, end = DTYPE_BYTES[plan.grad_precision], playback.end[rank]
    dense, expert = stage_parameters(model, plan, rank)
    dp_span = group_span(plan.dp, plan.tp, cluster.gpus_per_node)
    edp_span = group_span(plan.edp, plan.etp * plan.ep, cluster.gpus_per_node)
    comm_free = 0.0
    if not plan.unit_sharded:  # else every unit's reduce-scatter ran in the backward
        kind = plan.grad_collective
        for chunk in sorted(range(plan.interleave), key=lambda c: playback.chunk_done[rank][c]):
            ready = playback.chunk_done[rank][chunk] if plan.overlap_grad_sync else end
            cost = collective_time(kind, g * dense / plan.interleave, dp_span, cluster)
            cost += collective_time(kind, g * expert / plan.interleave, edp_span, cluster)
            comm_free = max(comm_free, ready) + cost
    synced = max(end, comm_free)
    if model.tied_embeddings and plan.pp > 1 and rank in (0, plan.pp - 1):
        span = group_span(2, plan.tp * plan.dp * (plan.pp - 1), cluster.gpus_per_node)
        synced += collective_time("all_reduce", g * model.vocab * model.hidden / plan.tp, span, cluster)
    shard = plan.dp if plan.optimizer_level >= 1 else 1
    # Adam reads the gradients, writes the parameters, and reads and writes its states (`state_bytes`: the
    # fp32 master weights where they are apart from the parameters, both moments, an fp32 gradient copy) of
    # its shard. The gradients and parameters are counted whole, as when the efficiency constants were
    # fitted: counted as shards too (exact under FSDP) the fit half's mean error rises 4.88% -> 4.99%, the
    # small MosaicML runs priced faster; left for the next refit of the constants (docs/simulator.md).
    sizes = state_bytes(plan)
    whole = sizes["grad_bytes"] + sizes["param_bytes"]
    step_bytes = (dense + expert) * (whole + 2 * sizes["optimizer_bytes"] / shard)
    done = synced + memory_time(cluster.device, step_bytes, kernels=4)
    if plan.optimizer_level in (1, 2) and plan.dp > 1 and not plan.unit_sharded:
        gathered = DTYPE_BYTES[plan.param_precision]  # the updated parameters, as they travel
        done += collective_time("all_gather", gathered * dense, dp_span, cluster)
        done += collective_time("all_gather", gathered * expert, edp_span, cluster)
    return synced, done


def _breakdown(
    plan: ParallelPlan,
    pieces: PieceCosts,
    rank_layers: int,
    rank: int,
    times: tuple,
    accumulation: list[float],
    copy_out: list[float],
) -> dict[str, float]:
    tasks = plan.micro_batches * rank_layers  # layer-passes of one kind on this device
    parts: dict[str, float] = {}
    for costs in (pieces.layer_fwd, pieces.layer_bwd):
        for name, value in costs.items():
            parts[name] = parts.get(name, 0.0) + tasks * value
    extras = []
    if rank == 0:
        extras += [pieces.embed_fwd, pieces.embed_bwd]
    if rank == plan.pp - 1:
        extras += [pieces.head_fwd, pieces.head_bwd]
    for costs in extras:
        for name, value in costs.items():
            parts[name] = parts.get(name, 0.0) + plan.micro_batches * value
    parts["recompute"] = tasks * _total(pieces.layer_recompute)
    parts["grad_accumulation"] = plan.micro_batches * sum(accumulation[rank :: plan.pp])
    parts["param_copy_out"] = _gathers(plan) * plan.micro_batches * sum(copy_out[rank :: plan.pp])
    end, busy, sending, synced, done = times
    parts["pp_comm"] = sending  # blocking sends between stages (`ParallelPlan.overlap_p2p` False)
    parts["pipeline_bubble"] = max(0.0, end - busy - sending)
    parts["dp_comm"] = synced - end
    parts["optimizer"] = done - synced
    return parts


@functools.lru_cache(maxsize=4096)
def _peaks_in_flight(schedule: str, pp: int, interleave: int, micro_batches: int) -> tuple[int, ...]:
    """Each pipeline rank's peak of live chunk forwards under a schedule (cached: a planner asks for the
    same schedules many times, and building the orders is the costly part of a memory estimate)."""
    orders = device_orders(schedule, pp, interleave, micro_batches)
    return tuple(peak_in_flight(order, interleave) for order in orders)


def stage_memories(model: TransformerConfig, plan: ParallelPlan, cluster: Cluster) -> list[dict[str, float]]:
    """Bytes per device of each pipeline rank by kind, at its peak of in-flight micro-batches: the memory
    `simulate` reports, without playing the schedule (a planner checks a plan's fit with it first)."""
    peaks = _peaks_in_flight(plan.schedule, plan.pp, plan.interleave, plan.micro_batches)
    return [stage_memory(model, plan, cluster, r, peaks[r]) for r in range(plan.pp)]


def compute_bound(model: TransformerConfig, plan: ParallelPlan, cluster: Cluster) -> float:
    """Seconds the busiest pipeline rank spends in forward and backward passes (recomputation and
    tensor-parallel communication included): a lower bound on `simulate`'s iteration time, since the
    schedule only adds waiting and the step adds gradient synchronisation and the optimizer. Cheap: no
    schedule is played, so a planner ranks many plans by it before simulating the promising ones."""
    forward, backward = _stage_durations(model, plan, cluster, piece_costs(model, plan, cluster))
    return plan.micro_batches * max(
        sum(forward[v] + backward[v] for v in range(rank, plan.virtual_stages, plan.pp))
        for rank in range(plan.pp)
    )


def simulate(
    model: TransformerConfig, plan: ParallelPlan, cluster: Cluster, *, record: bool = False
) -> SimResult:
    """Simulate one iteration; raises `PlanError` when the plan cannot run (memory overflow is reported in
    the result as `fits=False` with the reason instead)."""
    reasons = check_plan(model, plan, cluster)
    if reasons:
        raise PlanError(reasons)
    pieces = piece_costs(model, plan, cluster)
    forward, backward = plain = _stage_durations(model, plan, cluster, pieces)
    rows = shards_as_rows(plan)  # gradients reduced, states sharded over dp x cp
    if rows.unit_sharded and (rows.dp > 1 or rows.edp > 1):  # dense units over dp, experts over edp
        chunks = plan.chunk_layers(model.layers)
        forward, backward = _sharded_durations(model, rows, cluster, pieces, chunks)
    orders = device_orders(plan.schedule, plan.pp, plan.interleave, plan.micro_batches)
    playback = play(
        orders, plan.interleave, plan.micro_batches, forward, backward, pieces.p2p_s,
        blocking=not plan.overlap_p2p, record=record,
    )  # fmt: skip
    ends = [_grad_sync_end(model, rows, cluster, rank, playback) for rank in range(plan.pp)]
    slowest = max(range(plan.pp), key=lambda r: ends[r][1])
    iteration = ends[slowest][1]
    times = (playback.end[slowest], playback.busy[slowest], playback.sending[slowest], *ends[slowest])
    memory = stage_memories(model, plan, cluster)
    fullest = max(memory, key=lambda m: sum(m.values()))
    peak_gib, capacity = sum(fullest.values()) / GIB, cluster.device.memory_gib
    tokens = plan.global_batch * plan.seq
    model_flops = model.model_flops(plan.global_batch, plan.seq)
    hardware_flops = model.hardware_flops(
        plan.global_batch, plan.seq, plan.recompute, skip_mlp_out=skips_mlp_out(model, plan)
    )
    peak_flops = cluster.device.peak(plan.dtype) * plan.devices
    fits = peak_gib <= capacity
    # FSDP's copies are sized by the shard group the sharded timeline above used: dp x cp
    accumulation, copy_out = _grad_accumulation(model, rows, cluster), _copy_out(model, rows, cluster)
    breakdown = _breakdown(
        plan, pieces, plan.rank_layers(model.layers, slowest), slowest, times, accumulation, copy_out
    )
    # exposed communication of sharded units lengthens the tasks (busy time) beyond the compute the rows above count
    breakdown["fsdp_exposed_comm"] = _fsdp_exposed(plan, slowest, plain, (forward, backward))
    return SimResult(
        iteration_s=iteration,
        tokens_per_s=tokens / iteration,
        tflops_per_device=hardware_flops / iteration / plan.devices / 1e12,
        model_tflops_per_device=model_flops / iteration / plan.devices / 1e12,
        mfu=model_flops / iteration / peak_flops,
        hfu=hardware_flops / iteration / peak_flops,
        bubble_fraction=breakdown["pipeline_bubble"] / iteration,
        memory_per_device_gib=peak_gib,
        memory_capacity_gib=capacity,
        fits=fits,
        reason=""
        if fits
        else f"needs {peak_gib:.1f} GiB per device, more than the {capacity:g} GiB of {cluster.name}",
        breakdown=breakdown,
        memory_breakdown_gib={name: value / GIB for name, value in fullest.items()},
        stage_memory_gib=[sum(m.values()) / GIB for m in memory],
        cp_bytes_per_layer=sum(c.count * c.nbytes for c in pieces.layer_cp if c.kind != "recv"),
        timeline=playback.intervals,
    )
