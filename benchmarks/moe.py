"""The mixture-of-experts layer's experts: one grouped matmul against the per-expert loop, side by side.

    .venv/bin/python benchmarks/moe.py                  # 8 experts, hidden 256, ffn 512, 2048 tokens, top-2
    .venv/bin/python benchmarks/moe.py --tokens 512     # smaller

Forward and backward of `loom.models.moe.MoE` (SwiGLU, dropless) with `grouped_mm=True` and `False`, the
same weights and tokens, alternating repetitions so that both sides see the same load of a shared machine;
prints the median milliseconds of each and their ratio. One thread by default (`--threads`).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from loom.models.moe import MoE, MoEConfig


def step_ms(moe: MoE, x: torch.Tensor) -> float:
    """Milliseconds of one forward and backward."""
    moe.zero_grad()
    start = time.perf_counter()
    (moe(x).sum() + moe.aux_loss).backward()
    return 1000 * (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--ffn-hidden", type=int, default=512)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    layers = {}
    for grouped in (True, False):
        torch.manual_seed(0)
        config = MoEConfig(hidden=args.hidden, ffn_hidden=args.ffn_hidden, experts=args.experts,
                           top_k=args.top_k, grouped_mm=grouped)  # fmt: skip
        layers["grouped matmul" if grouped else "per-expert loop"] = MoE(config)
    x = torch.randn(args.tokens, args.hidden, generator=torch.Generator().manual_seed(1))
    times: dict[str, list[float]] = {name: [] for name in layers}
    for repeat in range(args.repeats + 1):  # the first round warms up, untimed
        for name, moe in layers.items():
            elapsed = step_ms(moe, x)
            if repeat:
                times[name].append(elapsed)
    medians = {name: statistics.median(values) for name, values in times.items()}
    for name, median in medians.items():
        print(f"{name:>16}: {median:8.1f} ms forward+backward (median of {args.repeats})")
    print(f"loop / grouped: {medians['per-expert loop'] / medians['grouped matmul']:.2f}x")


if __name__ == "__main__":
    main()
