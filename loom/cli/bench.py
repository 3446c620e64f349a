"""`loom bench`: measure this machine (matmul FLOP/s, memory bandwidth, collectives) into a hardware profile."""

from __future__ import annotations

import argparse
import json
import sys

from rich.console import Console
from rich.table import Table

from loom.cost.calibrate import DEFAULT_SIZES, Calibration, calibrate, link_check
from loom.cost.hardware import save_cluster

NAME = "bench"
HELP = "measure this machine into a hardware profile for `loom simulate`"
DESCRIPTION = """\
Measure this machine on N local ranks, all at once as training runs them: matmul FLOP/s at two sizes (a
peak and a shape knee are fitted), memory bandwidth, kernel launch overhead, and the time of every
collective (all-reduce, all-gather, reduce-scatter, all-to-all, broadcast, reduce, send/recv) over gloo on
CPUs or NCCL on GPUs, reported as algorithm and bus bandwidth the way nccl-tests does. With --out, write a
hardware profile that `loom simulate --hardware FILE` loads.

examples:
  loom bench                                  measure on 2 ranks and print the tables
  loom bench --out this-machine.json          also write the profile
  loom bench -n 4 --sizes 65536 4194304 --repeats 10
  loom simulate --model-config tiny.toml --hardware this-machine.json --gpus 2
"""


def configure(parser: argparse.ArgumentParser) -> None:
    """Add `loom bench`'s arguments to `parser`."""
    parser.add_argument("-n", "--nprocs", type=int, default=2, metavar="N", help="local ranks (default 2)")
    parser.add_argument(
        "--backend", choices=("gloo", "nccl"), default=None, help="default: nccl with GPUs, else gloo"
    )
    parser.add_argument(
        "--sizes",
        type=int,
        nargs="+",
        default=list(DEFAULT_SIZES),
        metavar="BYTES",
        help="collective buffer sizes",
    )
    parser.add_argument("--matmul-sizes", type=int, nargs=2, default=[128, 512], metavar=("SMALL", "LARGE"))
    parser.add_argument(
        "--repeats", type=int, default=5, metavar="R", help="timed runs per measurement (median)"
    )
    parser.add_argument("--out", metavar="FILE", help="write the hardware profile (JSON) here")
    parser.add_argument("--json", action="store_true", help="print the measurements and profile as JSON")


def _print(console: Console, result: Calibration) -> None:
    device = result.cluster.device
    matmul = Table(title="matmul (fp32, n x n @ n x n in a linear layer's 3 training layouts, slowest rank)")
    for column in ("n", "seconds", "GFLOP/s"):
        matmul.add_column(column, justify="right")
    for row in result.matmul:
        matmul.add_row(str(row["size"]), f"{row['seconds']:.2e}", f"{row['flops_per_s'] / 1e9:.1f}")
    console.print(matmul)
    console.print(
        f"fitted: peak {device.peak('fp32') / 1e9:.1f} GFLOP/s, shape knee {device.matmul_knee:.0f}; memory bandwidth "
        f"{device.memory_bandwidth / 1e9:.1f} GB/s, of which elementwise kernels reach "
        f"{device.memory_efficiency:.0%}; kernel overhead (autograd's included) {device.kernel_overhead_s * 1e6:.1f} us"
    )
    if result.collectives:
        table = Table(title=f"collectives over {result.cluster.gpus} ranks (rank 0)")
        for column in ("collective", "bytes", "time us", "algbw GB/s", "busbw GB/s"):
            table.add_column(column, justify="left" if column == "collective" else "right")
        for row in result.collectives:
            table.add_row(
                row["kind"], f"{row['bytes']:,}", f"{row['seconds'] * 1e6:.1f}", f"{row['algbw'] / 1e9:.3f}",
                f"{row['busbw'] / 1e9:.3f}",
            )  # fmt: skip
        console.print(table)
    for line in link_lines(result):
        console.print(line, highlight=False)


def link_lines(result: Calibration) -> list[str]:
    """What the link of the profile is and how it compares with the measured all-reduces: the fit is a
    latency per step plus bytes over a bus bandwidth (the large-buffer limit), so the measured bus bandwidth
    of a small buffer is lower than the fitted one; the predicted and measured times are shown side by side."""
    link = result.cluster.intra
    check = link_check(result)
    if not check or result.cluster.gpus < 2:
        return [
            f"link: no all-reduce measured on {result.cluster.gpus} rank(s); the profile keeps a placeholder "
            f"link ({link.bandwidth / 1e9:.2f} GB/s, {link.latency_s * 1e6:.0f} us per step): measure with "
            "-n 2 or more to fit it"
        ]
    how = (
        "from one size (no latency term: give two --sizes or more to fit one)"
        if len(check) == 1
        else ("by least squares over the sizes")
    )
    lines = [
        f"link fitted to all-reduce {how}: latency {link.latency_s * 1e6:.1f} us per step + bytes at a bus "
        f"bandwidth of {link.bandwidth / 1e9:.3f} GB/s (the large-buffer limit; small buffers measure lower, "
        "as latency dominates them)"
    ]
    worst = max(abs(predicted / measured - 1) for _, measured, predicted in check)
    pairs = ", ".join(
        f"{size:,} B {measured * 1e6:.0f}/{predicted * 1e6:.0f}" for size, measured, predicted in check
    )
    lines.append(
        f"all-reduce time measured/fitted (us): {pairs}; the fit is within {worst:.0%} of every size"
    )
    return lines


def execute(args: argparse.Namespace) -> int:
    """Measure, print, and write the profile; return the exit status."""
    if args.nprocs < 1 or args.repeats < 1 or min(args.sizes) < 4:
        print("loom bench: error: --nprocs and --repeats must be >= 1 and sizes >= 4 bytes", file=sys.stderr)
        return 2
    result = calibrate(
        args.nprocs, matmul_sizes=args.matmul_sizes, collective_sizes=args.sizes, repeats=args.repeats,
        backend=args.backend,
    )  # fmt: skip
    if args.json:
        data = {
            "profile": result.cluster.to_dict(),
            "matmul": result.matmul,
            "collectives": result.collectives,
        }
        print(json.dumps(data))
    else:
        _print(Console(), result)
    if args.out:
        save_cluster(result.cluster, args.out)
        if not args.json:
            print(f"wrote {args.out}; use it with: loom simulate --hardware {args.out} ...")
    return 0
