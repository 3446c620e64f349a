"""Checkpoints from elsewhere cannot run code: crafted files (with a manifest re-hashed to match, as an
attacker would) fail with a clear error naming the file, and their payload never runs. One process each."""

import io
import json
import pickle
import warnings
from pathlib import Path

import pytest
import torch
from checkpoint_files import rehash, saved, trainer

from loom.checkpoint import (
    Checkpointer,
    CheckpointError,
    export_model,
    load_checkpoint,
    load_from,
    load_model_weights,
    read_model_tensors,
)
from loom.checkpoint.safe import read_metadata
from loom.checkpoint.storage import _TensorLayout
from loom.cli.main import main as cli_main

FOREIGN = "holds something other than checkpoint data"


class Payload:
    """Unpickled, it creates the file `marker`: what a crafted checkpoint would do, harmlessly."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def craft_metadata(checkpoint: Path, marker: Path) -> Path:
    """DCP's real metadata, with a payload that runs when unpickled by `pickle.load`."""
    path = checkpoint / "dcp" / ".metadata"
    metadata = read_metadata(path)
    metadata.storage_meta.modules = [Payload(marker)]
    path.write_bytes(pickle.dumps(metadata))
    rehash(checkpoint)
    return path


def craft_side_file(checkpoint: Path, name: str, marker: Path) -> Path:
    path = checkpoint / name
    state = torch.load(path, weights_only=True)
    state["payload"] = Payload(marker)
    torch.save(state, path)
    rehash(checkpoint)
    return path


def _cli(*args):
    return cli_main(["checkpoint", *map(str, args)])


# every way loom reads a checkpoint: (name, call with the checkpoint root and its step directory)
READERS = {
    "load_checkpoint": lambda root, step: load_checkpoint(root, trainer()),
    "load_from": lambda root, step: load_from(step, trainer()),
    "Checkpointer.resume": lambda root, step: Checkpointer(root).resume(trainer()),
    "export_model": lambda root, step: export_model(step, root.parent / "m.safetensors"),
    "read_model_tensors": lambda root, step: read_model_tensors(step),
    "load_model_weights": lambda root, step: load_model_weights(step, trainer().model),
}


def _refused(read, root, step):
    """The CheckpointError a reader raises (warnings of skipped checkpoints silenced)."""
    with warnings.catch_warnings(), pytest.raises(CheckpointError) as error:
        warnings.simplefilter("ignore")
        read(root, step)
    return str(error.value)


@pytest.mark.parametrize("reader", sorted(READERS))
def test_crafted_metadata_runs_nothing(reader, tmp_path):
    root, marker = tmp_path / "ckpt", tmp_path / "pwned"
    step = saved(root)
    path = craft_metadata(step, marker)
    message = _refused(READERS[reader], root, step)
    assert not marker.exists()
    assert str(path) in message and FOREIGN in message and "io.open" in message, message
    assert "weights_only=False" not in message
    with open(path, "rb") as file:  # the payload is real: plain pickle, as torch's DCP reader, runs it
        pickle.load(file)
    assert marker.exists()


@pytest.mark.parametrize("command", ["export", "verify"])
def test_crafted_metadata_cli(command, tmp_path, capsys):
    root, marker = tmp_path / "ckpt", tmp_path / "pwned"
    path = craft_metadata(saved(root), marker)
    args = (root, tmp_path / "m.safetensors") if command == "export" else (root,)
    assert _cli(command, *args) == 1
    out = capsys.readouterr()
    assert not marker.exists()
    assert str(path) in out.out + out.err and FOREIGN in out.out + out.err, out
    if command == "verify":
        assert "SUSPICIOUS" in out.out


@pytest.mark.parametrize("name", ["train_state.pt", "rank_00000.pt"])
def test_crafted_side_file_runs_nothing(name, tmp_path):
    root, marker = tmp_path / "ckpt", tmp_path / "pwned"
    path = craft_side_file(saved(root), name, marker)
    message = _refused(READERS["load_checkpoint"], root, None)
    assert not marker.exists()
    assert str(path) in message and FOREIGN in message and "weights_only=False" not in message, message
    assert _cli("verify", root) == 1 and not marker.exists()


def test_crafted_saved_value_runs_nothing(tmp_path, capsys):
    """A Python value DCP saved (an optimizer setting) holding a payload: DCP's own planner would load it
    with weights_only=False; loom's loads it weights-only."""
    root, marker = tmp_path / "ckpt", tmp_path / "pwned"
    step = saved(root, lr=Payload(marker))  # saving pickles the payload; only loading would run it
    message = _refused(READERS["load_from"], root, step)
    assert not marker.exists()
    assert "optim.param_groups.0.lr" in message and FOREIGN in message, message
    assert _cli("verify", step) == 1 and not marker.exists()
    assert "optim.param_groups.0.lr" in capsys.readouterr().out


def test_storage_outside_dcp_is_refused(tmp_path):
    """A metadata entry naming a file outside dcp/ would make a load read any file on the machine."""
    root = tmp_path / "ckpt"
    step = saved(root)
    path = step / "dcp" / ".metadata"
    metadata = read_metadata(path)
    for info in metadata.storage_data.values():
        object.__setattr__(info, "relative_path", "../../../../etc/passwd")
    path.write_bytes(pickle.dumps(metadata))
    rehash(step)
    message = _refused(READERS["load_from"], root, step)
    assert str(path) in message and "'../../../../etc/passwd' is not a file name inside dcp/" in message


def test_tensor_layout_parser_builds_nothing_else(tmp_path):
    """storage.DirectReader parses each saved tensor's pickled layout itself: a payload there raises (and
    DCP's weights-only reader then refuses the item) instead of running."""
    marker = tmp_path / "pwned"
    with pytest.raises(pickle.UnpicklingError, match="is not part of a plain tensor"):
        _TensorLayout(io.BytesIO(pickle.dumps(Payload(marker)))).load()
    assert not marker.exists()


def test_verify_reports_what_it_checked(tmp_path, capsys):
    root = tmp_path / "ckpt"
    step = saved(root)
    assert _cli("verify", root) == 0
    out = capsys.readouterr().out
    for line in (
        "ok",
        "sizes and xxh3_128 checksums match",
        "dcp/.metadata: DCP metadata only",
        "plain data",
    ):
        assert line in out, out
    data = next((step / "dcp").glob("*.distcp"))
    blob = bytearray(data.read_bytes())
    blob[len(blob) // 2] ^= 0xFF  # bit rot: the manifest catches it
    data.write_bytes(bytes(blob))
    assert _cli("verify", step) == 1
    out = capsys.readouterr()
    assert "DAMAGED" in out.out and f"{data}: checksum mismatch" in out.out, out


def test_plain_loads_still_work(tmp_path):
    """The safe readers read what loom writes: resume and export."""
    root = tmp_path / "ckpt"
    step = saved(root)
    assert load_checkpoint(root, trainer()) == 1
    assert export_model(step, tmp_path / "m.pt") == 4
    assert json.loads((step / "plan.json").read_text())["world_size"] == 1


def test_private_dcp_names_exist():
    """Fails loudly when PyTorch moves a private name the safe metadata reader admits (_torch_private)."""
    from loom.dist import _torch_private

    names = _torch_private.dcp_metadata_private_globals()
    assert all(value is not None for value in names.values())
    assert callable(_torch_private.set_nested)


@pytest.mark.parametrize("name", ["../../../../etc/passwd", "/etc/passwd"])
def test_manifest_naming_files_outside_is_refused(name, tmp_path, capsys):
    """A manifest listing a file outside its checkpoint would have verification read any file."""
    step = saved(tmp_path / "ckpt")
    path = step / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["files"][name] = {"size": 1, "xxh3_128": "0", "rank": 0}
    path.write_text(json.dumps(manifest))
    assert _cli("verify", step) == 1
    out = capsys.readouterr().out
    assert (
        f"{path}: not a loom checkpoint manifest (file {name!r} is not a path inside the checkpoint)" in out
    )
