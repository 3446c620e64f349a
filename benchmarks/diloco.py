"""Training over slow links: synchronous data parallelism against DiLoCo and local SGD, and federated
averaging on IID against non-IID clients, side by side in one run (2 CPU ranks, gloo).

1. loom's GPT (d_model 128, 2 layers) on the arithmetic corpus, the same data, seed and token budget for
   every method: synchronous data parallelism (AdamW, gradients all-reduced every step), DiLoCo with
   H = 10 and 50 inner AdamW steps per outer Nesterov step (lr 0.7, momentum 0.9), and local SGD with
   H = 10 (AdamW inside, parameters averaged). Prints the held-out loss of the global weights every 50
   steps, the bytes each rank all-reduced (recorded, not computed) and the reduction against synchronous.
2. Federated averaging of an MLP on a 10-class Gaussian mixture: 50 clients, 10 sampled per round, 2 local
   epochs, IID clients against Dirichlet(0.1) clients; held-out accuracy per round.

    .venv/bin/python benchmarks/diloco.py [--steps 200] [--rounds 30]
"""

from __future__ import annotations

import argparse
import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table
from torch import nn

import loom
from loom.dist.context import unsharded
from loom.models.gpt import GPT, GPTConfig
from loom.parallel.local_sgd import DiLoCo, LocalSGD
from loom.train.data import ArithmeticCorpus
from loom.train.federated import dirichlet_split, fedavg, iid_split

SEQ, PER_RANK, LR, EVAL_EVERY = 32, 16, 3e-3, 50


class AllReduceBytes:
    """Counts the bytes of every dist.all_reduce while installed (what each rank sends and receives)."""

    def __init__(self) -> None:
        self.total, self._original = 0, dist.all_reduce

    def __enter__(self) -> AllReduceBytes:
        def record(tensor, *args, **kwargs):
            self.total += tensor.numel() * tensor.element_size()
            return self._original(tensor, *args, **kwargs)

        dist.all_reduce = record
        return self

    def __exit__(self, *exc: object) -> None:
        dist.all_reduce = self._original


def _batch(corpus: ArithmeticCorpus, step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank `rank`'s rows of the global batch of `step` (the same global data for every method)."""
    start = (step * 2 + rank) * PER_RANK
    rows = [corpus[i] for i in range(start, start + PER_RANK)]
    return torch.stack([x for x, _ in rows]), torch.stack([y for _, y in rows])


def _held_out(model: nn.Module, corpus: ArithmeticCorpus) -> float:
    with torch.no_grad():
        x, y = zip(*(corpus[i] for i in range(64)), strict=True)
        return F.cross_entropy(model(torch.stack(x)).flatten(0, 1), torch.stack(y).flatten()).item()


def train_gpt(method: str, sync_every: int, steps: int) -> dict:
    """One method's run on this rank; the held-out loss of the global weights every EVAL_EVERY steps."""
    loom.init({"dp": 2})
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=256, d_model=128, n_layers=2, n_heads=4, max_seq_len=SEQ)
    corpus, held_out = ArithmeticCorpus(SEQ, seed=0), ArithmeticCorpus(SEQ, seed=10_000)
    plain = GPT(config)
    if method == "sync":
        model = loom.parallelize(copy.deepcopy(plain), mode="data_parallel")
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    else:
        model = plain
        inner = torch.optim.AdamW(model.parameters(), lr=LR)
        wrapper = DiLoCo if method == "diloco" else LocalSGD
        optimizer = wrapper(model.parameters(), inner, sync_every=sync_every)
    losses = []
    # each rank computes its replica alone: loom's GPT runs unsharded; only gradients or weights travel
    with unsharded(), AllReduceBytes() as sent:
        for step in range(steps):
            x, y = _batch(corpus, step, loom.rank())
            logits = model(x)
            F.cross_entropy(logits.flatten(0, 1), y.flatten()).backward()
            optimizer.step()
            optimizer.zero_grad()
            if (
                step + 1
            ) % EVAL_EVERY == 0:  # every H divides EVAL_EVERY: the replicas hold the global weights
                losses.append(_held_out(model, held_out))
    return {"losses": losses, "bytes": sent.total, "params": sum(p.numel() for p in plain.parameters())}


def gaussian_mixture(count: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`count` points of a 10-class mixture in 20 dims (fixed centres, unit noise)."""
    centres = torch.randn(10, 20, generator=torch.Generator().manual_seed(123)) * 1.5
    generator = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 10, (count,), generator=generator)
    return centres[labels] + torch.randn(count, 20, generator=generator), labels


def run_fedavg(split: str, rounds: int) -> list[float]:
    """Accuracy per round of federated averaging over 50 clients of `split` ("iid" or "dirichlet")."""
    loom.init({"dp": 2})
    x, y = gaussian_mixture(2000, seed=0)
    test_x, test_y = gaussian_mixture(1000, seed=1)
    parts = iid_split(len(y), 50) if split == "iid" else dirichlet_split(y.tolist(), 50, alpha=0.1)
    clients = [(x[p], y[p]) for p in parts]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 10))

    def accuracy(_report, net) -> dict:
        with torch.no_grad():
            return {"accuracy": (net(test_x).argmax(1) == test_y).float().mean().item()}

    reports = fedavg(
        model, clients, rounds=rounds, per_round=10, local_epochs=2, batch_size=10,
        make_optimizer=lambda p: torch.optim.SGD(p, lr=0.05), loss_fn=F.cross_entropy, seed=0,
        on_round=accuracy,
    )  # fmt: skip
    return [r.extra["accuracy"] for r in reports]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=200, help="steps per method (a multiple of 50)")
    parser.add_argument("--rounds", type=int, default=30, help="federated rounds")
    args = parser.parse_args()
    console = Console(width=140)  # the tables are wide; a pipe would get 80 columns
    methods = [("sync", 1), ("diloco", 10), ("diloco", 50), ("local_sgd", 10)]
    results = {f"{m} H={h}" if m != "sync" else "synchronous": loom.launch(train_gpt, 2, m, h, args.steps)[0]
               for m, h in methods}  # fmt: skip
    params = next(iter(results.values()))["params"]
    table = Table(
        title=f"GPT ({params:,} parameters), arithmetic, 2 ranks x {PER_RANK} x {SEQ} tokens per step"
    )
    table.add_column("method")
    for k in range(args.steps // EVAL_EVERY):
        table.add_column(f"loss @{(k + 1) * EVAL_EVERY}", justify="right")
    table.add_column("MB all-reduced", justify="right")
    table.add_column("less than sync", justify="right")
    sync_bytes = results["synchronous"]["bytes"]
    for name, result in results.items():
        reduction = sync_bytes / result["bytes"] if result["bytes"] else float("inf")
        table.add_row(name, *(f"{loss:.3f}" for loss in result["losses"]), f"{result['bytes'] / 1e6:.1f}",
                      f"{reduction:.1f}x")  # fmt: skip
    console.print(table)
    accuracy = {split: loom.launch(run_fedavg, 2, split, args.rounds)[0] for split in ("iid", "dirichlet")}
    table = Table(title="federated averaging: 50 clients, 10 per round, 2 local epochs (held-out accuracy)")
    table.add_column("round", justify="right")
    table.add_column("IID", justify="right")
    table.add_column("Dirichlet(0.1)", justify="right")
    for r in range(args.rounds):
        if r < 5 or (r + 1) % 5 == 0:
            table.add_row(str(r + 1), f"{accuracy['iid'][r]:.3f}", f"{accuracy['dirichlet'][r]:.3f}")
    console.print(table)


if __name__ == "__main__":
    main()
