"""`loom train CONFIG.toml [--section.key value ...]`: the main job (see loom/train/job.py)."""

from __future__ import annotations

import argparse
import sys

from rich.console import Console
from rich.markup import escape

from loom.dist.launch import LaunchError
from loom.fault import RestartPolicy, supervise
from loom.train.config import TrainConfig, load_config
from loom.train.job import run, steps_summary

NAME = "train"
HELP = "train a GPT from a TOML config on local worker processes"
DESCRIPTION = """\
Train the reference GPT as CONFIG.toml says: mesh (dp x tp), optimizer level, recomputation, precision,
data and schedule. Keys can be overridden on the command line as --section.key value.

The workers are supervised: a worker that dies, raises during training or hangs (no heartbeat for
fault.heartbeat_timeout_s) stops the job, which restarts from the last checkpoint ([checkpoint] dir) up to
fault.max_restarts times; every event is logged, and appended to DIR/events.jsonl.

examples:
  loom train configs/demo.toml
  loom train configs/demo.toml --train.steps 50 --parallel.tp 1
  loom train configs/demo.toml --train.workers 2 --parallel.optimizer_level 2
  loom train configs/demo.toml --checkpoint.dir runs/ckpt --checkpoint.every_steps 50 --fault.max_restarts 5
"""


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "config", help="the TOML file (sections model, data, parallel, train, checkpoint, fault)"
    )
    parser.add_argument("overrides", nargs=argparse.REMAINDER, help="--section.key value pairs")


def execute(args: argparse.Namespace) -> int:
    try:
        config = load_config(args.config, args.overrides)
        config.validate(config.train.workers)
    except (ValueError, OSError) as error:
        print(f"loom train: {error}", file=sys.stderr)
        return 2
    console = Console()
    console.print(f"[bold]loom train[/] {escape(args.config)} on {config.train.workers} local worker(s)")
    if config.fault.max_restarts and not config.checkpoint.dir:
        console.print("[yellow]no checkpoint.dir: a restart after a failure starts again from step 0[/]")
    try:
        summary = supervise(run, config.train.workers, config, policy=restart_policy(config)).results[0]
    except LaunchError as error:
        print(f"loom train: {error}", file=sys.stderr)
        return 1
    console.print(f"{steps_summary(summary['losses'])}, {summary['seconds']:.0f} s")
    for prompt, answer, generated in summary.get("samples", []):
        mark = "[green]right[/]" if generated.split("\n", 1)[0].strip() == answer else "[red]wrong[/]"
        console.print(
            f"  {escape(prompt)}{escape(generated.split(chr(10), 1)[0])!s:6s} (expected {answer}) {mark}"
        )
    if "accuracy" in summary:
        console.print(f"[bold]accuracy on 100 held-out prompts: {100 * summary['accuracy']:.0f}%[/]")
    return 0


def restart_policy(config: TrainConfig) -> RestartPolicy:
    """The supervisor's settings from `[fault]` (events go next to the checkpoints)."""
    fault, directory = config.fault, config.checkpoint.dir
    return RestartPolicy(
        max_restarts=fault.max_restarts,
        heartbeat_timeout_s=fault.heartbeat_timeout_s or None,
        collective_timeout_s=fault.collective_timeout_s,
        events_file=f"{directory}/events.jsonl" if directory else None,
    )
