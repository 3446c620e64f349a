"""Measure this machine into a hardware profile: matmul FLOP/s, memory bandwidth, collectives.

Every measurement runs on all ranks at once (as training does), each rank with the threads `loom.launch`
gives it. Collectives are timed like nccl-tests: algorithm bandwidth = bytes / time, bus bandwidth =
algorithm bandwidth x the collective's bus factor. The profile keeps the vendor-free numbers measured here:
- `peak_flops` and `matmul_knee` (with `matmul_efficiency = 1`) fitted by least squares to the matmul rates
  measured at the given shapes, each shape timed in the three layouts a linear layer runs per training step
  (forward, input gradient, weight gradient). Give the shapes a model runs (`loom.cost.layer.gemm_shapes`):
  on CPUs the rate depends on shape and cache size far more than the knee's curve says, so a curve fitted
  to squares far from the model's shapes misprices it (by 2x on 2 shared cores);
- the memory bandwidth of a large add, and as `memory_efficiency` the share of it that a training step's
  elementwise kernels reach (GELU, softmax and layer norm, forward and backward, at the activations' size,
  their bytes counted as `loom.cost.layer` counts them): on CPUs these kernels are bound by their
  arithmetic (erf, exp), not by memory, and reach a fraction of the add's bandwidth;
- the overhead of one kernel as a training step pays it: a tiny op recorded by autograd, its forward and
  backward (the simulator charges a backward twice its forward's kernels);
- one link: latency and bus bandwidth fitted to all-reduce times over the sizes.
"""

from __future__ import annotations

import math
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F

from loom.cost.collectives import bus_factor, collective_time, group_span
from loom.cost.hardware import GIB, Cluster, Device, Link
from loom.cost.layer import BACKWARD_BYTES
from loom.dist.collectives import all_gather_flat, reduce_scatter_flat

__all__ = [
    "PLACEHOLDER_LINK",
    "Calibration",
    "calibrate",
    "fit_link",
    "fit_matmul",
    "link_check",
    "measure_rank",
]

DEFAULT_SIZES = (2**12, 2**16, 2**20, 2**22)  # bytes per collective buffer
DEFAULT_ACTIVATION = 2**20  # elements of the tensor the elementwise kernels are timed on (4 MiB in fp32)
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
    matmul: list[dict] = field(default_factory=list)  # size, shape, seconds, flops_per_s
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


MatmulShape = int | tuple[int, int, int]  # n (an n x n @ n x n matmul) or (m, k, n)


def _shape(size: MatmulShape) -> tuple[int, int, int]:
    return (size, size, size) if isinstance(size, int) else tuple(int(d) for d in size)


def _linear_passes(m: int, k: int, n: int) -> Callable[[], object]:
    """The three GEMMs of a linear layer of input (m, k) and weight (n, k) in one training step, in the
    memory layouts autograd runs them: forward x @ w^T, input gradient dy @ w, weight gradient dy^T @ x."""
    x, w, dy = torch.randn(m, k), torch.randn(n, k), torch.randn(m, n)
    return lambda: (x @ w.t(), dy @ w, dy.t() @ x)


def _elementwise_passes(elements: int) -> tuple[Callable[[], object], float]:
    """A training step's usual elementwise kernels (GELU, softmax, layer norm) forward and backward on
    `elements` values, and the bytes `loom.cost.layer` counts for them (each forward reads and writes its
    tensor; its backward moves `BACKWARD_BYTES` times that)."""
    rows = max(1, elements // 1024)
    x = torch.randn(rows, min(elements, 1024), requires_grad=True)
    grad = torch.randn_like(x)
    ops = (F.gelu, lambda t: torch.softmax(t, -1), lambda t: F.layer_norm(t, t.shape[-1:]))

    def run() -> None:
        for op in ops:
            torch.autograd.grad(op(x), x, grad)

    return run, len(ops) * (1 + BACKWARD_BYTES) * 2 * x.numel() * x.element_size()


def _kernel_overhead(repeats: int, ops: int = 100) -> float:
    """Seconds one kernel costs a training step beyond its work: a chain of `ops` tiny ops recorded by
    autograd, forward and backward, over the 1 + BACKWARD_BYTES kernels the simulator charges per op."""
    tiny = torch.ones(1, requires_grad=True)

    def chain() -> None:
        y = tiny
        for _ in range(ops):
            y = y * 1.0
        torch.autograd.grad(y, tiny)

    return _timed(chain, repeats) / (ops * (1 + BACKWARD_BYTES))


def measure_rank(
    matmul_sizes: Sequence[MatmulShape], collective_sizes: Sequence[int], repeats: int,
    activation_elements: int = DEFAULT_ACTIVATION,
) -> dict:  # fmt: skip
    """Run inside every rank of an initialised group: timings of matmuls (at `matmul_sizes`: n for a
    square, or (m, k, n)), memory traffic, elementwise kernels, kernel overhead and collectives."""
    out: dict = {"matmul": [], "collectives": []}
    for size in matmul_sizes:
        m, k, n = shape = _shape(size)
        seconds = _timed(_linear_passes(m, k, n), repeats)
        out["matmul"].append(
            {"size": size, "shape": shape, "seconds": seconds, "flops_per_s": 3 * 2 * m * k * n / seconds}
        )
    x, y, z = torch.randn(2**23), torch.randn(2**23), torch.empty(2**23)  # 32 MiB each, beyond the caches
    out["memory_bandwidth"] = 3 * x.numel() * 4 / _timed(lambda: torch.add(x, y, out=z), repeats)
    elementwise, moved = _elementwise_passes(activation_elements)
    out["elementwise_bandwidth"] = moved / _timed(elementwise, repeats)
    out["kernel_overhead_s"] = _kernel_overhead(repeats)
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


def _shape_efficiency(shape: tuple[int, int, int], knee: float) -> float:
    return math.prod(d / (d + knee) for d in shape)  # `loom.cost.compute.matmul_efficiency`'s curve


def fit_matmul(points: Sequence[tuple[tuple[int, int, int], float]]) -> tuple[float, float]:
    """(peak, knee) such that rate(m, k, n) = peak * m/(m+knee) * k/(k+knee) * n/(n+knee) fits measured
    ((m, k, n), FLOP/s) points best: least squares on log rate, each point weighted by its FLOPs (so the
    GEMMs that take the time fit best). Two points where the larger is faster are met exactly; rates
    that do not grow with size give knee 0 (no shape penalty visible)."""

    def solve(knee: float) -> tuple[float, float]:  # (log peak, weighted squared error) for this knee
        weights = [math.prod(s) for s, _ in points]
        logs = [math.log(r / _shape_efficiency(s, knee)) for s, r in points]
        log_peak = sum(w * v for w, v in zip(weights, logs, strict=True)) / sum(weights)
        return log_peak, sum(w * (v - log_peak) ** 2 for w, v in zip(weights, logs, strict=True))

    # a coarse geometric grid, then golden section around its best (the error is smooth in the knee)
    grid = [0.0] + [2 ** (i / 4) for i in range(0, 4 * 14)]
    best = min(range(len(grid)), key=lambda i: solve(grid[i])[1])
    low, high = grid[max(best - 1, 0)], grid[min(best + 1, len(grid) - 1)]
    ratio = (math.sqrt(5) - 1) / 2
    for _ in range(100):
        a, b = high - ratio * (high - low), low + ratio * (high - low)
        low, high = (low, b) if solve(a)[1] <= solve(b)[1] else (a, high)
    knee = (low + high) / 2
    if solve(0.0)[1] <= solve(knee)[1]:
        knee = 0.0
    return math.exp(solve(knee)[0]), knee


def fit_link(points: Sequence[tuple[float, float]], n: int) -> tuple[float, float]:
    """(latency per step, bus bandwidth) from all-reduce (bytes, seconds) points by least squares on the
    relative error (each point weighted by 1 / seconds^2: in plain seconds the largest buffer's noise would
    swamp the small buffers that alone show the latency); from one point, its bus bandwidth with no latency
    (a line needs two sizes)."""
    factor = bus_factor("all_reduce", n)
    if len(points) == 1:
        size, seconds = points[0]
        return 0.0, size * factor / seconds
    steps = 2 * (n - 1)
    xs, ys = [b * factor for b, _ in points], [s for _, s in points]
    ws = [1 / y**2 for y in ys]
    total = sum(ws)
    mx = sum(w * x for w, x in zip(ws, xs, strict=True)) / total
    my = sum(w * y for w, y in zip(ws, ys, strict=True)) / total
    slope = sum(w * (x - mx) * (y - my) for w, x, y in zip(ws, xs, ys, strict=True)) / sum(
        w * (x - mx) ** 2 for w, x in zip(ws, xs, strict=True)
    )
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
    peak, knee = fit_matmul([(_shape(row.get("shape", row["size"])), row["flops_per_s"]) for row in matmul])
    collectives = ranks[0]["collectives"]
    all_reduce = [(row["bytes"], row["seconds"]) for row in collectives if row["kind"] == "all_reduce"]
    # without an all-reduce to fit (one rank), a placeholder link that `loom bench` reports as such
    latency, bandwidth = fit_link(all_reduce, nprocs) if all_reduce and nprocs > 1 else PLACEHOLDER_LINK
    link = Link(name="gloo-local", bandwidth=bandwidth, latency_s=latency, efficiency=1.0)
    memory = min(r["memory_bandwidth"] for r in ranks)
    # the share of the add's bandwidth that the step's elementwise kernels reach (1 when not measured)
    elementwise = min(min(r.get("elementwise_bandwidth", memory) for r in ranks), memory)
    device = Device(
        name=name, peak_flops={"fp32": peak}, memory_gib=_total_memory_gib() / nprocs,
        memory_bandwidth=memory, matmul_efficiency=1.0, matmul_knee=knee,
        memory_efficiency=elementwise / memory, kernel_overhead_s=statistics.median(r["kernel_overhead_s"] for r in ranks),
        reserved_gib=0.0, host_kernel_s=0.0,  # on a CPU the host runs the kernels: kernel_overhead_s holds it
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
