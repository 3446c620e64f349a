"""The planner's outer search: mesh shape, pipeline stages, micro-batches, optimizer level and recompute
policy of a transformer on a cluster, ranked by loom's simulator (`loom.sim.simulator.simulate`). Context
parallelism (cp, with Ulysses or ring attention) joins the mesh shapes for long sequences
(`LONG_SEQUENCE` tokens and more), or when no plan without it fits.

The search runs in two passes, both priced by the simulator's own functions:
1. every plan of the space (`loom.plan.outer_space`) gets its memory (`stage_memories`, no schedule
   played) and a lower bound on its step time (`compute_bound`). Dominated choices are cut here: per
   recompute policy only the lowest optimizer level that fits is kept (higher levels only add
   communication), plus level 1 when level 0 fits (its sharded optimizer step may be quicker); a more
   expensive recompute policy is tried only when the cheaper one needed level 2 or 3 to fit; a larger
   micro-batch is not tried when a smaller one fits nowhere.
2. plans are simulated in order of their bound, until the bound exceeds the k-th best simulated step:
   no plan left can enter the top k, so the ranking is exact for the first `keep` plans.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from loom.cost.hardware import GIB, Cluster
from loom.cost.layer import check_tp_overlap
from loom.cost.plan import (
    LOOM_SYSTEM,
    OPTIMIZER_LEVELS,
    RECOMPUTE,
    SYSTEM_FIELDS,
    UNIT_COPIES,
    UNIT_COPY_LEVELS,
    WHOLE_LAYER_RECOMPUTES,
    ParallelPlan,
    check_choice,
)
from loom.cost.transformer import TransformerConfig
from loom.files import byte_size
from loom.plan.outer_space import (
    LONG_SEQUENCE,
    Infeasible,
    Mesh,
    context_degrees,
    meshes,
    micro_batch_sizes,
    stage_options,
)
from loom.plan.plan import Plan
from loom.sim.simulator import SimResult, compute_bound, simulate, stage_memories

__all__ = ["Candidate", "Infeasible", "SearchResult", "search_plans", "to_plan"]


@dataclass(frozen=True)
class Candidate:
    """One priced plan."""

    plan: ParallelPlan
    result: SimResult

    @property
    def step_s(self) -> float:
        """The simulated step time."""
        return self.result.iteration_s

    @property
    def memory_gib(self) -> float:
        """The simulated peak memory per device, GiB (the device's reserved memory included)."""
        return self.result.memory_per_device_gib

    @property
    def reserved_gib(self) -> float:
        """The device's reserved memory within `memory_gib` (the same for every plan on the device)."""
        return self.result.memory_breakdown_gib.get("reserved", 0.0)


@dataclass
class SearchResult:
    """A search's answer: fitting candidates best first, the regions that cannot run, and its cost. The
    outer search's candidates are `Candidate`s; the operator-level search over meshes
    (`loom.plan.mesh_search`) gives `MeshSolution`s: both have `step_s` and `memory_gib`, which rank them."""

    candidates: list[Candidate]
    infeasible: list[Infeasible]
    memory_limit_gib: float
    considered: int = 0  # plans priced by memory and bound
    simulated: int = 0  # plans whose schedule was played
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)

    @property
    def best(self) -> Candidate | None:
        """The fastest fitting plan (None when nothing fits)."""
        return self.candidates[0] if self.candidates else None

    def why_lost(self, candidate: Candidate) -> str:
        """Why `candidate` ranks below the best: slower by x%, or as fast with more memory."""
        best = self.best
        slower = candidate.step_s / best.step_s - 1
        if slower > 5e-4:
            return f"slower by {slower:.1%}"
        more = candidate.memory_gib - best.memory_gib
        # a tie below 0.05 GiB, or 5% of the best's own memory (its reserved part aside) for a small model
        if more <= min(0.05, 0.05 * (best.memory_gib - best.reserved_gib)):
            return "as good (a tie)"
        return f"as fast, {byte_size(more * GIB)} more memory per device"


@dataclass(frozen=True)
class _Option:
    plan: ParallelPlan
    memory_gib: float
    bound_s: float


def _peak_gib(model: TransformerConfig, plan: ParallelPlan, cluster: Cluster) -> float:
    return max(sum(m.values()) for m in stage_memories(model, plan, cluster)) / GIB


def _policies(
    model, cluster, plan, limit, recomputes, levels
) -> tuple[list[tuple[ParallelPlan, float]], float]:
    """The undominated (recompute, optimizer level) variants of `plan` that fit under `limit` GiB with
    their memory, and the least memory any variant needs (to say why nothing fits)."""
    kept, least = [], float("inf")
    for recompute in recomputes:
        fitting = None
        for level in levels:
            variant = plan.replace(recompute=recompute, optimizer_level=level)
            gib = _peak_gib(model, variant, cluster)
            least = min(least, gib)
            if gib <= limit:
                fitting = level
                kept.append((variant, gib))
                break
        if fitting == 0 and 1 in levels:
            sharded = plan.replace(recompute=recompute, optimizer_level=1)
            gib = _peak_gib(model, sharded, cluster)
            # loom's level 1 keeps an fp32 copy of each rank's chunk: more than level 0 at dp 1
            if gib <= limit:
                kept.append((sharded, gib))
        if fitting is not None and fitting <= 1:
            break  # more recomputation only adds compute to a plan that already fits cheaply
    return kept, least


def _with_tp_overlap(plan: ParallelPlan, cluster: Cluster, wanted: bool) -> ParallelPlan:
    """`plan` with tensor-parallel communication overlapped (`overlap_tp_comm`) when the system overlaps it
    (`wanted`) and the plan can run it (the rules of `ParallelPlan` and `check_tp_overlap`: sequence
    parallelism, tp > 1, the tp group inside a node); as it is otherwise, as Megatron-Bridge turns it off."""
    if not wanted:
        return plan
    try:
        overlapped = plan.replace(overlap_tp_comm=True)
        check_tp_overlap(overlapped, cluster)
    except ValueError:
        return plan
    return overlapped


def _mesh_options(
    model, cluster, mesh: Mesh, base: ParallelPlan, limit, recomputes, levels, sp_choices, overlap_tp: bool
):
    """The fitting options of one mesh shape, and the least memory seen (inf when none was tried)."""
    options, least = [], float("inf")
    for micro in micro_batch_sizes(mesh, base.global_batch, flash_attention=base.flash_attention):
        fit_here = False
        count = base.global_batch // (mesh.dp * micro)
        for interleave, stages in stage_options(model.layers, mesh.pp, count):
            for sp in _sp_choices(mesh, base.seq, sp_choices):
                plan = base.replace(
                    dp=mesh.dp, tp=mesh.tp, pp=mesh.pp, ep=mesh.ep, cp=mesh.cp, attention=mesh.attention,
                    micro_batch=micro, interleave=interleave, schedule=None, stage_layers=stages,
                    sequence_parallel=sp,
                )  # fmt: skip
                plan = _with_tp_overlap(plan, cluster, overlap_tp)
                variants, gib = _policies(model, cluster, plan, limit, recomputes, levels)
                least = min(least, gib)
                for variant, variant_gib in variants:
                    options.append(_Option(variant, variant_gib, compute_bound(model, variant, cluster)))
                fit_here |= bool(variants)
        if not fit_here:
            break  # a larger micro-batch holds more activations: it fits nowhere either
    return options, least


def _sp_choices(mesh: Mesh, seq: int, choices: tuple[bool, ...]) -> tuple[bool, ...]:
    """Sequence parallelism where it can run: tp > 1, and with cp each rank's seq / cp tokens cut over tp."""
    if mesh.tp == 1:
        return (False,)
    return tuple(sp for sp in choices if not (sp and seq % (mesh.tp * mesh.cp)))


def search_plans(
    model: TransformerConfig,
    cluster: Cluster,
    gpus: int,
    global_batch: int,
    seq: int,
    memory_limit: float | None = None,
    *,
    keep: int = 10,
    recompute: tuple[str, ...] = RECOMPUTE,
    optimizer_levels: tuple[int, ...] = OPTIMIZER_LEVELS,
    sequence_parallel: tuple[bool, ...] = (True, False),
    context: tuple[int, ...] | None = None,
    context_pipelines: bool = True,
    **system: Any,
) -> SearchResult:
    """Search mesh shapes, stages, micro-batches, optimizer levels and recompute policies for `model` on
    `gpus` devices of `cluster`'s kind at `global_batch` sequences of `seq` tokens.

    `memory_limit`: bytes per device (default: the device's memory). Returns the fitting plans best
    first, exact for the first `keep` (later ones are those simulated on the way), and the infeasible
    regions with the reason. `recompute`, `optimizer_levels` and `sequence_parallel` are the choices
    tried, cheapest first; how the training system runs a plan is held fixed: `system`, any of the
    `ParallelPlan` fields `SYSTEM_FIELDS` names (`**plan.system()` passes a plan's; those not given keep
    `ParallelPlan`'s defaults, `dtype` bf16; PyTorch FSDP's `UNIT_COPIES` try levels 2 and 3 only;
    `overlap_tp_comm` applies to the plans that can run it). `context`:
    the cp degrees to try (1 for none); None tries the powers of two (`context_degrees`) when `seq` is at
    least `LONG_SEQUENCE`, and otherwise only when no plan without cp fits. `context_pipelines`: cp meshes
    with pipelines too (a run that cannot cut sequences inside pipeline stages, a Hugging Face model's in
    `loom train`, passes False).
    """
    for policy in recompute:  # the simulator prices more (other systems' policies); loom runs these
        check_choice("search_plans", "recompute", policy, RECOMPUTE)
    start = time.perf_counter()
    cluster = cluster.with_size(gpus, cluster.gpus_per_node)
    limit = memory_limit / GIB if memory_limit is not None else cluster.device.memory_gib
    system = {"dtype": "bf16", **system}
    if unknown := sorted(set(system) - set(SYSTEM_FIELDS)):
        raise TypeError(
            f"search_plans: {unknown} are not fields of how a system runs a plan; use those of SYSTEM_FIELDS "
            f"{SYSTEM_FIELDS}"
        )
    overlap_tp_comm = system.pop("overlap_tp_comm", False)  # applied below where a plan can run it
    optimizer_levels = _levels_for(system.get("grad_accumulation", "fused"), optimizer_levels)
    base = ParallelPlan(optimizer_level=optimizer_levels[0], global_batch=global_batch, seq=seq, **system)
    choices = (model, cluster, base, limit, recompute, optimizer_levels, sequence_parallel, overlap_tp_comm)
    degrees = context or (context_degrees(gpus, seq) if seq >= LONG_SEQUENCE else (1,))
    options, infeasible = _options(
        choices, meshes(model, cluster, gpus, global_batch, seq, degrees, context_pipelines)
    )
    notes = []
    if not options and context is None and degrees == (1,) and len(context_degrees(gpus, seq)) > 1:
        # memory forces it: cut the sequences over cp ranks (the meshes without cp, already refused, again)
        more = meshes(model, cluster, gpus, global_batch, seq, context_degrees(gpus, seq), context_pipelines)
        found, why = _options(choices, ([m for m in more[0] if m.cp > 1], more[1]))
        options, infeasible = found, infeasible + [i for i in why if i not in infeasible]
        notes.append("no plan fits without context parallelism: cp was searched too")
    candidates = _simulate_best(model, cluster, options, keep)
    return SearchResult(
        candidates=candidates, infeasible=infeasible, memory_limit_gib=limit, considered=len(options),
        simulated=len(candidates), seconds=time.perf_counter() - start, notes=notes,
    )  # fmt: skip


def _levels_for(grad_accumulation: str, levels: tuple[int, ...]) -> tuple[int, ...]:
    """The optimizer levels a system that accumulates gradients as `grad_accumulation` can run: PyTorch
    FSDP's per-unit gradient copies (`UNIT_COPIES`) exist only at levels 2 and 3 (`ParallelPlan`)."""
    if grad_accumulation not in UNIT_COPIES:
        return levels
    kept = tuple(level for level in levels if level in UNIT_COPY_LEVELS)
    if not kept:
        raise ValueError(
            f"search_plans: grad_accumulation {grad_accumulation!r} (PyTorch FSDP's per-unit gradients) runs at "
            f"optimizer levels 2 and 3 only, and optimizer_levels is {levels}: include 2 or 3, or hold 'fused' "
            "fixed"
        )
    return kept


def _options(choices: tuple, space: tuple[list[Mesh], list[Infeasible]]) -> tuple[list, list[Infeasible]]:
    """The fitting options of every mesh of `space`, and its infeasible regions with those that fit nowhere."""
    model, cluster, base, limit, recompute, levels, sp, overlap_tp = choices
    shapes, infeasible = space
    options = []
    for mesh in shapes:
        found, least = _mesh_options(model, cluster, mesh, base, limit, recompute, levels, sp, overlap_tp)
        options += found
        if not found:
            infeasible.append(Infeasible(mesh.region, f"does not fit: {least:.0f} GiB of {limit:g}"))
    return options, infeasible


def _rank(candidate: Candidate) -> tuple[float, float]:
    return candidate.result.iteration_s, candidate.result.memory_per_device_gib


def _simulate_best(model, cluster, options: list[_Option], keep: int) -> list[Candidate]:
    """Simulate options by ascending bound until the bound passes the `keep`-th best step time."""
    done: list[Candidate] = []
    for option in sorted(options, key=lambda o: (o.bound_s, o.memory_gib)):
        if len(done) >= keep and option.bound_s > sorted(c.result.iteration_s for c in done)[keep - 1]:
            break
        done.append(Candidate(option.plan, simulate(model, option.plan, cluster)))
    return sorted(done, key=_rank)


def to_plan(candidate: Candidate) -> Plan:
    """`candidate` as a `loom.plan.Plan` with its predictions (the inverse of `Plan.parallel_plan`:
    the batch shape, which a Plan does not hold, goes back in through `Plan.parallel_plan`)."""
    p, r = candidate.plan, candidate.result
    foreign = {key: getattr(p, key) for key, ours in LOOM_SYSTEM.items() if getattr(p, key) != ours}
    if (
        p.recompute not in WHOLE_LAYER_RECOMPUTES
    ):  # how far a whole layer's recomputation runs says nothing here
        foreign.pop("recompute_early_stop", None)
    if foreign:
        raise ValueError(
            f"to_plan: this candidate prices another system's ways ({', '.join(f'{k} = {v!r}' for k, v in foreign.items())}), "
            "which loom's runtime does not run: search without them for a loom Plan"
        )
    return Plan(
        dp=p.dp, tp=p.tp, pp=p.pp, ep=p.ep, cp=p.cp, attention=p.attention, schedule=p.schedule,
        virtual_stages=p.interleave, micro_batches=p.micro_batches, stages=list(p.stage_layers) or None, optimizer_level=p.optimizer_level,
        recompute=p.recompute, sequence_parallel=p.sequence_parallel, precision=p.dtype,
        predicted_step_s=r.iteration_s,
        predicted_memory_bytes=int((candidate.memory_gib - candidate.reserved_gib) * GIB),
    )  # fmt: skip
