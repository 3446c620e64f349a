"""Data-parallel step time: loom against PyTorch's DistributedDataParallel, side by side in one run.

An MLP of about 4.2M parameters on 2 CPU ranks (gloo). Both wrappers train identical copies; their steps are
interleaved (loom, DDP, loom, DDP, ...) so that both see the same machine load, and the median step times are
compared. Prints the ratio loom / DDP (goal: at most 1.10).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

import loom
from loom.models import MLP


def _step(model, optimizer, x, y) -> float:
    start = time.perf_counter()
    loss = F.mse_loss(model(x), y)
    optimizer.zero_grad(set_to_none=False)
    loss.backward()
    optimizer.step()
    return time.perf_counter() - start


def measure(steps: int, warmup: int, batch: int, width: int, depth: int) -> dict:
    loom.init()
    torch.manual_seed(0)
    base = MLP(width // 2, width, width // 2, depth=depth)
    params = sum(p.numel() for p in base.parameters())
    ours = loom.parallelize(copy.deepcopy(base), mode="data_parallel")
    theirs = DistributedDataParallel(copy.deepcopy(base))
    optimizers = {
        name: torch.optim.SGD(m.parameters(), lr=1e-3) for name, m in (("loom", ours), ("ddp", theirs))
    }
    generator = torch.Generator().manual_seed(loom.rank())
    x, y = (
        torch.randn(batch, width // 2, generator=generator),
        torch.randn(batch, width // 2, generator=generator),
    )
    times = {"loom": [], "ddp": []}
    for i in range(warmup + steps):
        for name, model in (("loom", ours), ("ddp", theirs)) if i % 2 else (("ddp", theirs), ("loom", ours)):
            elapsed = _step(model, optimizers[name], x, y)
            if i >= warmup:
                times[name].append(elapsed)
    same = all(
        torch.allclose(a, b, atol=1e-5) for a, b in zip(ours.parameters(), theirs.parameters(), strict=True)
    )
    return {"params": params, "loom": statistics.median(times["loom"]), "ddp": statistics.median(times["ddp"]),
            "same_parameters": same}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--batch", type=int, default=64, help="per-rank batch")
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=5)
    args = parser.parse_args()
    results = loom.launch(measure, args.ranks, args.steps, args.warmup, args.batch, args.width, args.depth)
    ours = statistics.median(r["loom"] for r in results)
    theirs = statistics.median(r["ddp"] for r in results)
    print(
        f"MLP with {results[0]['params'] / 1e6:.2f}M parameters, {args.ranks} ranks, batch {args.batch} per rank"
    )
    print(f"median step: loom {ours * 1e3:.1f} ms, DDP {theirs * 1e3:.1f} ms")
    print(f"ratio loom / DDP: {ours / theirs:.3f} (goal <= 1.10)")
    print(f"parameters equal after training: {all(r['same_parameters'] for r in results)}")


if __name__ == "__main__":
    main()
