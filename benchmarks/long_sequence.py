"""Long-sequence attention over a cp group: memory, communication and load balance per rank.

One causal attention layer (forward and backward, fp32, on CPU ranks over gloo) at several sequence lengths
and cp in {1, 2, 4}, three ways: Ulysses on the contiguous cut, ring attention on the contiguous cut, and
ring attention on the head-tail cut (rank r holds chunks r and 2 cp - 1 - r of 2 cp), each rank holding
seq / cp positions (`loom.parallel.context.shard_sequence`). cp = 1 is the one-device baseline: Ulysses is
then plain `F.scaled_dot_product_attention`, ring attention its blockwise fp32 computation.

Printed per case:
- peak MB: the largest over the ranks of the rise of the process's peak resident memory (Linux VmHWM, reset
  before each call through /proc/self/clear_refs) above its resident memory before the call, so the
  inputs and whatever the allocator caches count in the baseline, not in the peak (0 when the call fits in
  memory the allocator already held);
- comm KB: bytes the rank sent per call (forward and backward) as `CollectiveRecorder` counts them, the
  same from `loom.cost.context`'s formulas, and what the simulator prices per layer for a one-layer model of
  these heads (`loom.sim.simulate`'s `cp_bytes_per_layer`; the layout, contiguous or head-tail, moves the
  same bytes). All three should agree exactly; sends and receives are counted as one exchange's send bytes;
- ms min / max: the median time of one forward and backward per rank, the fastest and the slowest rank.
  The exchanges keep the ranks in step, so a rank with less to do waits for its neighbours and the times
  come out alike; the imbalance shows in the time itself, and in
- work max/min: the attention scores each rank computes (the causal mask hides some chunk pairs, which
  ring attention skips), largest over smallest: under a causal mask the contiguous cut leaves rank 0 little
  to do and the last rank most, the head-tail cut gives every rank the same. Ulysses computes whole heads
  on every rank: always 1.
The cases take turns within each repeat, so that they see the same load. With more ranks than cores the
times include waiting for a core: compare cases, not absolute times. loom.launch gives each rank its share
of the cores as threads (cp = 1 gets them all); `OMP_NUM_THREADS=1` gives every rank one thread.

    OMP_NUM_THREADS=1 python benchmarks/long_sequence.py --seqs 1024 2048 4096
"""

from __future__ import annotations

import argparse
import re
import statistics
import time

import torch
import torch.distributed as dist

import loom
from loom.cost.context import ring_collectives, ulysses_collectives
from loom.cost.hardware import get_cluster
from loom.cost.plan import ParallelPlan
from loom.cost.transformer import TransformerConfig
from loom.dist.comm import CollectiveRecorder
from loom.parallel.context import causal_work, shard_sequence, ulysses_attention
from loom.parallel.ring import ring_attention
from loom.sim import simulate

CASES = (
    ("ulysses", "contiguous", ulysses_attention, ulysses_collectives),
    ("ring", "contiguous", ring_attention, ring_collectives),
    ("ring", "head_tail", ring_attention, ring_collectives),
)


def _memory_kb(field: str) -> int:
    with open("/proc/self/status") as status:
        return int(re.search(rf"{field}:\s+(\d+)", status.read()).group(1))


def _reset_peak() -> None:
    """Set the process's peak resident memory (VmHWM) to its current resident memory."""
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")


def _sent_bytes(calls) -> int:  # noqa: ANN001
    """Bytes this rank put on the wire: all-to-all send buffers and sends (receives are the peers' sends)."""
    return sum(c.nbytes for c in calls if c.kind in ("all_to_all", "send"))


def _formula_sent(collectives) -> int:  # noqa: ANN001
    return sum(c.nbytes * c.count for c in collectives if c.kind in ("all_to_all", "send"))


def _one_call(attention, q, k, v, group, layout: str) -> None:  # noqa: ANN001
    out = attention(q, k, v, group=group, causal=True, layout=layout)
    out.backward(torch.ones_like(out))


def _timed_call(case: dict, group) -> None:  # noqa: ANN001
    """One forward and backward of `case`, its time and peak memory rise appended to the case."""
    q, k, v = case["inputs"]
    q.grad = k.grad = v.grad = None
    dist.barrier(group)
    _reset_peak()
    before = _memory_kb("VmRSS")
    start = time.perf_counter()
    _one_call(case["attention"], q, k, v, group, case["layout"])
    case["times"].append(time.perf_counter() - start)
    case["peaks"].append((_memory_kb("VmHWM") - before) * 1024)


def measure(
    seqs: list[int], batch: int, heads: int, kv_heads: int, head_dim: int, repeats: int
) -> list[dict]:
    """Every case of `CASES` at every length in `seqs` on this rank (see the module's docstring)."""
    cp = dist.get_world_size()
    mesh = loom.init({"cp": cp})
    group = mesh.axis_group("cp")
    sizes = {"batch": batch, "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim, "cp": cp}
    rows = []
    for seq in seqs:
        generator = torch.Generator().manual_seed(seq)
        full = [
            torch.randn(batch, h, seq, head_dim, generator=generator) for h in (heads, kv_heads, kv_heads)
        ]
        cases = []
        for name, layout, attention, formula in CASES:
            inputs = [shard_sequence(t, 2, group, layout=layout).requires_grad_() for t in full]
            with CollectiveRecorder() as recorder:  # also the warm-up call
                _one_call(attention, *inputs, group, layout)
            cases.append({
                "seq": seq, "name": name, "layout": layout, "attention": attention, "inputs": inputs,
                "times": [], "peaks": [], "sent": _sent_bytes(recorder.calls),
                "formula": _formula_sent(formula(seq=seq, dtype_bytes=4, **sizes)),
            })  # fmt: skip
        for _ in range(repeats):  # the cases take turns, so that they see the same load on the machine
            for case in cases:
                _timed_call(case, group)
        keep = ("seq", "name", "layout", "sent", "formula")
        rows += [
            {key: case[key] for key in keep}
            | {"time": statistics.median(case["times"]), "peak": max(case["peaks"])}
            for case in cases
        ]
    return rows


def simulated_sent(name: str, seq: int, cp: int, batch: int, heads: int, kv_heads: int, head_dim: int) -> int:
    """Bytes per layer a rank sends over cp as the simulator prices a one-layer model of these heads (fp32)."""
    model = TransformerConfig(name="attention", layers=1, hidden=heads * head_dim, heads=heads, kv_heads=kv_heads,
                              vocab=256, dropout=False)  # fmt: skip
    plan = ParallelPlan(cp=cp, attention=name, micro_batch=batch, global_batch=batch, seq=seq, dtype="fp32")
    return simulate(model, plan, get_cluster("h100-sxm", gpus=cp)).cp_bytes_per_layer


def work_imbalance(name: str, layout: str, cp: int) -> float:
    """Largest over smallest, among the ranks, of the causal scores each computes (`causal_work`)."""
    if name == "ulysses":
        return 1.0
    work = [causal_work(rank, cp, layout) for rank in range(cp)]
    return max(work) / min(work)


def report(cp: int, results: list[list[dict]], shape: dict) -> None:
    """One line per case: peak memory, traffic measured, by the formulas and simulated, per-rank time spread."""
    for index, row in enumerate(results[0]):
        per_rank = [rank_rows[index] for rank_rows in results]
        times = [r["time"] for r in per_rank]
        sent = max(r["sent"] for r in per_rank)
        simulated = simulated_sent(row["name"], row["seq"], cp, **shape)
        print(
            f"{row['seq']:>6} {cp:>3} {row['name']:>8} {row['layout']:>10} "
            f"{max(r['peak'] for r in per_rank) / 2**20:>8.1f} {sent / 1024:>9.1f} {row['formula'] / 1024:>9.1f} "
            f"{simulated / 1024:>9.1f} {min(times) * 1e3:>8.1f} {max(times) * 1e3:>8.1f} "
            f"{work_imbalance(row['name'], row['layout'], cp):>9.2f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seqs", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(
        f"causal attention, batch {args.batch}, {args.heads} heads ({args.kv_heads} kv heads), head_dim "
        f"{args.head_dim}, fp32, forward + backward; per rank: peak memory rise, bytes sent per call, median time"
    )
    print(f"{'seq':>6} {'cp':>3} {'attn':>8} {'layout':>10} {'peak MB':>8} {'sent KB':>9} {'formula':>9} "
          f"{'simulated':>9} {'ms min':>8} {'ms max':>8} {'work max/min':>9}")  # fmt: skip
    shape = {"batch": args.batch, "heads": args.heads, "kv_heads": args.kv_heads, "head_dim": args.head_dim}
    for cp in args.cp:
        results = loom.launch(measure, cp, args.seqs, args.batch, args.heads, args.kv_heads, args.head_dim,
                              args.repeats)  # fmt: skip
        report(cp, results, shape)


if __name__ == "__main__":
    main()
