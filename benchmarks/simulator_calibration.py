"""The simulator calibrated on this machine against a measured training step, side by side.

A small data-parallel transformer (plain torch, `loom.parallelize(mode="data_parallel")`) trains on 2 CPU ranks
(gloo); between two halves of its measured steps each rank runs `loom bench`'s calibration (matmul FLOP/s,
memory bandwidth, collectives). The simulator, given that profile, predicts the step; the script prints
predicted, measured and their ratio (target: within 25%). Calibration and training share the worker group,
so they see the same threads and machine load; a loaded machine still moves both.

    .venv/bin/python benchmarks/simulator_calibration.py [--steps 6] [--warmup 2]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

import loom
from loom.cost.calibrate import build_profile, measure_rank
from loom.cost.layer import gemm_shapes
from loom.cost.plan import ParallelPlan
from loom.cost.transformer import TransformerConfig
from loom.sim.simulator import simulate

SHAPE = {"layers": 2, "hidden": 256, "heads": 4, "vocab": 1024}
SEQ, LOCAL_BATCH = 128, 8
# TinyGPT as the cost model sees it, and its plan: 2 data-parallel ranks
MODEL = TransformerConfig(**SHAPE, learned_positions=SEQ, dropout=False)
PLAN = ParallelPlan(dp=2, micro_batch=LOCAL_BATCH, global_batch=2 * LOCAL_BATCH, seq=SEQ, dtype="fp32")


class TinyGPT(nn.Module):
    """A GPT written with plain torch: learned positions, pre-norm blocks, full (s x s) attention, tied head."""

    def __init__(self, layers: int, hidden: int, heads: int, vocab: int, seq: int) -> None:
        super().__init__()
        self.heads = heads
        self.tokens, self.positions = nn.Embedding(vocab, hidden), nn.Embedding(seq, hidden)
        self.blocks = nn.ModuleList(
            nn.ModuleDict(
                {
                    "ln1": nn.LayerNorm(hidden),
                    "qkv": nn.Linear(hidden, 3 * hidden),
                    "proj": nn.Linear(hidden, hidden),
                    "ln2": nn.LayerNorm(hidden),
                    "up": nn.Linear(hidden, 4 * hidden),
                    "down": nn.Linear(4 * hidden, hidden),
                }  # fmt: skip
            )
            for _ in range(layers)
        )
        self.norm = nn.LayerNorm(hidden)

    def _attention(self, block: nn.ModuleDict, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = block["qkv"](x).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        probs = torch.softmax(q @ k.transpose(-1, -2) / (h // self.heads) ** 0.5, dim=-1)
        return block["proj"]((probs @ v).transpose(1, 2).reshape(b, s, h))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tokens(ids) + self.positions(torch.arange(ids.shape[1]))
        for block in self.blocks:
            x = x + self._attention(block, block["ln1"](x))
            x = x + block["down"](F.gelu(block["up"](block["ln2"](x))))
        return F.linear(self.norm(x), self.tokens.weight)


def train_and_calibrate(steps: int, warmup: int) -> dict:
    """On each rank: the median step time of TinyGPT trained data-parallel, and `loom bench`'s calibration
    measured between two halves of the steps, so both see the same load on the machine."""
    loom.init()
    torch.manual_seed(0)
    model = loom.parallelize(TinyGPT(**SHAPE, seq=SEQ), mode="data_parallel")
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    ids = torch.randint(
        0, SHAPE["vocab"], (LOCAL_BATCH, SEQ + 1), generator=torch.Generator().manual_seed(loom.rank())
    )

    def train_steps(count: int) -> list[float]:
        times = []
        for _ in range(count):
            torch.distributed.barrier()
            start = time.perf_counter()
            logits = model(ids[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, SHAPE["vocab"]), ids[:, 1:].reshape(-1))
            optimizer.zero_grad(set_to_none=False)
            loss.backward()
            optimizer.step()
            times.append(time.perf_counter() - start)
        return times

    train_steps(warmup)
    # Calibrate between two halves of the measured steps, so both see the same load on the machine.
    times = train_steps(steps // 2)
    # matmul speed measured at the GEMM shapes the simulator prices for this model, elementwise kernels at
    # the size of its largest activations (tokens x MLP width), all-reduces up to its whole gradient
    # (gloo's bandwidth falls beyond the caches: a link fitted below that size prices it too fast)
    collective_sizes = (2**12, 2**16, 2**20, 4 * MODEL.parameter_count())
    calibration = measure_rank(
        gemm_shapes(MODEL, PLAN), collective_sizes, repeats=5,
        activation_elements=LOCAL_BATCH * SEQ * MODEL.ffn,
    )  # fmt: skip
    times += train_steps(steps - steps // 2)
    return {"step_s": statistics.median(times), "calibration": calibration}


def predict(ranks: list[dict]) -> float:
    """The simulator's step time for TinyGPT's plan on the profile the ranks measured."""
    cluster = build_profile([r["calibration"] for r in ranks], nprocs=2).cluster
    return simulate(MODEL, PLAN, cluster).iteration_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()
    ranks = loom.launch(train_and_calibrate, 2, args.steps, args.warmup)
    predicted, measured = predict(ranks), max(r["step_s"] for r in ranks)
    ratio = predicted / measured
    verdict = "within 25%" if abs(ratio - 1) <= 0.25 else "OUTSIDE 25%"
    print(
        f"step time: predicted {predicted:.4f} s, measured {measured:.4f} s, predicted / measured {ratio:.3f} ({verdict})"
    )


if __name__ == "__main__":
    main()
