"""Measure this machine into a hardware profile: matmul FLOP/s, memory bandwidth, collectives.

Every measurement runs on all ranks at once (as training does), each rank with the threads `loom.launch`
gives it. Collectives are timed like nccl-tests: algorithm bandwidth = bytes / time, bus bandwidth =
algorithm bandwidth x the collective's bus factor. The profile keeps the vendor-free numbers measured here:
`peak_flops` and `matmul_knee` fitted to two matmul sizes with `matmul_efficiency = 1`, the memory bandwidth
of a large elementwise add, the launch overhead of a tiny op, and one link (latency and bus bandwidth
fitted to all-reduce times over the sizes).
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from loom.cost.collectives import bus_factor, collective_time, group_span
from loom.cost.hardware import GIB, Cluster, Device, Link
from loom.dist.collectives import all_gather_flat, reduce_scatter_flat

__all__ = [
    "PLACEHOLDER_LINK",
    "Calibration",
    "calibrate",
    "fit_knee",
    "fit_link",
    "link_check",
    "measure_rank",
]

DEFAULT_SIZES = (2**12, 2**16, 2**20, 2**22)  # bytes per collective buffer
PLACEHOLDER_LINK = (1e-5, 1e9)  # (latency per step, bus bandwidth) when no all-reduce was measured
COLLECTIVE_KINDS = (
    "all_reduce",
    "all_gather",
    "reduce_scatter",
    "all_to_all",
    "broadcast",
    "reduce",
    "send_recv",
)


@dataclass(kw_only=True)
class Calibration:
    """What `calibrate` measured and the profile built from it."""

    cluster: Cluster
    matmul: list[dict] = field(default_factory=list)  # size, seconds, flops_per_s
    collectives: list[dict] = field(default_factory=list)  # kind, bytes, seconds, algbw, busbw


def _timed(fn: Callable[[], object], repeats: int, warmup: int = 2) -> float:
    """Median seconds of `fn` over `repeats` runs after `warmup` runs, started together on every rank."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if dist.is_initialized():
            dist.barrier()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _collective(kind: str, nbytes: int) -> Callable[[], object]:
    n, rank = dist.get_world_size(), dist.get_rank()
    elements = max(n, nbytes // 4 // n * n)  # fp32, divisible by the group size
    full, part = torch.ones(elements), torch.ones(elements // n)
    if kind == "all_reduce":
        return lambda: dist.all_reduce(full)
    if kind == "all_gather":
        return lambda: all_gather_flat(full, part)
    if kind == "reduce_scatter":
        return lambda: reduce_scatter_flat(part, full)
    if kind == "all_to_all":
        out = torch.empty_like(full)
        return lambda: dist.all_to_all_single(out, full)
    if kind == "broadcast":
        return lambda: dist.broadcast(full, 0)
    if kind == "reduce":
        return lambda: dist.reduce(full, 0)
    peer = rank ^ 1  # send/recv between pairs of ranks, both directions at once
    if peer >= n:
        return lambda: None

    def exchange() -> None:
        ops = [dist.P2POp(dist.isend, full, peer), dist.P2POp(dist.irecv, torch.empty_like(full), peer)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()

    return exchange


def measure_rank(matmul_sizes: Sequence[int], collective_sizes: Sequence[int], repeats: int) -> dict:
    """Run inside every rank of an initialised group: timings of matmuls, memory traffic and collectives."""
    out: dict = {"matmul": [], "collectives": []}
    for size in matmul_sizes:
        a, b = torch.randn(size, size), torch.randn(size, size)
        seconds = _timed(lambda a=a, b=b: a @ b, repeats)
        out["matmul"].append({"size": size, "seconds": seconds, "flops_per_s": 2 * size**3 / seconds})
    x, y, z = torch.randn(2**23), torch.randn(2**23), torch.empty(2**23)  # 32 MiB each, beyond the caches
    out["memory_bandwidth"] = 3 * x.numel() * 4 / _timed(lambda: torch.add(x, y, out=z), repeats)
    tiny = torch.ones(1)
    out["kernel_overhead_s"] = _timed(lambda: [tiny.add_(0) for _ in range(100)], repeats) / 100
    if dist.is_initialized() and dist.get_world_size() > 1:
        for kind in COLLECTIVE_KINDS:
            for nbytes in collective_sizes:
                seconds = _timed(_collective(kind, nbytes), 2 * repeats, warmup=3)
                algbw = nbytes / seconds
                factor = bus_factor(kind, dist.get_world_size())
                out["collectives"].append(
                    {
                        "kind": kind,
                        "bytes": nbytes,
                        "seconds": seconds,
                        "algbw": algbw,
                        "busbw": algbw * factor,
                    }
                )
    return out


def fit_knee(small: tuple[int, float], large: tuple[int, float]) -> tuple[float, float]:
    """(peak, knee) such that rate(n) = peak * (n / (n + knee))**3 passes through two (n, FLOP/s) points."""
    (ns, rs), (nl, rl) = small, large
    if rs >= rl:  # no shape penalty visible
        return rl, 0.0
    ratio = lambda knee: ((ns / (ns + knee)) / (nl / (nl + knee))) ** 3
    low, high = 0.0, 1e6
    for _ in range(100):  # ratio falls as the knee grows: bisect for rs / rl
        mid = (low + high) / 2
        low, high = (mid, high) if ratio(mid) > rs / rl else (low, mid)
    knee = (low + high) / 2
    return rl / (nl / (nl + knee)) ** 3, knee


def fit_link(points: Sequence[tuple[float, float]], n: int) -> tuple[float, float]:
    """(latency per step, bus bandwidth) from all-reduce (bytes, seconds) points by least squares; from one
    point, its bus bandwidth with no latency (a line needs two sizes)."""
    factor = bus_factor("all_reduce", n)
    if len(points) == 1:
        size, seconds = points[0]
        return 0.0, size * factor / seconds
    steps = 2 * (n - 1)
    xs, ys = [b * factor for b, _ in points], [s for _, s in points]
    mx, my = statistics.mean(xs), statistics.mean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)
    if slope <= 0:  # noise swamped the size dependence: take the best observed rate, no latency
        return 0.0, max(x / y for x, y in zip(xs, ys, strict=True))
    intercept = max(my - slope * mx, 0.0)
    return intercept / steps, 1 / slope


def link_check(calibration: Calibration) -> list[tuple[int, float, float]]:
    """Each measured all-reduce as (bytes, measured seconds, seconds the fitted link predicts): the
    simulator's own `collective_time` on the profile, so a reader sees how well the fit matches."""
    cluster = calibration.cluster
    span = group_span(cluster.gpus, 1, cluster.gpus_per_node)
    return [
        (row["bytes"], row["seconds"], collective_time("all_reduce", row["bytes"], span, cluster))
        for row in calibration.collectives
        if row["kind"] == "all_reduce"
    ]


def _total_memory_gib() -> float:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB
    except (ValueError, OSError, AttributeError):
        return 16.0


def build_profile(ranks: list[dict], nprocs: int, name: str = "this-machine") -> Calibration:
    """A `Calibration` (profile plus tables) from the per-rank results of `measure_rank`."""
    matmul = [
        {**row, "flops_per_s": min(r["matmul"][i]["flops_per_s"] for r in ranks)}
        for i, row in enumerate(ranks[0]["matmul"])
    ]  # the slowest rank sets the pace
    points = [(row["size"], row["flops_per_s"]) for row in matmul]
    peak, knee = fit_knee(points[0], points[-1]) if len(points) > 1 else (points[0][1], 0.0)
    collectives = ranks[0]["collectives"]
    all_reduce = [(row["bytes"], row["seconds"]) for row in collectives if row["kind"] == "all_reduce"]
    # without an all-reduce to fit (one rank), a placeholder link that `loom bench` reports as such
    latency, bandwidth = fit_link(all_reduce, nprocs) if all_reduce and nprocs > 1 else PLACEHOLDER_LINK
    link = Link(name="gloo-local", bandwidth=bandwidth, latency_s=latency, efficiency=1.0)
    device = Device(
        name=name, peak_flops={"fp32": peak}, memory_gib=_total_memory_gib() / nprocs,
        memory_bandwidth=min(r["memory_bandwidth"] for r in ranks), matmul_efficiency=1.0, matmul_knee=knee,
        memory_efficiency=1.0, kernel_overhead_s=statistics.median(r["kernel_overhead_s"] for r in ranks),
        reserved_gib=0.0,
    )  # fmt: skip
    cluster = Cluster(
        device=device, intra=link, inter=link, gpus_per_node=nprocs, gpus=nprocs,
        notes=f"measured by loom bench on {nprocs} local ranks ({torch.get_num_threads()} threads in the caller)",
    )  # fmt: skip
    return Calibration(cluster=cluster, matmul=matmul, collectives=collectives)


def _measure_worker(matmul_sizes, collective_sizes, repeats) -> dict:
    import loom

    loom.init()
    return measure_rank(matmul_sizes, collective_sizes, repeats)


def calibrate(
    nprocs: int = 2, *, matmul_sizes: Sequence[int] = (128, 512), collective_sizes: Sequence[int] = DEFAULT_SIZES,
    repeats: int = 5, backend: str | None = None,
) -> Calibration:  # fmt: skip
    """Measure this machine on `nprocs` local ranks (gloo on CPU, NCCL on GPUs) and build its profile."""
    from loom.dist.launch import launch

    ranks = launch(
        _measure_worker, nprocs, tuple(matmul_sizes), tuple(collective_sizes), repeats, backend=backend
    )
    return build_profile(ranks, nprocs)
