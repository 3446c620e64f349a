"""Pipeline schedules side by side on 4 CPU ranks: the bubble of 1F1B against (p-1)/(m+p-1), zero-bubble
against 1F1B, and peak saved-activation memory per stage of 1F1B against GPipe; draws docs/pipeline_1f1b.png.

Compute modes (`--compute`):

- `sleep` (the default) emulates an accelerator's kernels. There is no accelerator here, and the 4 ranks
  share the machine's CPU cores (2 on the development machine): with real CPU compute the ranks steal time
  from each other (an idle rank lends its core to a busy one), so a stage's speed depends on what the other
  ranks are doing and the measured bubbles are distorted. On an accelerator a kernel takes a fixed time
  while the host thread only waits; so here each stage's work is a sleep of fixed duration that leaves the
  CPU free: per micro-batch the forward sleeps t_f, and the backward sleeps t_f on the input-gradient path
  and t_f on the weight-gradient path (backward = 2x forward, the usual ratio). The two backward sleeps are
  separate autograd nodes, so the zero-bubble schedules, which compute the input gradient (torch's
  `stage_backward_input`) apart from the weight gradient (`stage_backward_weight`), split the work as they
  would on a device. Real tensors still flow: each layer multiplies its rows x width activation by a weight
  vector (cheap on the CPU), autograd saves that activation for the weight gradient (so activation memory
  is measured from saved tensors), and activations and their gradients are really sent between ranks. The
  printed median event durations check where the sleeps land (forward, backward or its input-gradient
  half, weight gradient). Every stage does the same work, stage 0 included (a device would skip its first
  layer's input gradient, as its input needs none), so that the stages are equal as the theory assumes.
- `matmul` runs real Linear+Tanh layers on the CPU; its bubbles are distorted as described above.

Other processes on the machine can still stall a rank (the 4 ranks only wait, but each wake-up needs a
core), and the whole pipeline then waits for it; so each schedule records several steps and reports its
fastest (shortest from first to last event on any rank), as timing tools take the best of several runs.
The load average is printed: on a busy machine all bubbles grow.

The bubble is reported two ways. "step bubble": each rank's idle share of the whole step (from the first
event on any rank to the last on any rank), the quantity (p-1)/(m+p-1) describes: with equal stages every
rank idles (p-1) forward+backward slots of the m+p-1 of a step. loom's `bubble_fraction` measures each rank
over its own first-to-last event instead, which leaves out the end of the step where the later ranks have
finished (rank r idles its last r backward slots while the gradients travel to rank 0), so it is below the
theory on every rank but the first even in a perfect pipeline; it is printed beside for reference.

    python benchmarks/pipeline.py [--compute sleep|matmul] [--forward-ms 48] [--steps 5]
        [--microbatches 8] [--width 512] [--rows 256] [--layers 4]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

import loom
from loom.parallel.pipeline import (
    Pipeline,
    Recorder,
    bubble_fraction,
    plot_timeline,
    stage_indices,
    step_bubbles,
    theoretical_bubble,
)
from loom.parallel.pipeline.timeline import Event

PP = 4
RUNS = (("1f1b", 1), ("zero_bubble", 1), ("zbv", 2), ("gpipe", 1))
WITHIN = 0.15  # (a): the 1F1B step bubble within 15% (relative) of the theory


class _Sleep(torch.autograd.Function):
    """Identity whose forward sleeps `forward_s` and whose backward sleeps `backward_s`: a kernel of fixed
    duration during which the host thread waits and the CPU is free, as with an accelerator."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, forward_s: float, backward_s: float, copy: bool) -> torch.Tensor:
        if forward_s > 0:
            time.sleep(forward_s)
        ctx.backward_s = backward_s
        # an activation is copied, not viewed: a stage's output must not be a view, as torch's
        # stage_backward_input detaches the outputs in place; a weight is viewed (never a stage output, and
        # a view of a parameter is not counted as an activation)
        return x.clone() if copy else x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        if ctx.backward_s > 0:
            time.sleep(ctx.backward_s)
        return grad, None, None, None


class SleepLayer(nn.Module):
    """y = x * w with fixed-duration work: the forward sleeps `forward_s`; the backward sleeps `input_grad_s`
    on the path to x and `weight_grad_s` on the path to w.

    The input-gradient sleep sits on the output side of the product (a node every gradient crosses, so
    that it runs on stage 0 too, where x needs no gradient); the weight-gradient sleep sits between w and
    the product, on the path to w only. torch's zero-bubble split (`stage_backward_input`) takes the
    product's node as the boundary of the weight-gradient work, so the weight sleep runs in its weight pass.
    """

    def __init__(self, width: int, forward_s: float, input_grad_s: float, weight_grad_s: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(1.0 + 0.01 * torch.randn(width))
        self.forward_s, self.input_grad_s, self.weight_grad_s = forward_s, input_grad_s, weight_grad_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = _Sleep.apply(self.weight, 0.0, self.weight_grad_s, False)
        return _Sleep.apply(x * w, self.forward_s, self.input_grad_s, True)


def _stage(args: argparse.Namespace, layers: int, seed: int) -> nn.Module:
    """One stage of `layers` layers (in sleep mode: of this stage's share of the rank's durations)."""
    torch.manual_seed(seed)
    if args.compute == "matmul":
        width = args.width
        return nn.Sequential(*(m for _ in range(layers) for m in (nn.Linear(width, width), nn.Tanh())))
    # this stage's share of the rank's time (a rank holds `args.layers` layers whatever its stages), all in
    # its first layer: one sleep per piece of work, because every wake-up waits for a free core, which on a
    # loaded machine stretches the work by more than the sleep's own error
    t = args.forward_ms / 1e3 * layers / args.layers
    timed = [SleepLayer(args.width, t, t, t)]
    return nn.Sequential(*timed, *(SleepLayer(args.width, 0.0, 0.0, 0.0) for _ in range(layers - 1)))


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out - target) ** 2).mean()


def run_schedule(name: str, virtual: int, args: argparse.Namespace) -> dict:
    """One warm-up step, then `args.steps` recorded steps: this rank's events of each step and peak
    activation bytes per stage (of the last step; they are the same every step)."""
    rank = dist.get_rank()
    layers = args.layers // virtual  # the same model whatever the number of stages
    indices = stage_indices(name, rank, PP, virtual)
    modules = [_stage(args, layers, seed=k) for k in indices]
    recorder = Recorder(rank=rank)
    pipe = Pipeline(modules, schedule=name, microbatches=args.microbatches, loss_fn=_loss, recorder=recorder)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(args.microbatches * args.rows, args.width, generator=generator)
    y = torch.randn(args.microbatches * args.rows, args.width, generator=generator)
    steps = []
    for _ in range(1 + args.steps):
        recorder.clear()
        pipe.reset_peaks()
        dist.barrier()
        pipe.step(x, y)
        for m in modules:
            m.zero_grad(set_to_none=True)
        steps.append(list(recorder.events))
    peaks = dict(zip(indices, pipe.peak_activation_bytes(), strict=True))
    return {"steps": steps[1:], "peaks": peaks}


def worker(args: argparse.Namespace) -> dict:
    torch.set_num_threads(1)  # 4 ranks on few cores: one thread each
    loom.init()
    return {name: run_schedule(name, virtual, args) for name, virtual in RUNS}


def _events(results: list[dict], name: str) -> list[list[Event]]:
    """Each rank's events of the schedule's fastest recorded step (the shortest from first to last event on
    any rank): best of several, as timing tools do, because other processes on the machine can stall a rank
    for a while, and every rank of a pipeline then waits for it."""
    steps = [[r[name]["steps"][k] for r in results] for k in range(len(results[0][name]["steps"]))]
    return min(steps, key=_span)


def _span(per_rank: list[list[Event]]) -> float:
    return max(e.end for events in per_rank for e in events) - min(
        e.start for events in per_rank for e in events
    )


def _median_ms(per_rank: list[list[Event]], kind: str, stage: int | None = None) -> str:
    """Median duration of the events of `kind` (on `stage`, when given), in ms; "-" when there are none."""
    durations = [
        e.end - e.start
        for events in per_rank
        for e in events
        if e.kind == kind and (stage is None or e.stage == stage)
    ]
    return f"{statistics.median(durations) * 1e3:5.1f}" if durations else "    -"


def _report(results: list[dict], args: argparse.Namespace) -> float:
    """Print the comparison; return the 1F1B mean step bubble."""
    m = args.microbatches
    if args.compute == "sleep":
        t = args.forward_ms
        mode = (
            f"compute=sleep (emulated accelerator, CPU left free: per rank and micro-batch forward {t:g} ms, "
            f"backward {t:g} ms input-grad + {t:g} ms weight-grad; {args.layers} layers per rank)"
        )
    else:
        mode = f"compute=matmul (real CPU work, {args.layers} Linear+Tanh layers per rank; 4 ranks contend)"
    print(mode)
    print(
        f"p={PP} ranks, m={m} micro-batches of {args.rows}x{args.width} fp32, cores={os.cpu_count()}, "
        f"load average {os.getloadavg()[0]:.1f}; each schedule: fastest of {args.steps} recorded steps"
    )

    if args.compute == "sleep":
        # where the sleeps land: each stage of a rank holds 1/virtual of its layers
        print("event durations, median ms (expected: forward t, backward 2t, or t when split, weight t):")
        for name, virtual in RUNS:
            per_rank = _events(results, name)
            expect = args.forward_ms / virtual
            cells = "  ".join(
                f"{kind} {_median_ms(per_rank, kind)}" for kind in ("forward", "backward", "weight")
            )
            note = ""
            if name in ("zero_bubble", "zbv"):
                # torch runs stage 0's whole backward in its weight pass (its input needs no gradient)
                note = (
                    f"  stage 0: backward {_median_ms(per_rank, 'backward', 0).strip()}, "
                    f"weight {_median_ms(per_rank, 'weight', 0).strip()}"
                )
            print(f"  {name:<12} t={expect:4.1f}  {cells}{note}")

    print(
        f"{'schedule':<12} {'step bubble per rank':<28} {'mean':>6}  {'theory':>6}  loom bubble_fraction per rank"
    )
    means: dict[str, float] = {}
    for name, virtual in RUNS:
        per_rank = _events(results, name)
        step = step_bubbles(per_rank)
        means[name] = statistics.mean(step)
        theory = f"{theoretical_bubble(PP, m, virtual):.3f}" if name in ("1f1b", "gpipe") else "-"
        own = " ".join(f"{bubble_fraction(e):.3f}" for e in per_rank)
        print(f"{name:<12} {' '.join(f'{b:.3f}' for b in step):<28} {means[name]:>6.3f}  {theory:>6}  {own}")

    theory = theoretical_bubble(PP, m)
    measured = means["1f1b"] / theory
    zero = means["zero_bubble"] / means["1f1b"]
    memory = [r["1f1b"]["peaks"][rank] / r["gpipe"]["peaks"][rank] for rank, r in enumerate(results)]
    print(
        f"ratios: 1f1b measured / theory {measured:.3f} ({'within' if abs(measured - 1) <= WITHIN else 'NOT within'}"
        f" {WITHIN:.0%}) | zero_bubble / 1f1b {zero:.3f}, zbv / 1f1b {means['zbv'] / means['1f1b']:.3f} | "
        f"1f1b memory / gpipe memory per stage {' '.join(f'{x:.2f}' for x in memory)}"
    )
    print("peak saved activations per stage (KiB): stage  1f1b  gpipe  1f1b/gpipe")
    for rank, r in enumerate(results):
        a, b = r["1f1b"]["peaks"][rank], r["gpipe"]["peaks"][rank]
        print(
            f"  {rank}  {a / 1024:8.0f}  {b / 1024:8.0f}  {a / b:5.2f}  (in flight: 1f1b {PP - rank}, gpipe {m})"
        )
    print("  (stage 0 also counts its whole input batch once: its micro-batches are views of one tensor)")
    return means["1f1b"]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--compute", choices=("sleep", "matmul"), default="sleep")
    parser.add_argument(
        "--forward-ms",
        type=float,
        default=48.0,
        help="sleep mode: forward milliseconds per rank per micro-batch",
    )
    parser.add_argument(
        "--steps", type=int, default=5, help="recorded steps per schedule (the fastest is used)"
    )
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4, help="layers per rank (even, for zbv)")
    parser.add_argument(
        "--png", default=os.path.join(os.path.dirname(__file__), "..", "docs", "pipeline_1f1b.png")
    )
    args = parser.parse_args()
    results = loom.launch(worker, PP, args, timeout=600)
    bubble = _report(results, args)
    events = [e for rank_events in _events(results, "1f1b") for e in rank_events]
    where = (
        "emulated accelerator (sleeps)"
        if args.compute == "sleep"
        else f"matmuls, 4 ranks on {os.cpu_count()} cores"
    )
    title = (
        f"1F1B, p={PP}, m={args.microbatches}: step bubble {bubble:.3f} "
        f"(theory {theoretical_bubble(PP, args.microbatches):.3f}), {where}"
    )
    plot_timeline(events, os.path.normpath(args.png), title)
    print(f"timeline: {os.path.normpath(args.png)}")


if __name__ == "__main__":
    main()
