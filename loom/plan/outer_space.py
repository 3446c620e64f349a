"""The outer search's space: mesh shapes (dp, tp, pp, ep, cp with its attention), pipeline stages and
micro-batch sizes that can run a model on a cluster, and the regions that cannot, each with the reason
(`loom.plan.outer` prices them).

What can run is decided by the simulator's own checks (`loom.sim.simulator.check_plan`) on probe plans,
so the search never disagrees with `loom simulate` about a plan being possible.

Context parallelism (cp, each sequence cut over cp ranks) is tried at powers of two, with every pipeline
depth and ep the rest allows, with each attention that can cut the model (Ulysses: tp * cp divides the heads;
ring: the sequence a multiple of 2 * cp). One choice is pruned as dominated: a cp mesh's micro-batch of m
sequences, m a multiple of cp, holds per rank the tokens, the activations and the attention work of the
mesh with dp * cp replicas at micro-batch m / cp, which has no cp exchanges to pay for; so when that mesh
exists (dp * cp divides the global batch) a cp mesh only tries micro-batches below cp. Not for ring
attention without fused attention: computed block by block, it keeps no scores where the plain kernel keeps
them all, so it may fit where that mesh does not.
"""

from __future__ import annotations

from dataclasses import dataclass

from loom.cost.hardware import Cluster
from loom.cost.plan import ATTENTIONS, ParallelPlan, light_ends
from loom.cost.transformer import TransformerConfig
from loom.sim.simulator import check_plan

__all__ = [
    "LONG_SEQUENCE",
    "Infeasible",
    "Mesh",
    "context_degrees",
    "divisors",
    "even_split",
    "meshes",
    "micro_batch_sizes",
    "stage_options",
]

MAX_INTERLEAVES = 3  # chunks per stage tried beyond 1: the smallest divisors of a stage's layers
MAX_MICRO_BATCH = 8  # beyond it a micro-batch only adds activation memory: matmuls are already large
LONG_SEQUENCE = 8192  # from this many tokens per sequence the search tries context parallelism unasked


@dataclass(frozen=True)
class Infeasible:
    """A region of the space that cannot run (`region`: e.g. "tp=16"), and why."""

    region: str
    reason: str


@dataclass(frozen=True)
class Mesh:
    """One mesh shape: devices = dp * cp * tp * pp, ep carved out of dp; `attention` spans the cp ranks."""

    dp: int
    tp: int
    pp: int
    ep: int = 1
    cp: int = 1
    attention: str = "ulysses"

    @property
    def region(self) -> str:
        """The shape as the search names it: "dp=8 tp=1 pp=1", with "ep=2", "cp=4 ring" when used."""
        ep = f" ep={self.ep}" if self.ep > 1 else ""
        cp = f" cp={self.cp} {self.attention}" if self.cp > 1 else ""
        return f"dp={self.dp} tp={self.tp} pp={self.pp}{ep}{cp}"


def divisors(n: int) -> list[int]:
    """The divisors of `n`, ascending."""
    return [d for d in range(1, n + 1) if n % d == 0]


def _tp_reasons(model: TransformerConfig, cluster: Cluster, tp: int, seq: int) -> list[str]:
    """Why tensor parallelism of degree `tp` cannot run `model` (heads, MLP width, node size)."""
    if tp > cluster.gpus_per_node:
        return [f"tp={tp} exceeds the {cluster.gpus_per_node} GPUs per node (tp stays inside a node)"]
    probe = ParallelPlan(tp=tp, global_batch=1, seq=seq)
    return check_plan(model, probe, cluster.with_size(tp))


def context_degrees(gpus: int, seq: int) -> tuple[int, ...]:
    """cp degrees worth trying for sequences of `seq` tokens on `gpus` devices: 1, and the powers of two
    from 2 that divide the devices and leave each rank at least 2 tokens of every sequence."""
    return tuple(1 << k for k in range(gpus.bit_length()) if gpus % (1 << k) == 0 and seq >= 2 << k)


def meshes(
    model: TransformerConfig, cluster: Cluster, gpus: int, global_batch: int, seq: int,
    cps: tuple[int, ...] = (1,), context_pipelines: bool = True,
) -> tuple[list[Mesh], list[Infeasible]]:  # fmt: skip
    """Every mesh shape of `gpus` devices that can run `model` at `global_batch`, and the regions that
    cannot. ep (experts over the data-parallel axis) is tried at every degree dividing dp and the experts;
    each cp of `cps` (`context_degrees`) above 1 with every pp (pp = 1 only without `context_pipelines`),
    and every attention that fits it."""
    found, infeasible = [], []
    for tp in divisors(gpus):
        reasons = _tp_reasons(model, cluster, tp, seq)
        if reasons:
            infeasible.append(Infeasible(f"tp={tp}", "; ".join(reasons)))
            continue
        for cp in (c for c in sorted({1, *cps}) if (gpus // tp) % c == 0):
            for pp in divisors(gpus // (tp * cp)) if cp == 1 or context_pipelines else [1]:
                mesh = Mesh(gpus // (tp * pp * cp), tp, pp, cp=cp)
                reason = _batch_reason(model, mesh, global_batch)
                if reason is not None:
                    infeasible.append(Infeasible(mesh.region.replace(" ulysses", ""), reason))
                elif cp == 1:
                    found += [Mesh(mesh.dp, tp, pp, ep) for ep in _expert_degrees(model, mesh.dp)]
                else:
                    _context_meshes(model, cluster, mesh, seq, found, infeasible)
    return found, infeasible


def _batch_reason(model: TransformerConfig, mesh: Mesh, global_batch: int) -> str | None:
    """Why `mesh` cannot take the model's layers or the global batch, or None."""
    if mesh.pp > model.layers:
        return f"pp={mesh.pp} exceeds the model's {model.layers} layers"
    if global_batch % mesh.dp:
        return f"dp={mesh.dp} does not divide the global batch {global_batch}"
    if global_batch // mesh.dp < mesh.pp:
        return f"{global_batch // mesh.dp} micro-batches per replica cannot fill pp={mesh.pp} stages (needs >= pp)"
    return None


def _expert_degrees(model: TransformerConfig, dp: int) -> list[int]:
    """ep degrees to try: every divisor of dp that divides the experts (1 for a dense model)."""
    return [e for e in divisors(dp) if model.experts % e == 0] if model.is_moe else [1]


def _context_meshes(
    model: TransformerConfig, cluster: Cluster, mesh: Mesh, seq: int, found: list[Mesh],
    infeasible: list[Infeasible],
) -> None:  # fmt: skip
    """`mesh` (cp > 1) with each attention the simulator accepts and each ep, into `found`; else why not."""
    why = []
    for attention in ATTENTIONS:
        probe = ParallelPlan(dp=mesh.dp, tp=mesh.tp, pp=mesh.pp, cp=mesh.cp, attention=attention,
                             global_batch=mesh.dp * mesh.pp, seq=seq)  # fmt: skip
        reasons = check_plan(model, probe, cluster.with_size(probe.devices))
        if reasons:
            why.append(f"{attention}: " + "; ".join(reasons))
        else:
            found += [
                Mesh(mesh.dp, mesh.tp, mesh.pp, ep, cp=mesh.cp, attention=attention)
                for ep in _expert_degrees(model, mesh.dp)
            ]
    if len(why) == len(ATTENTIONS):
        infeasible.append(Infeasible(mesh.region.replace(" ulysses", ""), " | ".join(why)))


def micro_batch_sizes(mesh: Mesh, global_batch: int, *, flash_attention: bool = False) -> list[int]:
    """Micro-batch sizes: powers of two up to `MAX_MICRO_BATCH` dividing a replica's batch, leaving at
    least pp micro-batches (fewer never fill the pipeline); on a cp mesh, only those below cp when the
    mesh of dp * cp replicas can take the batch (larger ones are dominated: see the module's docstring;
    `flash_attention`: the plans' attention is fused)."""
    per_replica = global_batch // mesh.dp
    sizes = [1 << k for k in range(MAX_MICRO_BATCH.bit_length())]
    same_attention = mesh.attention == "ulysses" or flash_attention
    dominated = mesh.cp > 1 and global_batch % (mesh.dp * mesh.cp) == 0 and same_attention
    return [
        b
        for b in sizes
        if per_replica % b == 0 and per_replica // b >= mesh.pp and not (dominated and b % mesh.cp == 0)
    ]


def even_split(layers: int, stages: int) -> tuple[int, ...]:
    """`layers` over `stages` as evenly as possible; the extra layers go to the middle stages first,
    since the first and last stage also hold the embedding and the output layer."""
    base, extra = divmod(layers, stages)
    counts = [base] * stages
    order = list(range(1, stages - 1)) + [0, stages - 1]
    for index in order[:extra]:
        counts[index] += 1
    return tuple(counts)


def stage_options(layers: int, pp: int, micro_batches: int) -> list[tuple[int, tuple[int, ...]]]:
    """(chunks per stage, uneven stage layers or ()) for `pp` stages: equal stages with 1 chunk and the
    interleaved schedule's few smallest chunk counts (it needs micro-batches in multiples of pp), or, when
    the layers do not split equally, one uneven split; and light ends (the first and last stage one layer
    lighter, for the embedding and the head) when the layers allow it."""
    if pp == 1:
        return [(1, ())]
    ends = [(1, light_ends(layers, pp))] if pp >= 3 and (layers + 2) % pp == 0 else []
    if layers % pp:
        return ends or [(1, even_split(layers, pp))]
    options = [(1, ()), *ends]
    if micro_batches % pp == 0:
        chunks = [v for v in divisors(layers // pp) if v > 1][:MAX_INTERLEAVES]
        options += [(v, ()) for v in chunks]
    return options
