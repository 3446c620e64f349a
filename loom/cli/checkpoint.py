"""`loom checkpoint ls DIR` and `loom checkpoint export DIR OUT.pt`: inspect and export checkpoints."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

NAME = "checkpoint"
HELP = "list checkpoints (step, world size, integrity) or export one as a single file"
DESCRIPTION = """\
Inspect the checkpoints a run saved under DIR (its [checkpoint] dir), or export one checkpoint's model
parameters as one unsharded file that plain torch.load reads.

examples:
  loom checkpoint ls runs/ckpt                      every step_* directory: step, world size, status
  loom checkpoint export runs/ckpt model.pt         the newest intact checkpoint's parameters
  loom checkpoint export runs/ckpt/step_000100 model.pt
"""


def configure(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    ls = actions.add_parser("ls", help="list checkpoints with their integrity status")
    ls.add_argument("dir", help="the checkpoint directory (holding step_* directories)")
    export = actions.add_parser("export", help="write one checkpoint's parameters to a torch.save file")
    export.add_argument("dir", help="a checkpoint directory, or a step_* directory inside one")
    export.add_argument("out", help="the file to write (e.g. model.pt)")


def execute(args: argparse.Namespace) -> int:
    return _ls(Path(args.dir)) if args.action == "ls" else _export(Path(args.dir), Path(args.out))


def _ls(root: Path) -> int:
    from loom.checkpoint import list_step_dirs, read_manifest, verify

    found = list_step_dirs(root)
    if not found:
        print(f"loom checkpoint: no step_* checkpoints under {root}", file=sys.stderr)
        return 1
    print(f"{'step':>8}  {'world':>5}  {'level':>5}  status")
    for step, path in found:
        problems = verify(path)
        try:
            manifest = read_manifest(path)
            world, level = manifest.get("world_size", "?"), manifest.get("optimizer_level", "?")
        except Exception:
            world, level = "?", "?"
        status = "ok" if not problems else "CORRUPT: " + "; ".join(problems)
        print(f"{step:>8}  {world!s:>5}  {level!s:>5}  {status}")
    return 0


def _export(source: Path, out: Path) -> int:
    from loom.checkpoint import export_model, latest_valid, verify

    if (source / "manifest.json").exists() or (source / "dcp").is_dir():
        problems = verify(source)
        if problems:
            print("loom checkpoint: " + "; ".join(problems), file=sys.stderr)
            return 1
        path = source
    else:
        path = latest_valid(source).path
        if path is None:
            print(f"loom checkpoint: no intact checkpoint under {source}", file=sys.stderr)
            return 1
    count = export_model(path, out)
    print(f"wrote {count} tensors of {path} to {out}")
    return 0
