"""Pipeline schedules side by side on 4 CPU ranks: bubble of 1F1B against (p-1)/(m+p-1), zero-bubble
against 1F1B, and peak saved-activation memory per stage of 1F1B against GPipe; draws docs/pipeline_1f1b.png.

Equal stages of matmuls (no sleeps) so that compute dominates the small activation messages. Caveat: 4
processes share the CPU cores here (2 on the development machine), so ranks steal time from each other and
the measured bubbles are distorted (an idle rank lets a busy one run faster); they are measured honestly,
not corrected.

    python benchmarks/pipeline.py [--microbatches 8] [--width 512] [--rows 256] [--layers 4]
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch
import torch.distributed as dist
from torch import nn

import loom
from loom.pipeline import (
    Pipeline,
    Recorder,
    bubble_fraction,
    plot_timeline,
    stage_indices,
    theoretical_bubble,
)

PP = 4
RUNS = (("1f1b", 1), ("zero_bubble", 1), ("zbv", 2), ("gpipe", 1))


def _stage(width: int, layers: int, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(*(m for _ in range(layers) for m in (nn.Linear(width, width), nn.Tanh())))


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out - target) ** 2).mean()


def run_schedule(name: str, virtual: int, args: argparse.Namespace) -> dict:
    """Two warm-up steps, then one recorded step: this rank's events and peak activation bytes per stage."""
    rank = dist.get_rank()
    layers = args.layers // virtual  # the same model whatever the number of stages
    indices = stage_indices(name, rank, PP, virtual)
    modules = [_stage(args.width, layers, seed=k) for k in indices]
    recorder = Recorder(rank=rank)
    pipe = Pipeline(modules, schedule=name, microbatches=args.microbatches, loss_fn=_loss, recorder=recorder)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(args.microbatches * args.rows, args.width, generator=generator)
    y = torch.randn(args.microbatches * args.rows, args.width, generator=generator)
    for _ in range(3):
        recorder.clear()
        pipe.reset_peaks()
        dist.barrier()
        pipe.step(x, y)
        for m in modules:
            m.zero_grad(set_to_none=True)
    peaks = dict(zip(indices, pipe.peak_activation_bytes(), strict=True))
    return {"events": list(recorder.events), "peaks": peaks}


def worker(args: argparse.Namespace) -> dict:
    torch.set_num_threads(1)  # 4 ranks on few cores: one thread each
    loom.init()
    return {name: run_schedule(name, virtual, args) for name, virtual in RUNS}


def _bubbles(results: list[dict], name: str) -> list[float]:
    return [bubble_fraction(r[name]["events"]) for r in results]


def _report(results: list[dict], args: argparse.Namespace) -> None:
    m = args.microbatches
    print(
        f"pipeline benchmark: p={PP} ranks, m={m} micro-batches of {args.rows}x{args.width}, "
        f"{args.layers} matmul layers per rank, cores={os.cpu_count()}"
    )
    print(f"{'schedule':<12} {'bubble per rank':<32} {'mean':>6}   theory")
    for name, virtual in RUNS:
        bubbles = _bubbles(results, name)
        theory = f"{theoretical_bubble(PP, m, virtual):.3f}" if name in ("1f1b", "gpipe") else "-"
        cells = " ".join(f"{b:.3f}" for b in bubbles)
        print(f"{name:<12} {cells:<32} {statistics.mean(bubbles):>6.3f}   {theory}")
    ratio = statistics.mean(_bubbles(results, "zero_bubble")) / statistics.mean(_bubbles(results, "1f1b"))
    print(f"zero_bubble / 1f1b mean bubble: {ratio:.2f}")
    print("peak saved activations per stage (KiB): stage  1f1b  gpipe  gpipe/1f1b")
    for rank, r in enumerate(results):
        a, b = r["1f1b"]["peaks"][rank], r["gpipe"]["peaks"][rank]
        print(
            f"  {rank}  {a / 1024:8.0f}  {b / 1024:8.0f}  {b / a:5.2f}  (in flight: 1f1b {PP - rank}, gpipe {m})"
        )
    print("  (stage 0 also counts its whole input batch once: its micro-batches are views of one tensor)")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4, help="matmul layers per rank (even, for zbv)")
    parser.add_argument(
        "--png", default=os.path.join(os.path.dirname(__file__), "..", "docs", "pipeline_1f1b.png")
    )
    args = parser.parse_args()
    results = loom.launch(worker, PP, args, timeout=600)
    _report(results, args)
    events = [e for r in results for e in r["1f1b"]["events"]]
    bubble = statistics.mean(_bubbles(results, "1f1b"))
    title = (
        f"1F1B, p={PP}, m={args.microbatches}: measured bubble {bubble:.2f} "
        f"(theory {theoretical_bubble(PP, args.microbatches):.2f}), 4 ranks sharing {os.cpu_count()} cores"
    )
    plot_timeline(events, os.path.normpath(args.png), title)
    print(f"timeline: {os.path.normpath(args.png)}")


if __name__ == "__main__":
    main()
