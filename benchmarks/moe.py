"""Mixtures of experts: the experts' grouped matmul against the per-expert loop, and expert-parallel
training steps measured against the simulator's prediction.

    .venv/bin/python benchmarks/moe.py                  # 8 experts, hidden 256, ffn 512, 2048 tokens, top-2
    .venv/bin/python benchmarks/moe.py --tokens 512     # smaller
    .venv/bin/python benchmarks/moe.py --train          # loom's MoE GPT, 2 gloo ranks at ep 2, 4 experts top-2
    .venv/bin/python benchmarks/moe.py --train --ranks 4 --ep 2 --capacity-factor 1.0 --calibrate
    .venv/bin/python benchmarks/moe.py --train --hardware this-machine.json   # a `loom bench --out` profile

Default mode: forward and backward of `loom.models.moe.MoE` (SwiGLU, dropless) with `grouped_mm=True` and
`False`, the same weights and tokens, alternating repetitions so that both sides see the same load of a
shared machine; prints the median milliseconds of each and their ratio. One thread by default (`--threads`).

`--train`: a small MoE GPT (`GPTConfig(experts=..., top_k=..., capacity_factor=...)`) laid out with
`Strategies(dp=ranks, ep=ep)` trains `--steps` Trainer steps (AdamW) on `--ranks` gloo ranks after
`--warmup` untimed ones. Per step it prints tokens/s (the global batch over the slowest rank's step), the
all-to-all bytes one rank sends (recorded by `loom.dist.comm.CollectiveRecorder`, forward and backward),
the seconds spent in them (each timed to its completion, the wait for slower peers included) and their
share of the step, the max/mean tokens per expert (token-expert pairs routed to each expert, before
capacity, summed over ranks; the worst layer) and the fraction of pairs dropped for capacity. Beside the
measures, the simulator's prediction of the same run: the all-to-all bytes `loom.cost.moe.moe_collectives`
gives for the rows each layer moved (must equal the recorded bytes), those `layer_moe_collectives` prices
(balanced routing, no drops: what `loom.sim` assumes) and, with a hardware profile (`--hardware FILE` from
`loom bench --out`, or `--calibrate` to measure one in the workers between two halves of the steps), the
predicted step time and all-to-all time, as measured/predicted ratios.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import loom
from loom.cost.calibrate import build_profile, measure_rank
from loom.cost.hardware import get_cluster
from loom.cost.layer import gemm_shapes
from loom.cost.moe import layer_moe_collectives, moe_collectives
from loom.cost.plan import ParallelPlan
from loom.cost.transformer import TransformerConfig, transformer_config
from loom.dist.comm import CollectiveRecorder
from loom.models.gpt import GPT, GPTConfig, Strategies
from loom.models.moe import MoE, MoEConfig, moe_layers
from loom.parallel import make_optimizer
from loom.sim.simulator import simulate
from loom.train import Trainer

ELEMENT_BYTES = 4  # the run is fp32


def step_ms(moe: MoE, x: torch.Tensor) -> float:
    """Milliseconds of one forward and backward."""
    moe.zero_grad()
    start = time.perf_counter()
    (moe(x).sum() + moe.aux_loss).backward()
    return 1000 * (time.perf_counter() - start)


def compare_experts(args: argparse.Namespace) -> None:
    """The default mode: the grouped matmul against the per-expert loop (see the module's docstring)."""
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


class TimedCollectives(CollectiveRecorder):
    """A `CollectiveRecorder` that also times every all-to-all this rank issues to its completion
    (`all_to_all_s`): each one is waited for at once, so the time includes waiting for slower peers, and
    nothing overlaps it (gloo on CPUs overlaps little anyway)."""

    def __init__(self) -> None:
        super().__init__()
        self.all_to_all_s = 0.0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(t is DTensor or issubclass(t, DTensor) for t in types):
            return NotImplemented
        before, start = len(self.calls), time.perf_counter()
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if len(self.calls) > before and self.calls[-1].kind == "all_to_all":
            _wait(out)
            self.all_to_all_s += time.perf_counter() - start
        return out


def _wait(out) -> None:
    """Wait for a collective's result: a functional collective's tensor, or a process-group call's work."""
    if isinstance(out, torch.Tensor):
        torch.ops._c10d_functional.wait_tensor(out)
    elif hasattr(out, "wait"):
        out.wait()
    elif isinstance(out, (tuple, list)):
        for item in out:
            _wait(item)


def gpt_config(args: argparse.Namespace) -> GPTConfig:
    """The small MoE GPT the `--train` mode trains."""
    return GPTConfig(
        vocab_size=args.vocab, d_model=args.hidden, n_layers=args.layers, n_heads=args.heads,
        max_seq_len=args.seq, mlp="swiglu", experts=args.experts, top_k=args.top_k,
        capacity_factor=args.capacity_factor, z_loss_coef=1e-3,
    )  # fmt: skip


def cost_model(args: argparse.Namespace) -> tuple[TransformerConfig, ParallelPlan]:
    """The trained MoE GPT and its plan as the simulator sees them."""
    plan = ParallelPlan(
        dp=args.ranks, ep=args.ep, micro_batch=args.batch, global_batch=args.ranks * args.batch,
        seq=args.seq, dtype="fp32",
    )  # fmt: skip
    return transformer_config(gpt_config(args)), plan


def train_worker(args: argparse.Namespace) -> dict:
    """On each rank: `args.warmup` untimed and `args.steps` measured Trainer steps of the MoE GPT at
    `Strategies(dp=ranks, ep=ep)`, each recorded and timed (see the module's docstring); with
    `args.calibrate`, `loom bench`'s measurements taken between two halves of the measured steps."""
    torch.set_num_threads(args.threads)
    mesh = loom.init({"dp": args.ranks})
    torch.manual_seed(0)
    config = gpt_config(args)
    model = GPT(config, Strategies(args.ranks, 1, False, args.ep))
    generator = torch.Generator().manual_seed(1 + mesh.dp_rank())  # each rank its own tokens
    total = args.warmup + args.steps
    ids = torch.randint(0, args.vocab, (total, args.batch, args.seq + 1), generator=generator)
    loom.parallelize(model, mode="semi_auto", example_inputs=(ids[0, :, :-1], ids[0, :, 1:]))
    trainer = Trainer(model, make_optimizer(model, torch.optim.AdamW, 0, lr=1e-3))

    def step(index: int) -> dict:
        dist.barrier()
        with TimedCollectives() as recorder:
            start = time.perf_counter()
            trainer.train_step([(ids[index, :, :-1], ids[index, :, 1:])])
            elapsed = time.perf_counter() - start
        layers = list(moe_layers(model))
        exchanges = [m.experts.exchange for m in layers]
        return {
            "step_s": elapsed,
            "all_to_all_s": recorder.all_to_all_s,
            "all_to_all_bytes": sum(c.nbytes for c in recorder.calls if c.kind == "all_to_all"),
            "load": [m.load.tolist() for m in layers],  # pairs per expert before capacity, this rank's
            "dropped": [m.dropped for m in layers],
            "sent": [getattr(x, "sent_rows", 0) for x in exchanges],
            "received": [getattr(x, "received_rows", 0) for x in exchanges],
        }

    for index in range(args.warmup):
        step(index)
    half = args.warmup + args.steps // 2
    steps = [step(index) for index in range(args.warmup, half)]
    # calibrated between two halves of the measured steps, so both see the same load on the machine
    # matmuls at the GEMM shapes the simulator prices for this model, elementwise kernels at the size of
    # its largest activations (token-expert pairs x expert MLP width), collectives down to latency-bound sizes
    calibration = None
    if args.calibrate:
        shape, plan = cost_model(args)
        calibration = measure_rank(
            gemm_shapes(shape, plan), (2**12, 2**16, 2**20, 2**22), repeats=5,
            activation_elements=args.batch * args.seq * shape.top_k * shape.ffn,
        )  # fmt: skip
    steps += [step(index) for index in range(half, total)]
    return {"steps": steps, "calibration": calibration}


def step_row(ranks: list[dict], args: argparse.Namespace) -> dict:
    """One measured step over all ranks: tokens/s from the slowest rank; all-to-all bytes, time and share
    averaged over ranks; expert loads summed over ranks, the worst layer's max/mean; the dropped share of
    every pair; and whether `moe_collectives`, given each layer's rows, predicts each rank's bytes."""
    slowest = max(r["step_s"] for r in ranks)
    balance = []
    for layer in range(args.layers):
        load = torch.tensor([r["load"][layer] for r in ranks]).sum(0).double()
        balance.append(float(load.max() / load.mean()))
    pairs = sum(sum(map(sum, r["load"])) for r in ranks)
    predicted = [predicted_bytes(r, args) for r in ranks]
    return {
        "step_ms": 1000 * slowest,
        "tokens_per_s": args.ranks * args.batch * args.seq / slowest,
        "a2a_kib": statistics.mean(r["all_to_all_bytes"] for r in ranks) / 1024,
        "predicted_kib": statistics.mean(predicted) / 1024,
        "exact": all(p == r["all_to_all_bytes"] for p, r in zip(predicted, ranks, strict=True)),
        "a2a_ms": 1000 * statistics.mean(r["all_to_all_s"] for r in ranks),
        "a2a_share": statistics.mean(r["all_to_all_s"] / r["step_s"] for r in ranks),
        "max_mean": max(balance),
        "dropped": sum(sum(r["dropped"]) for r in ranks) / pairs,
    }


def predicted_bytes(rank: dict, args: argparse.Namespace) -> int:
    """All-to-all bytes `moe_collectives` predicts for one rank's step from the rows each layer moved."""
    return sum(
        c.nbytes * c.count
        for sent, received in zip(rank["sent"], rank["received"], strict=True)
        for c in moe_collectives(
            experts=args.experts,
            hidden=args.hidden,
            sent_rows=sent,
            received_rows=received,
            element_bytes=ELEMENT_BYTES,
            ep=args.ep,
        )  # fmt: skip
    )


def train(args: argparse.Namespace) -> None:
    """The `--train` mode: measure the steps on the ranks, then print them beside the simulator's prediction."""
    if args.ranks % args.ep or args.experts % args.ep:
        raise SystemExit(
            f"--ep {args.ep} must divide --ranks {args.ranks} and --experts {args.experts}; choose another --ep"
        )
    results = loom.launch(train_worker, args.ranks, args)
    rows = [step_row([r["steps"][i] for r in results], args) for i in range(args.steps)]
    print(
        f"loom MoE GPT: {args.layers} layers, d_model {args.hidden}, {args.experts} experts top-{args.top_k}, "
        f"capacity factor {args.capacity_factor}, {args.ranks} gloo ranks at ep {args.ep}, "
        f"{args.batch} x {args.seq} tokens per rank, fp32, {args.threads} thread(s) per rank"
    )
    header = (
        f"{'step':>4} {'ms':>8} {'tokens/s':>9} {'a2a KiB':>9} {'formula':>9} {'a2a ms':>7} "
        f"{'share':>6} {'max/mean':>8} {'dropped':>7}"
    )
    print(
        "(ms and tokens/s: the slowest rank; a2a KiB, ms and share of the step: one rank's, mean over ranks; "
        "formula: loom.cost.moe.moe_collectives for the rows each layer moved; max/mean: pairs per expert "
        "before capacity over all ranks, the worst layer; dropped: share of all pairs)"
    )
    print(header)
    for index, row in enumerate(rows):
        print(
            f"{index:>4} {row['step_ms']:8.1f} {row['tokens_per_s']:9.0f} {row['a2a_kib']:9.1f} "
            f"{row['predicted_kib']:9.1f} {row['a2a_ms']:7.1f} {row['a2a_share']:6.1%} "
            f"{row['max_mean']:8.2f} {row['dropped']:7.1%}"
        )
    median = {key: statistics.median(row[key] for row in rows) for key in rows[0] if key != "exact"}
    print(
        f"median {median['step_ms']:8.1f} {median['tokens_per_s']:9.0f} {median['a2a_kib']:9.1f} "
        f"{median['predicted_kib']:9.1f} {median['a2a_ms']:7.1f} {median['a2a_share']:6.1%} "
        f"{median['max_mean']:8.2f} {median['dropped']:7.1%}"
    )
    exact = all(row["exact"] for row in rows)
    print(f"all-to-all bytes: recorded == moe_collectives(rows moved) on every rank and step: {exact}")
    model, plan = cost_model(args)
    balanced = args.layers * sum(c.nbytes * c.count for c in layer_moe_collectives(model, plan))
    print(
        f"all-to-all bytes per rank and step: measured {median['a2a_kib']:.1f} KiB, simulator (balanced, no "
        f"drops) {balanced / 1024:.1f} KiB, measured / predicted {ratio(1024 * median['a2a_kib'], balanced)}"
    )
    cluster = None
    if args.calibrate:
        cluster = build_profile([r["calibration"] for r in results], nprocs=args.ranks).cluster
    elif args.hardware:
        cluster = get_cluster(args.hardware, gpus=args.ranks, gpus_per_node=args.ranks)
    if cluster is None:
        print("step time: no prediction (give --hardware FILE from `loom bench --out FILE`, or --calibrate)")
        return
    sim = simulate(model, plan, cluster)
    ep_s = sim.breakdown.get("ep_comm", 0.0)
    step_s, a2a_s = median["step_ms"] / 1000, median["a2a_ms"] / 1000
    print(
        f"step time: measured {step_s:.4f} s, predicted {sim.iteration_s:.4f} s, measured / predicted "
        f"{step_s / sim.iteration_s:.3f}; tokens/s predicted {sim.tokens_per_s:.0f}"
    )
    print(
        f"all-to-all time: measured {a2a_s:.4f} s ({median['a2a_share']:.1%} of the step), predicted "
        f"{ep_s:.4f} s ({ep_s / sim.iteration_s:.1%}), measured / predicted {ratio(a2a_s, ep_s)}"
    )


def ratio(measured: float, predicted: float) -> str:
    """measured / predicted, or "n/a" when nothing is predicted (ep 1: no all-to-all)."""
    return f"{measured / predicted:.3f}" if predicted else "n/a"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, default=2048, help="default mode: tokens through the layer")
    parser.add_argument("--hidden", type=int, default=None, help="default 256; 64 with --train (d_model)")
    parser.add_argument("--ffn-hidden", type=int, default=512, help="default mode only")
    parser.add_argument("--experts", type=int, default=None, help="default 8; 4 with --train")
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7, help="default mode: timed repetitions")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (per rank with --train)")
    train_options = parser.add_argument_group("--train: expert-parallel training steps")
    train_options.add_argument("--train", action="store_true", help="measure training steps (see above)")
    train_options.add_argument("--ranks", type=int, default=2, help="gloo ranks, all data-parallel")
    train_options.add_argument(
        "--ep", type=int, default=None, help="expert-parallel degree (default --ranks)"
    )
    train_options.add_argument("--layers", type=int, default=2)
    train_options.add_argument("--heads", type=int, default=4)
    train_options.add_argument("--vocab", type=int, default=256)
    train_options.add_argument("--batch", type=int, default=4, help="sequences per rank and step")
    train_options.add_argument("--seq", type=int, default=64)
    train_options.add_argument("--capacity-factor", type=float, default=1.25, help="0: dropless")
    train_options.add_argument("--steps", type=int, default=6, help="measured steps")
    train_options.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    train_options.add_argument("--calibrate", action="store_true", help="measure a hardware profile too")
    train_options.add_argument(
        "--hardware", help="a hardware profile (`loom bench --out FILE`) to predict with"
    )
    args = parser.parse_args()
    if args.train:
        args.hidden = args.hidden or 64
        args.experts = args.experts or 4
        args.ep = args.ep or args.ranks
        args.capacity_factor = args.capacity_factor or None
        train(args)
    else:
        args.hidden = args.hidden or 256
        args.experts = args.experts or 8
        compare_experts(args)


if __name__ == "__main__":
    main()
