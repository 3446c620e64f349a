"""`loom checkpoint ls|verify|export|import`: inspect and verify checkpoints, export one as a single file,
import one back."""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

from loom.files import byte_size

NAME = "checkpoint"
HELP = (
    "list or verify checkpoints, export one as a single safetensors/.pt file (or a Hugging Face directory), "
    "or import such a file"
)
DESCRIPTION = """\
Inspect the checkpoints a run saved under DIR (its [checkpoint] dir), verify them, export one checkpoint's
model parameters as one unsharded file (safetensors, or torch.save for .pt) that plain PyTorch reads, or
import such a file as a weights-only checkpoint that loom loads onto any mesh (load_model_weights).
Loading never runs code from the files (see docs/checkpoints.md, "Untrusted checkpoints").

examples:
  loom checkpoint ls runs/ckpt                      every step_*: step, world size, kind, mesh, status
  loom checkpoint verify runs/ckpt                  sizes, checksums, and that every file loads as data
  loom checkpoint export runs/ckpt model.safetensors
                                      the newest intact checkpoint's parameters (+ model.config.json)
  loom checkpoint export runs/ckpt/step_000100 model.pt
  loom checkpoint export runs/ckpt runs/hf-model   a Hugging Face model's run ([model] hf_config or
                                      hf_pretrained): a directory that from_pretrained loads
  loom checkpoint import model.safetensors runs/init          -> runs/init/step_000000 (weights only)
  loom checkpoint import model.safetensors runs/init --step 100
"""

_MESH = re.compile(r"^Mesh\((.*?)(;.*)?\)$")  # "Mesh(dp=2, tp=2; canonical 2 x 2)" -> "dp=2, tp=2"


def configure(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    ls = actions.add_parser("ls", help="list checkpoints with their kind, mesh and integrity status")
    ls.add_argument("dir", help="the checkpoint directory (holding step_* directories)")
    verify = actions.add_parser(
        "verify", help="check sizes, checksums, and that the files hold checkpoint data only (exit 1 if not)"
    )
    verify.add_argument("dir", help="a checkpoint directory (every step_* in it), or one step_* directory")
    export = actions.add_parser("export", help="write one checkpoint's parameters to one unsharded file")
    export.add_argument("dir", help="a checkpoint directory, or a step_* directory inside one")
    export.add_argument(
        "out",
        help="the file to write: model.safetensors, or model.pt (.pth, .bin) for torch.save; or, for a run "
        "of a Hugging Face model, a directory (config.json + model.safetensors for from_pretrained)",
    )
    export.add_argument(
        "--hf-config",
        type=Path,
        default=None,
        help="the Hugging Face config.json to export with (default: the one the run named)",
    )
    imp = actions.add_parser("import", help="turn a safetensors/.pt file into a weights-only checkpoint")
    imp.add_argument("file", help="a .safetensors file, or a torch.save file of name -> tensor")
    imp.add_argument(
        "dir", help="the checkpoint root (the checkpoint goes to DIR/step_NNNNNN), or a step_N dir"
    )
    imp.add_argument(
        "--step", type=_step, default=None, help="the step to record (default 0, or N of step_N)"
    )
    imp.add_argument(
        "--config", type=Path, default=None, help="a JSON model config (default: FILE's <stem>.config.json)"
    )


def _step(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text}: a step is >= 0")
    return value


def execute(args: argparse.Namespace) -> int:
    if args.action == "ls":
        return _ls(Path(args.dir))
    if args.action == "verify":
        return _verify(Path(args.dir))
    if args.action == "export":
        return _export(Path(args.dir), Path(args.out), args.hf_config)
    return _import(Path(args.file), Path(args.dir), args.step, args.config)


def _fail(message: str) -> int:
    print(f"loom checkpoint: {message}", file=sys.stderr)
    return 1


def _checkpoints(target: Path) -> list[Path]:
    """The checkpoints `target` names: itself when it is one, else every step_* in it, oldest first;
    `CheckpointError` naming it and the fix when there are none."""
    from loom.checkpoint import CheckpointError, list_step_dirs
    from loom.checkpoint.manifest import is_checkpoint_dir

    hint = "give a run's checkpoint dir (its [checkpoint] dir) or one step_* directory in it"
    if not target.exists():
        raise CheckpointError(f"{target}: no such directory; {hint}")
    if not target.is_dir():
        raise CheckpointError(f"{target}: is a file, not a checkpoint directory; {hint}")
    if is_checkpoint_dir(target):
        return [target]
    found = [path for _, path in list_step_dirs(target)]
    if not found:
        empty = "it is empty" if not any(target.iterdir()) else "it holds no step_* directories"
        raise CheckpointError(f"no step_* checkpoints under {target} ({empty}); {hint}")
    return found


def _ls(root: Path) -> int:
    from loom.checkpoint import CheckpointError, list_step_dirs
    from loom.checkpoint.manifest import is_checkpoint_dir

    if root.is_dir() and is_checkpoint_dir(root):
        return _fail(
            f"{root}: is one checkpoint; list the directory that holds it: loom checkpoint ls {root.parent}"
        )
    try:
        _checkpoints(root)
    except CheckpointError as exc:
        return _fail(str(exc))
    found = list_step_dirs(root)
    rows = [_ls_row(step, path) for step, path in found]
    mesh_width = max(4, *(len(row[4]) for row in rows))
    print(f"{'step':>8}  {'world':>5}  {'level':>5}  {'kind':<7}  {'mesh':<{mesh_width}}  status")
    for step, world, level, kind, mesh, status in rows:
        print(f"{step:>8}  {world:>5}  {level:>5}  {kind:<7}  {mesh:<{mesh_width}}  {status}")
    return 0


def _ls_row(step: int, path: Path) -> tuple[int, str, str, str, str, str]:
    """One line of `ls`: what the manifest says ("?" where it cannot be read) and the integrity status."""
    from loom.checkpoint import read_manifest, verify
    from loom.checkpoint.export import FULL, WEIGHTS

    problems = verify(path)
    try:
        manifest: dict[str, Any] = read_manifest(path)
    except Exception:
        manifest = {}
    kind = manifest.get("kind", FULL) if manifest else "?"
    level = "-" if kind == WEIGHTS else str(manifest.get("optimizer_level", "?"))
    world = str(manifest.get("world_size", "?"))
    status = "ok" if not problems else "CORRUPT: " + "; ".join(problems)
    return step, world, level, kind, _mesh(manifest.get("mesh")), status


def _mesh(text: Any) -> str:
    """The mesh's axes, short ("dp=2, tp=2"); "-" when the checkpoint was saved without one."""
    if not text:
        return "-"
    match = _MESH.match(str(text))
    return match.group(1) if match else str(text)


def _verify(target: Path) -> int:
    """Every checkpoint `target` names: the manifest's sizes and checksums, then that each file holds
    checkpoint data only (nothing is run). Exit 1 naming each damaged or suspicious file."""
    from loom.checkpoint import CheckpointError, verify
    from loom.checkpoint.safe import check_contents

    try:
        checkpoints = _checkpoints(target)
    except CheckpointError as exc:
        return _fail(str(exc))
    failed = 0
    for path in checkpoints:
        checked, problems = [], verify(path)
        status = "DAMAGED"
        if not problems:
            checked.append(_manifest_summary(path))
            more, problems = check_contents(path)
            checked += more
            status = "SUSPICIOUS"
        failed += bool(problems)
        print(f"{path}: {status if problems else 'ok'}")
        for line in checked if not problems else problems:
            print(f"  {line}")
    if failed:
        return _fail(f"{failed} of {len(checkpoints)} checkpoints failed verification (see above)")
    print(f"verified {len(checkpoints)} checkpoint(s): intact, and holding checkpoint data only")
    return 0


def _manifest_summary(path: Path) -> str:
    from loom.checkpoint import read_manifest

    files = read_manifest(path)["files"]
    size = sum(int(entry["size"]) for entry in files.values())
    algorithms = sorted({key for entry in files.values() for key in entry if key not in ("size", "rank")})
    return f"manifest.json: {len(files)} files, {byte_size(size)}; sizes and {'/'.join(algorithms)} checksums match"


def _export(source: Path, out: Path, hf_config: Path | None = None) -> int:
    from loom.checkpoint import CheckpointError, export_hf, export_model, latest_valid, verify
    from loom.checkpoint.export import check_export_target, hf_config_file

    try:
        checkpoints = _checkpoints(source)
    except CheckpointError as exc:
        return _fail(str(exc))
    if checkpoints == [source]:
        problems = verify(source)
        if problems:
            return _fail("; ".join(problems))
        path = source
    else:
        choice = latest_valid(source)
        if choice.path is None:
            return _fail(f"no intact checkpoint under {source}: " + " | ".join(choice.skipped))
        path = choice.path
    # a directory (or a name without a suffix) for a Hugging Face model's run: config.json + safetensors
    to_directory = (out.is_dir() or not out.suffix) and (hf_config or hf_config_file(path)) is not None
    try:
        if not to_directory:
            check_export_target(out)
    except CheckpointError as exc:
        return _fail(str(exc))
    try:
        count = export_hf(path, out, hf_config) if to_directory else export_model(path, out)
    except (CheckpointError, OSError) as exc:
        return _fail(f"exporting {path} to {out} failed: {exc}")
    print(
        f"wrote {count} tensors of {path} to {out}" + (" (a Hugging Face directory)" if to_directory else "")
    )
    return 0


def _import(source: Path, root: Path, step: int | None, config_file: Path | None) -> int:
    from loom.checkpoint import CheckpointError, import_model

    config = None
    if config_file is not None:
        try:
            config = json.loads(config_file.read_text())
        except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
            return _fail(
                f"{config_file}: not a readable JSON config ({exc}); give a JSON file of the model config "
                "(as `export` writes beside its output: <stem>.config.json)"
            )
    try:
        path = import_model(source, root, step=step, config=config)
    except CheckpointError as exc:
        return _fail(str(exc))
    except OSError as exc:
        return _fail(f"importing {source} into {root} failed: {exc}")
    print(f"wrote a weights-only checkpoint of {source} to {path}")
    return 0
