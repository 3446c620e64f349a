"""Training step time: loom against PyTorch's own wrappers, side by side in one run.

Two comparisons on the same model, data and ranks (CPU, gloo; default 2 ranks):
(a) loom data parallelism at optimizer level 0 (`loom.parallelize(mode="data_parallel")`, plain AdamW)
    against `torch.nn.parallel.DistributedDataParallel` with AdamW;
(b) loom at optimizer level 3 (`loom.parallel.make_optimizer(model, AdamW, 3)`: parameters, gradients and
    AdamW states sharded, each layer gathered before use) against FSDP2 (`fully_shard` on each layer, then
    on the root, on a 1-D DeviceMesh of the same ranks) with AdamW.
The model is an MLP of about 4.2M parameters whose layers sit in an `nn.ModuleList` (the units of level 3
and FSDP2) and whose forward returns the MSE loss. All four copies start from the same weights.

A step is forward, backward, `optimizer.step()` and `optimizer.zero_grad()`, timed with `perf_counter` on
each rank (no Trainer: its gradient-norm reduction would be an extra collective that DDP and FSDP2 do not
make). Steps are interleaved, the order rotating every iteration (loom-0, DDP, loom-3, FSDP2, then DDP,
loom-3, FSDP2, loom-0, ...), so that all four see the same machine load; the first `--warmup` steps are
dropped (level 3 shards the parameters from its second step on). Prints each rank's median, the median over
the ranks, the ratios loom / DDP and loom-level-3 / FSDP2 (goal: at most 1.10 each), and the largest
absolute difference between the parameters each pair ends with (loom level 3 read inside
`model.loom.full_parameters()`, FSDP2's through `.full_tensor()`).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import loom
from loom.models import MLP, MLPRegression

NAMES = ("loom-0", "ddp", "loom-3", "fsdp2")


Regression = MLPRegression  # the layers in an nn.ModuleList: units for level 3 and FSDP2


def _step(model, optimizer, x, y) -> float:
    start = time.perf_counter()
    model(x, y).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def _fsdp2(base: nn.Module) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (loom.world_size(),))
    model = copy.deepcopy(base)
    for layer in model.layers:
        if any(True for _ in layer.parameters()):
            fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _max_difference(ours, theirs) -> float:
    return max((a.detach() - b.detach()).abs().max().item() for a, b in zip(ours, theirs, strict=True))


def measure(steps: int, warmup: int, batch: int, width: int, depth: int, lr: float) -> dict:
    loom.init()
    torch.manual_seed(0)
    base = Regression(MLP(width // 2, width, width // 2, depth=depth))
    models = {
        "loom-0": loom.parallelize(copy.deepcopy(base), mode="data_parallel"),
        "ddp": DistributedDataParallel(copy.deepcopy(base)),
        "loom-3": loom.parallelize(copy.deepcopy(base), mode="data_parallel"),
        "fsdp2": _fsdp2(base),
    }
    optimizers = {
        "loom-0": loom.parallel.make_optimizer(models["loom-0"], torch.optim.AdamW, 0, lr=lr),
        "ddp": torch.optim.AdamW(models["ddp"].parameters(), lr=lr),
        "loom-3": loom.parallel.make_optimizer(models["loom-3"], torch.optim.AdamW, 3, lr=lr),
        "fsdp2": torch.optim.AdamW(models["fsdp2"].parameters(), lr=lr),
    }
    generator = torch.Generator().manual_seed(1 + loom.rank())
    x = torch.randn(batch, width // 2, generator=generator)
    y = torch.randn(batch, width // 2, generator=generator)
    times: dict[str, list[float]] = {name: [] for name in NAMES}
    for i in range(warmup + steps):
        shift = i % len(NAMES)
        for name in NAMES[shift:] + NAMES[:shift]:
            elapsed = _step(models[name], optimizers[name], x, y)
            if i >= warmup:
                times[name].append(elapsed)
    result = {name: statistics.median(values) for name, values in times.items()}
    result["params"] = sum(p.numel() for p in base.parameters())
    result["moved"] = _max_difference(models["loom-0"].parameters(), base.parameters())
    result["ddp_difference"] = _max_difference(
        models["loom-0"].parameters(), models["ddp"].module.parameters()
    )
    fsdp = [p.full_tensor() for p in models["fsdp2"].parameters()]
    with models["loom-3"].loom.full_parameters():
        result["fsdp2_difference"] = _max_difference(models["loom-3"].parameters(), fsdp)
        result["level_difference"] = _max_difference(
            models["loom-3"].parameters(), models["loom-0"].parameters()
        )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30, help="timed steps of each of the four")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first (at least 2)")
    parser.add_argument("--batch", type=int, default=64, help="per-rank batch")
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=5)
    parser.add_argument("--lr", type=float, default=1e-3)
    args = parser.parse_args()
    if args.warmup < 2:
        parser.error("--warmup must be at least 2: level 3 learns its buckets in the first step")
    results = loom.launch(
        measure, args.ranks, args.steps, args.warmup, args.batch, args.width, args.depth, args.lr
    )
    print(
        f"MLP with {results[0]['params'] / 1e6:.2f}M parameters, {args.ranks} ranks, batch {args.batch} per "
        f"rank, AdamW, {args.steps} timed steps each after {args.warmup} warm-up steps"
    )
    header = f"{'median step (ms)':<18}" + "".join(f"{name:>10}" for name in NAMES)
    print(header)
    print("-" * len(header))
    for rank, result in enumerate(results):
        print(f"{'rank ' + str(rank):<18}" + "".join(f"{result[name] * 1e3:>10.1f}" for name in NAMES))
    median = {name: statistics.median(r[name] for r in results) for name in NAMES}
    print(f"{'median of ranks':<18}" + "".join(f"{median[name] * 1e3:>10.1f}" for name in NAMES))
    print()
    for ours, theirs in (("loom-0", "ddp"), ("loom-3", "fsdp2")):
        ratio = median[ours] / median[theirs]
        verdict = "ok" if ratio <= 1.10 else f"SLOWER than the goal by {(ratio - 1.10) * 100:.1f} points"
        print(f"ratio {ours} / {theirs}: {ratio:.3f} (goal <= 1.10: {verdict})")
    print()
    worst = {key: max(r[key] for r in results) for key in ("ddp_difference", "fsdp2_difference")}
    print(f"parameters after training, max |loom-0 - DDP|:   {worst['ddp_difference']:.3e}")
    print(f"parameters after training, max |loom-3 - FSDP2|: {worst['fsdp2_difference']:.3e}")
    level = max(r["level_difference"] for r in results)
    print(f"parameters after training, max |loom-3 - loom-0|: {level:.3e}")
    moved = max(r["moved"] for r in results)
    print(f"(for scale: max |loom-0 - initial| = {moved:.3e}; all four started from the same weights)")


if __name__ == "__main__":
    main()
