"""Bad inputs around checkpoint files: each is refused with a message that names the offending value and
says what to do instead (Python API and `loom checkpoint`). One process, no training."""

import contextlib
import io
import os
import shutil
import stat

import pytest
import torch
from checkpoint_files import rehash, saved, trainer
from safetensors.torch import save_file

from loom.checkpoint import (
    Checkpointer,
    CheckpointError,
    export_model,
    import_model,
    load_checkpoint,
    load_from,
)
from loom.checkpoint import manifest as mf
from loom.cli.main import main as cli_main

TOML = "[model]\nd_model = 32\n"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A checkpoint root holding one checkpoint (read only: cases that damage one copy it first)."""
    root = tmp_path_factory.mktemp("saved") / "ckpt"
    saved(root)
    return root


def _error(call):
    with pytest.raises(CheckpointError) as error:
        call()
    return str(error.value)


def _cli(*args):
    """`loom checkpoint ARGS`: must fail with exit 1; its error output."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = cli_main(["checkpoint", *map(str, args)])
    assert code == 1, err.getvalue()
    return err.getvalue()


def _toml(d):
    path = d / "train.toml"
    path.write_text(TOML)
    return path


def _copy(ckpt, d):
    """A copy of the checkpoint root: (root, its step directory)."""
    root = d / "copy"
    shutil.copytree(ckpt, root)
    return root, root / mf.step_dir_name(1)


def _replaced(ckpt, d, name, content):
    """A copy whose file `name` holds `content`, manifest re-hashed: (step directory, the file)."""
    _, step = _copy(ckpt, d)
    (step / name).write_text(content)
    rehash(step)
    return step, step / name


def _empty(d):
    path = d / "empty"
    path.mkdir()
    return path


def _unrelated(d):
    path = d / "notes"
    path.mkdir()
    (path / "readme.txt").write_text("hello")
    return path


def _no_manifest(ckpt, d):
    _, step = _copy(ckpt, d)
    (step / mf.MANIFEST).unlink()
    return step


def _tensor_file(d):
    path = d / "w.safetensors"
    save_file({"w": torch.ones(2)}, path)
    return path


def _text_as(d, name):
    path = d / name
    path.write_text(TOML)
    return path


def _case_metadata_text(ckpt, d):
    step, path = _replaced(ckpt, d, "dcp/.metadata", TOML)
    return _error(lambda: load_from(step, trainer())), [
        str(path),
        "it is text, starting '[model]'",
        "use an earlier one",
    ]


def _case_side_text(ckpt, d):
    step, path = _replaced(ckpt, d, "train_state.pt", TOML)
    return _error(lambda: load_from(step, trainer())), [
        f"{path}: not a torch.save file (it is text, starting '[model]')",
        "use an earlier one",
    ]


STEP = mf.step_dir_name(1)

# id -> function(ckpt root, tmp dir) -> (message, [what it must contain: the offending value, the fix])
CASES = {
    # resuming: load_checkpoint / Checkpointer.resume take the root
    "load_checkpoint-toml-file": lambda c, d: (
        _error(lambda: load_checkpoint(_toml(d), trainer())),
        [f"{d}/train.toml: is a file, not a checkpoint directory", "give the directory that holds"],
    ),
    "resume-toml-file": lambda c, d: (
        _error(lambda: Checkpointer(_toml(d)).resume(trainer())),
        [f"{d}/train.toml: is a file", "the [checkpoint] dir"],
    ),
    "load_checkpoint-step-dir": lambda c, d: (
        _error(lambda: load_checkpoint(c / STEP, trainer())),
        [f"{c / STEP}: is one checkpoint, not a checkpoint root", f"give its parent {c}"],
    ),
    # one checkpoint: load_from takes a step directory
    "load_from-root": lambda c, d: (
        _error(lambda: load_from(c, trainer())),
        [f"{c}: is a checkpoint root", f"e.g. {c / STEP}"],
    ),
    "load_from-missing": lambda c, d: (
        _error(lambda: load_from(d / "nowhere", trainer())),
        [f"{d}/nowhere: no such checkpoint directory", "give a step_* directory"],
    ),
    "load_from-toml-file": lambda c, d: (
        _error(lambda: load_from(_toml(d), trainer())),
        [f"{d}/train.toml: is a file, not a checkpoint directory", "give a step_* directory"],
    ),
    "load_from-empty-dir": lambda c, d: (
        _error(lambda: load_from(_empty(d), trainer())),
        [f"{d}/empty: is empty, not a checkpoint", "loom checkpoint ls DIR"],
    ),
    "load_from-unrelated-dir": lambda c, d: (
        _error(lambda: load_from(_unrelated(d), trainer())),
        [f"{d}/notes: not a loom checkpoint (no manifest.json, no dcp/)", "give a step_* directory"],
    ),
    "load_from-no-manifest": lambda c, d: (
        _error(lambda: load_from(_no_manifest(c, d), trainer())),
        [f"{d}/copy/{STEP}/manifest.json: missing", "use an earlier step_* checkpoint"],
    ),
    "load_from-metadata-is-toml": _case_metadata_text,
    "load_from-train-state-is-toml": _case_side_text,
    # export and import (Python)
    "export_model-txt-suffix": lambda c, d: (
        _error(lambda: export_model(c / STEP, d / "o.txt")),
        [f"{d}/o.txt: suffix '.txt'", "name the file e.g. o.safetensors"],
    ),
    "export_model-root": lambda c, d: (
        _error(lambda: export_model(c, d / "m.safetensors")),
        [f"{c}: is a checkpoint root", f"e.g. {c / STEP}"],
    ),
    "import_model-toml": lambda c, d: (
        _error(lambda: import_model(_toml(d), d / "out")),
        [
            f"{d}/train.toml: not a torch.save file (it is text, starting '[model]')",
            "import takes a .safetensors",
        ],
    ),
    "import_model-toml-named-safetensors": lambda c, d: (
        _error(lambda: import_model(_text_as(d, "m.safetensors"), d / "out")),
        [f"{d}/m.safetensors: not a readable safetensors file", "import takes a .safetensors"],
    ),
    "import_model-into-file": lambda c, d: (
        _error(lambda: import_model(_tensor_file(d), _toml(d))),
        [f"{d}/train.toml: is a file", "import into a directory"],
    ),
    "import_model-directory": lambda c, d: (
        _error(lambda: import_model(_empty(d), d / "out")),
        [f"{d}/empty: is a directory", "import takes a .safetensors"],
    ),
    # the command line
    "cli-export-txt-suffix": lambda c, d: (
        _cli("export", c, d / "o.txt"),
        [
            f"{d}/o.txt: suffix '.txt'",
            "export writes .safetensors (safetensors) or .pt, .pth, .bin (torch.save)",
        ],
    ),
    "cli-export-no-suffix": lambda c, d: (
        _cli("export", c, d / "model"),
        [f"{d}/model: no suffix", "e.g. model.safetensors"],
    ),
    "cli-export-out-is-dir": lambda c, d: (
        _cli("export", c, _dir_named(d, "out.pt")),
        [f"{d}/out.pt: is a directory", "give a file to write"],
    ),
    "cli-export-out-parent-missing": lambda c, d: (
        _cli("export", c, d / "no" / "m.safetensors"),
        [f"{d}/no/m.safetensors: its directory {d}/no does not exist", "create it first"],
    ),
    "cli-export-source-toml": lambda c, d: (
        _cli("export", _toml(d), d / "m.safetensors"),
        [f"{d}/train.toml: is a file, not a checkpoint directory", "give a run's checkpoint dir"],
    ),
    "cli-export-source-empty": lambda c, d: (
        _cli("export", _empty(d), d / "m.safetensors"),
        [f"no step_* checkpoints under {d}/empty (it is empty)", "give a run's checkpoint dir"],
    ),
    "cli-export-source-missing": lambda c, d: (
        _cli("export", d / "nowhere", d / "m.safetensors"),
        [f"{d}/nowhere: no such directory", "give a run's checkpoint dir"],
    ),
    "cli-import-toml": lambda c, d: (
        _cli("import", _toml(d), d / "out"),
        [f"{d}/train.toml: not a torch.save file", "import takes a .safetensors file or a torch.save file"],
    ),
    "cli-import-config-toml": lambda c, d: (
        _cli("import", _tensor_file(d), d / "out", "--config", _toml(d)),
        [f"{d}/train.toml: not a readable JSON config", "give a JSON file"],
    ),
    "cli-verify-toml": lambda c, d: (
        _cli("verify", _toml(d)),
        [f"{d}/train.toml: is a file, not a checkpoint directory", "give a run's checkpoint dir"],
    ),
    "cli-verify-empty": lambda c, d: (
        _cli("verify", _empty(d)),
        [f"no step_* checkpoints under {d}/empty (it is empty)", "one step_* directory in it"],
    ),
    "cli-ls-step-dir": lambda c, d: (
        _cli("ls", c / STEP),
        [f"{c / STEP}: is one checkpoint", f"loom checkpoint ls {c}"],
    ),
    "cli-ls-toml": lambda c, d: (
        _cli("ls", _toml(d)),
        [f"{d}/train.toml: is a file", "give a run's checkpoint dir"],
    ),
}


def _dir_named(d, name):
    path = d / name
    path.mkdir()
    return path


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_checkpoint_input(case, ckpt, tmp_path):
    message, expected = CASES[case](ckpt, tmp_path)
    for part in expected:
        assert part in message, f"{part!r} not in {message!r}"
    assert "weights_only=False" not in message and "Traceback" not in message


@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
def test_exports_follow_the_umask(suffix, ckpt, tmp_path):
    """Both export formats (and the config beside them) are created as the umask says: safetensors writes
    its files 0600 by itself, torch.save as the umask says."""
    previous = os.umask(0o027)
    try:
        out = tmp_path / f"m{suffix}"
        export_model(ckpt / STEP, out)
    finally:
        os.umask(previous)
    assert stat.S_IMODE(out.stat().st_mode) == 0o640
