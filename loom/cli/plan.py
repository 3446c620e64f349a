"""`loom plan`: search the parallel plan of a transformer on a cluster (`loom.plan.outer.search_plans`), or
of any model a Python function builds (`--model MODULE:FUNCTION`, `loom.cli.plan_model`), and print the
best, the runners-up and why each lost, and the regions that cannot run."""

from __future__ import annotations

import argparse
import json
import sys
import textwrap

from rich.console import Console
from rich.table import Table

from loom.cli.simulate import _duration, _gib, positive_int
from loom.cost.hardware import GIB, PROFILES, get_cluster
from loom.cost.transformer import TransformerConfig
from loom.files import byte_size
from loom.plan.model_spec import CONTRACT, is_model_spec
from loom.plan.outer import Candidate, SearchResult, search_plans, to_plan
from loom.sim.presets import PRESETS, get_model, load_model_config
from loom.train.config import load_config

NAME = "plan"
HELP = "search the best parallel plan of a model on a cluster (no GPU needed)"
PYTHON_MODEL = textwrap.fill(
    "--model MODULE:FUNCTION plans any PyTorch model: the module is imported from the current directory or "
    f"sys.path, and the function, called with no arguments on the meta device, must {CONTRACT}. Each dp x tp "
    "mesh of --gpus is solved at the operator level (every operator's and parameter's layout); pipelines, "
    "recomputation and optimizer levels are not searched for such a model.",
    width=105,
)
DESCRIPTION = f"""\
Search mesh shapes (dp, tp, pp; ep for experts), pipeline stages (uneven allowed), micro-batch size and
count, optimizer level and recompute policy under a memory limit, each plan priced by loom's simulator.
Context parallelism (cp: each sequence cut over cp ranks, Ulysses or ring attention) is searched from
8192 tokens per sequence, or when no plan without it fits.

examples:
  loom plan --model gpt3-175b --hardware h100-sxm --gpus 1024 --global-batch 1536
  loom plan --model llama3-70b --hardware h100-sxm --gpus 64 --global-batch 256 --seq 8192 --memory-limit 60
  loom plan --model llama3-8b --hardware h100-sxm --gpus 16 --global-batch 16 --seq 65536
  loom plan configs/demo.toml --gpus 8 --out plan.json     # the model, batch and sequence of a config
  loom plan --model gpt3-175b --gpus 1024 --global-batch 1536 --top 10 --json
  loom plan --model mypkg.models:build --gpus 8 --global-batch 64 --memory-limit 40 --out plan.json

{PYTHON_MODEL}

models: {", ".join(PRESETS)}
hardware: {", ".join(PROFILES)}, or a profile file written by `loom bench --out FILE`
--out writes the best plan as a loom.plan.Plan (`loom simulate --plan plan.json` prices it again).
exit status: 0 when a plan fits; 1 when none does (the reasons are printed); 2 for usage errors.
"""

ONE_MODEL = "give one model: CONFIG.toml, --model NAME, --model MODULE:FUNCTION or --model-config FILE"


def configure(parser: argparse.ArgumentParser) -> None:
    """Add `loom plan`'s arguments to `parser`."""
    parser.add_argument("config", nargs="?", metavar="CONFIG.toml", help="a training config: its model")
    parser.add_argument(
        "--model", metavar="NAME", help="a preset (see the list below), a CONFIG.toml, or MODULE:FUNCTION"
    )
    parser.add_argument(
        "--model-config", metavar="FILE", help="TOML/JSON of model fields, or a Hugging Face config.json"
    )
    parser.add_argument("--hardware", default="a100-80gb", help="profile name or file (default a100-80gb)")
    parser.add_argument("--gpus", type=positive_int, help="devices (default: the config's train.workers)")
    parser.add_argument(
        "--gpus-per-node", type=positive_int, help="devices per node (default: the profile's)"
    )
    parser.add_argument(
        "--global-batch", type=positive_int, help="sequences per step (default: the config's)"
    )
    parser.add_argument(
        "--seq", type=positive_int, help="tokens per sequence (default: the config's, or 2048)"
    )
    parser.add_argument(
        "--memory-limit", type=float, metavar="GIB", help="GiB per device (default: the device's memory)"
    )
    parser.add_argument("--top", type=positive_int, default=5, help="runners-up to print (default 5)")
    parser.add_argument("--out", metavar="PLAN.json", help="write the best plan as a loom.plan.Plan")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of tables")


def _inputs(args: argparse.Namespace) -> tuple[TransformerConfig, int, int, int]:
    """(model, gpus, global batch, seq) from the options; a ValueError names the option and the fix."""
    if args.model and args.model.endswith(".toml"):
        args.config, args.model = args.config or args.model, None  # --model CONFIG.toml: the config's model
    if sum(bool(x) for x in (args.config, args.model, args.model_config)) > 1:
        raise ValueError(ONE_MODEL)
    if args.model_config:
        model, gpus, batch, seq = load_model_config(args.model_config), None, None, 2048
    elif args.config:
        config = load_config(args.config)
        model = config.model.transformer_config()
        gpus, batch, seq = config.train.workers, config.train.global_batch, config.data.seq_len
    elif args.model:
        model, gpus, batch, seq = get_model(args.model), None, None, 2048
    else:
        raise ValueError(
            "no model: give --model NAME (a preset), --model MODULE:FUNCTION, --model-config FILE or CONFIG.toml"
        )
    gpus, batch, seq = args.gpus or gpus, args.global_batch or batch, args.seq or seq
    if gpus is None:
        raise ValueError("--gpus is missing: give the devices to plan for, e.g. --gpus 64")
    if batch is None:
        raise ValueError("--global-batch is missing: give the sequences per step, e.g. --global-batch 512")
    if args.memory_limit is not None and args.memory_limit <= 0:
        raise ValueError(f"--memory-limit {args.memory_limit:g} must be > 0 GiB per device")
    return model, gpus, batch, seq


def describe(c: Candidate) -> str:
    """One line: the candidate's mesh, stages, micro-batches, optimizer level and recompute policy."""
    p = c.plan
    stages = f" stages {','.join(map(str, p.stage_layers))}" if p.stage_layers else ""
    interleave = f" x{p.interleave} chunks" if p.interleave > 1 else ""
    ep = f" ep {p.ep}" if p.ep > 1 else ""
    sp = " +sp" if p.sequence_parallel else ""
    cp = f" cp {p.cp} {p.attention}" if p.cp > 1 else ""
    return (
        f"dp {p.dp}{cp} tp {p.tp}{sp} pp {p.pp}{interleave}{stages}{ep}, micro-batch {p.micro_batch} x "
        f"{p.micro_batches}, optimizer level {p.optimizer_level}, recompute {p.recompute}"
    )


def _json(found: SearchResult, top: int, fields) -> dict:
    """The search as one JSON object; `fields(candidate)` describes a candidate (its plan and prediction)."""

    def entry(c) -> dict:
        return {**fields(c), "why_lost": found.why_lost(c)}

    return {
        "best": entry(found.best) if found.best else None,
        "runners_up": [entry(c) for c in found.candidates[1 : top + 1]],
        "infeasible": [{"region": i.region, "reason": i.reason} for i in found.infeasible],
        "memory_limit_gib": found.memory_limit_gib,
        "considered": found.considered,
        "simulated": found.simulated,
        "search_s": found.seconds,
        "notes": found.notes,
    }


def _simulated(c: Candidate) -> dict:
    """A transformer search's candidate: its step and memory (the keys both searches give), its
    `ParallelPlan` and the simulator's result."""
    return {
        "step_s": c.step_s,
        "memory_gib": c.memory_gib,
        "plan": c.plan.to_dict(),
        "result": c.result.to_dict(),
    }


def print_search(console: Console, model: TransformerConfig, found: SearchResult, top: int) -> None:
    """The best plan with its step time, MFU and memory, the `top` runners-up and why each lost, the
    infeasible regions and the search's size (what `loom plan` prints; `loom train` with mode = auto too)."""
    best = found.best
    r = best.result
    console.print(f"[bold]{model.name}[/]: best plan {describe(best)}", highlight=False)
    console.print(
        f"  step {_duration(r.iteration_s)}, MFU {r.mfu:.1%}, memory {_gib(r.memory_per_device_gib)} per device "
        f"(limit {found.memory_limit_gib:g})",
        highlight=False,
    )
    _print_runners_up(console, found, top, describe)
    _print_infeasible(console, found)
    for note in found.notes:
        console.print(note, highlight=False)
    console.print(
        f"searched {found.considered} plans, simulated {found.simulated}, in {found.seconds:.1f} s",
        highlight=False,
    )


def _print_runners_up(console: Console, found: SearchResult, top: int, describe) -> None:
    """The `top` runners-up of `found`: `describe(candidate)`, step, memory and why each lost."""
    table = Table(title="runners-up")
    for column in ("plan", "step", "memory", "why it lost"):
        table.add_column(column)
    for c in found.candidates[1 : top + 1]:
        table.add_row(describe(c), _duration(c.step_s), byte_size(c.memory_gib * GIB), found.why_lost(c))
    console.print(table)


def _print_infeasible(console: Console, found: SearchResult) -> None:
    if not found.infeasible:
        return
    console.print("infeasible:", highlight=False)
    for item in found.infeasible:
        console.print(f"  {item.region}: {item.reason}", highlight=False)


def execute(args: argparse.Namespace) -> int:
    """Search and print; return the exit status."""
    if is_model_spec(args.model):
        from loom.cli.plan_model import execute as execute_python_model  # it reuses this module's printing

        return execute_python_model(args)
    try:
        model, gpus, batch, seq = _inputs(args)
        cluster = get_cluster(args.hardware, gpus=gpus, gpus_per_node=args.gpus_per_node)
    except ValueError as exc:
        print(f"loom plan: error: {exc}", file=sys.stderr)
        return 2
    limit = args.memory_limit * GIB if args.memory_limit is not None else None
    found = search_plans(model, cluster, gpus, batch, seq, memory_limit=limit, keep=max(10, args.top + 1))
    if args.json:
        print(json.dumps(_json(found, args.top, _simulated)))
    if found.best is None:
        if not args.json:
            print(f"loom plan: no plan of {model.name} fits {gpus} x {cluster.name}:", file=sys.stderr)
            for item in found.infeasible:
                print(f"  {item.region}: {item.reason}", file=sys.stderr)
        return 1
    if not args.json:
        print_search(Console(), model, found, args.top)
    if args.out:
        path = to_plan(found.best).save(args.out)
        print(f"wrote {path}", file=sys.stderr if args.json else sys.stdout)
    return 0
