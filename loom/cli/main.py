"""The `loom` command: one entry point, one small module per subcommand.

A subcommand module provides NAME, HELP (one line for `loom --help`), DESCRIPTION (its own `--help`
text, with examples), `configure(parser)` to add its arguments and `execute(args) -> int` to run. A module
with `TAKES_CONFIG_OVERRIDES = True` also receives the `--section.key value` pairs given after its options
as `args.overrides` (`loom simulate CONFIG.toml --parallel.tp 4`). Adding a subcommand is writing such a
module and listing it in `_COMMANDS`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from loom.cli import bench, checkpoint, plan, run, simulate, train

_COMMANDS = (run, train, simulate, plan, bench, checkpoint)

DESCRIPTION = """\
loom: train ordinary PyTorch models across many devices.

examples:
  loom train configs/demo.toml        train a GPT as the config says (dp x tp, optimizer level, ...)
  loom run -n 2 train.py              run train.py on 2 local ranks, like torchrun
  loom run -n 4 train.py --lr 3e-4    arguments after the script go to the script
  loom simulate --model gpt3-175b --hardware h100-sxm --gpus 1024 --tp 8 --pp 8 --global-batch 1536
                                      predict step time, MFU and memory of a plan
  loom plan --model gpt3-175b --hardware h100-sxm --gpus 1024 --global-batch 1536
                                      search the fastest plan that fits
  loom bench --out this-machine.json  measure this machine into a hardware profile
  loom checkpoint ls runs/ckpt        list saved checkpoints and whether each is intact
  loom run --help                     everything about one command
"""


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of `loom` with every subcommand registered."""
    parser = argparse.ArgumentParser(
        prog="loom", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands")
    for module in _COMMANDS:
        sub = commands.add_parser(
            module.NAME,
            help=module.HELP,
            description=module.DESCRIPTION,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        module.configure(sub)
        sub.set_defaults(execute=module.execute)
    return parser


def parse_arguments(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """`argv` parsed as `loom` reads it: a command that takes config overrides (`TAKES_CONFIG_OVERRIDES`)
    gets the `--section.key value` pairs argparse does not know as `args.overrides`; any other command
    exits with argparse's usage error for them."""
    args, extra = parser.parse_known_args(argv)
    takes_overrides = getattr(_module(args.command), "TAKES_CONFIG_OVERRIDES", False)
    if extra and not takes_overrides:
        parser.parse_args(argv)  # argparse's own error: unrecognized arguments
    if takes_overrides:
        args.overrides = extra
    return args


def _module(command: str | None) -> object:
    return next((module for module in _COMMANDS if module.NAME == command), None)


def _exit_code(exc: SystemExit) -> int:
    return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the `loom` command with `argv` (default: sys.argv[1:]); return the exit status."""
    parser = build_parser()
    try:
        args = parse_arguments(parser, argv)
    except SystemExit as exc:  # --help or a usage error: argparse printed it; report its status
        return _exit_code(exc)
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        return args.execute(args)
    except KeyboardInterrupt:
        print("loom: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
