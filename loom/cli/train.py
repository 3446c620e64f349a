"""`loom train CONFIG.toml [--section.key value ...]`: the main job (see loom/train/job.py)."""

from __future__ import annotations

import argparse
import json
import os
import sys

from rich.console import Console
from rich.markup import escape

from loom.cli.plan import describe, print_search
from loom.dist import env
from loom.dist.launch import LaunchError
from loom.fault import Fault, RestartPolicy, supervise, supervise_replicas
from loom.train.config import TrainConfig, config_help, load_config
from loom.train.device import device_setting
from loom.train.job import check_faults, run
from loom.train.report import steps_summary

NAME = "train"
TAKES_CONFIG_OVERRIDES = True  # the `--section.key value` pairs after CONFIG.toml (see loom/cli/main.py)
USAGE = "loom train [-h] [-v] CONFIG.toml [--section.key value ...]"
HELP = "train a GPT or a Hugging Face causal LM from a TOML config on local worker processes"
DESCRIPTION = """\
Train the reference GPT, or a Hugging Face causal LM ([model] hf_config or hf_pretrained), as CONFIG.toml
says: mesh (dp x tp), optimizer level, recomputation, precision, data and schedule. Keys can be overridden
on the command line as --section.key value. At the end the model continues a few prompts greedily.

[parallel] plan = "plan.json" runs a saved plan (`loom plan ... --out plan.json`) instead of the sizes;
[parallel] mode = "auto" lets the planner choose them for the run's devices (printed as `loom plan` prints
its search; memory_limit and hardware shape the search).

The workers are supervised: a worker that dies, raises during training or hangs (no heartbeat for
fault.heartbeat_timeout_s: one per step and one per start-up phase) stops the job, which restarts from the
last checkpoint ([checkpoint] dir) up to fault.max_restarts times; every event is logged, and appended to
DIR/events.jsonl.

Under torchrun (several nodes) each process is one rank and torchrun restarts them (--max-restarts); the job
resumes from the last checkpoint the same way, and a collective that waits past fault.collective_timeout_s
fails its rank. LOOM_FAULTS='[{"kind": "sigkill", "rank": 1, "step": 7}]' injects faults on purpose (see
loom/fault/inject.py; '{"kind": "hang", "rank": 1, "during": "startup", "phase": "loading the checkpoint"}'
strikes before the first step) in the first attempt, to rehearse recovery.

Everything loom train can check before it starts workers is checked first (every config rule, the data
file, the checkpoint and log directories); an error that a restart cannot fix (a bad setting, a file where a
directory should be, a permission) stops the job at once instead of being retried.

The plan is printed one line per layout pattern (how many parameters share it); --verbose lists every
parameter. A line is printed for each checkpoint saved (step, size, seconds).

examples:
  loom train configs/demo.toml
  loom train configs/demo.toml --verbose
  loom train configs/demo.toml --train.steps 50 --parallel.tp 1
  loom train configs/demo.toml --train.workers 2 --parallel.optimizer_level 2
  loom plan job.toml --out plan.json && loom train job.toml --parallel.plan plan.json   # no [parallel] sizes
  loom train auto.toml        # [parallel] mode = "auto" and memory_limit = "2GiB": the planner chooses
  loom train configs/demo.toml --checkpoint.dir runs/ckpt --checkpoint.every_steps 50 --fault.max_restarts 5
  torchrun --nnodes 2 --nproc-per-node 8 --max-restarts 3 ... -m loom.cli.main train gpt.toml
"""


def epilog() -> str:
    """The config keys, their defaults and descriptions (from the config dataclasses), for `--help`."""
    return "config keys (TOML [section] key = value, or --section.key value), with their defaults:\n" + (
        config_help()
    )


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "config", help="the TOML file (sections model, data, parallel, train, checkpoint, fault)"
    )
    parser.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="print every parameter's layout, not one line per pattern",
    )
    parser.usage = USAGE
    parser.epilog = epilog()


def execute(args: argparse.Namespace) -> int:
    verbose = args.verbose
    try:
        config = load_config(args.config, args.overrides)
        # under torchrun the ranks are its processes; locally, the workers loom starts
        world_size = int(os.environ["WORLD_SIZE"]) if under_torchrun() else config.train.workers
        config.preflight(world_size)  # with parallel.mode = "auto", the planner chooses here
        faults = faults_from_env()
        check_faults(config, faults)
        # the workers' process group: NCCL when they compute on GPUs, one each (`train.device`), else gloo
        backend = env.backend_for(device_setting(config), world_size)
    except (ValueError, OSError) as error:
        print(f"loom train: {error}", file=sys.stderr)
        return 2
    if under_torchrun() and config.fault.elastic_replicas:
        print(
            "loom train: fault.elastic_replicas = true needs loom's own launcher (its rendezvous store outlives "
            "any worker); run without torchrun, or set fault.elastic_replicas = false",
            file=sys.stderr,
        )
        return 2
    if under_torchrun():
        if os.environ.get("RANK", "0") == "0":
            print_plan_source(Console(), config, world_size)
        return _run_here(config, faults, verbose)
    console = Console()
    console.print(f"[bold]loom train[/] {escape(args.config)} on {config.train.workers} local worker(s)")
    print_plan_source(console, config, world_size)
    if config.fault.max_restarts and not config.checkpoint.dir and not config.fault.elastic_replicas:
        console.print("[yellow]no checkpoint.dir: a restart after a failure starts again from step 0[/]")
    try:
        policy = restart_policy(config)
        if config.fault.elastic_replicas:  # a death drops the replica and a replacement joins, no restart
            results = supervise_replicas(
                run, config.train.workers, config, faults, policy=policy, verbose=verbose, backend=backend
            ).results
            summary = _elastic_summary(console, results)
        else:
            summary = supervise(
                run, config.train.workers, config, faults, policy=policy, verbose=verbose, backend=backend
            ).results[0]
    except LaunchError as error:
        print(f"loom train: {error}", file=sys.stderr)
        return 1
    _report(console, summary)
    return 0


def _elastic_summary(console: Console, results: list[dict]) -> dict:
    """Say which slots a replacement took over, and where it joined; the summary to report: the lowest slot
    that ran the most steps (a slot replaced ran only those after its replacement joined)."""
    for rank, summary in enumerate(results):
        if "joined_at" in summary and summary["joined_at"] is not None:
            console.print(f"replica {rank}: replaced, joined at step {summary['joined_at']}")
        elif summary.get("first_step", 1) > 1:
            console.print(f"replica {rank}: replaced, but no sync was left to join")
    return max(results, key=lambda summary: len(summary["losses"]))


def print_plan_source(console: Console, config: TrainConfig, world_size: int) -> None:
    """Where the run's [parallel] values come from, when not from its keys: the planner's search as `loom
    plan` prints it, the faster plans loom train cannot run, and the one it runs (`mode = "auto"`); or the
    plan file (`parallel.plan`)."""
    par = config.parallel
    if par.mode == "auto":
        chosen = config.auto_plan(world_size)
        console.print(
            f"parallel.mode = 'auto': the planner's search on {world_size} x {chosen.hardware}",
            highlight=False,
        )
        print_search(console, chosen.model, chosen.search, top=3)
        for candidate, reason in chosen.skipped[:3]:
            console.print(f"  skipped {describe(candidate)}: {escape(reason)}", highlight=False)
        console.print(f"[bold]running[/] {describe(chosen.candidate)}", highlight=False)
    elif par.origin is not None:
        plan = config.plan(world_size)
        predicted = f", predicted step {plan.predicted_step_s:.3g} s" if plan.predicted_step_s else ""
        console.print(f"running the plan of {escape(par.origin)}{predicted}", highlight=False)


def _run_here(config: TrainConfig, faults: list[Fault], verbose: bool) -> int:
    """One rank of a torchrun job: torchrun supervises and restarts; the collective timeout catches hangs."""
    os.environ.setdefault("LOOM_COLLECTIVE_TIMEOUT_S", str(config.fault.collective_timeout_s))
    summary = run(config, faults, verbose=verbose)
    if os.environ.get("RANK", "0") == "0":
        _report(Console(), summary)
    return 0


def _report(console: Console, summary: dict) -> None:
    losses, seconds = summary["losses"], summary["seconds"]
    console.print(f"{steps_summary(losses, summary.get('first_step', 1))} in {seconds:.1f} s", soft_wrap=True)
    for prompt, answer, generated in summary.get("samples", []):
        mark = "[green]right[/]" if generated.split("\n", 1)[0].strip() == answer else "[red]wrong[/]"
        console.print(
            f"  {escape(prompt)}{escape(generated.split(chr(10), 1)[0])!s:6s} (expected {answer}) {mark}"
        )
    for prompt, continuation in summary.get("text_samples", []):
        console.print(f"  {escape(prompt)} [bold]->[/] {escape(continuation)}", soft_wrap=True)
    if "accuracy" in summary:
        console.print(f"[bold]accuracy on 100 held-out prompts: {100 * summary['accuracy']:.0f}%[/]")


def restart_policy(config: TrainConfig) -> RestartPolicy:
    """The supervisor's settings from `[fault]` (events go next to the checkpoints)."""
    fault, directory = config.fault, config.checkpoint.dir
    return RestartPolicy(
        max_restarts=fault.max_restarts,
        heartbeat_timeout_s=fault.heartbeat_timeout_s or None,
        collective_timeout_s=fault.collective_timeout_s,
        events_file=f"{directory}/events.jsonl" if directory else None,
    )


def under_torchrun() -> bool:
    """True in a process that torchrun (torch.distributed.run) started."""
    return "TORCHELASTIC_RUN_ID" in os.environ


def faults_from_env() -> list[Fault]:
    """The faults LOOM_FAULTS asks for: a JSON list of `Fault` fields."""
    text = os.environ.get("LOOM_FAULTS", "").strip()
    if not text:
        return []
    try:
        return [Fault(**fields) for fields in json.loads(text)]
    except (TypeError, ValueError, json.JSONDecodeError) as error:
        raise ValueError(
            f"LOOM_FAULTS={text!r}: {error}; expected a JSON list like "
            '[{"kind": "sigkill", "rank": 1, "step": 7}]'
        ) from None
