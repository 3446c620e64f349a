"""What each rank writes and checks: at optimizer levels 1-3 its own chunks (no collective gathers them), its
files hashed as it writes them (no second pass on rank 0), and at load the checksums of its share of the
files."""

import math
import shutil
import warnings

import pytest
import torch
from checkpoint_cases import setup
from torch.distributed.tensor.debug import CommDebugMode

from loom.checkpoint import load_checkpoint, read_manifest, save_checkpoint, verify
from loom.checkpoint import manifest as mf
from loom.checkpoint.chunks import flat_range_boxes
from loom.dist import env
from loom.dist.comm import collective_counts


@pytest.mark.parametrize("shape", [(7,), (3, 4), (2, 3, 4), (4, 1, 3)])
def test_a_flat_range_is_a_few_contiguous_boxes(shape):
    """Every range [lo, hi) of a C-ordered tensor: its boxes cover it exactly, each is a contiguous run
    in order, and there are at most 2 * dims - 1 of them."""
    n = math.prod(shape)
    order = torch.arange(n).view(shape)
    for lo in range(n + 1):
        for hi in range(lo, n + 1):
            boxes = flat_range_boxes(shape, lo, hi)
            covered = torch.cat(
                [
                    order[tuple(slice(o, o + s) for o, s in zip(*box, strict=True))].reshape(-1)
                    for box in boxes
                ]
                or [torch.empty(0, dtype=torch.long)]
            )
            assert torch.equal(covered, torch.arange(lo, hi)), (shape, lo, hi, boxes)
            assert len(boxes) <= 2 * len(shape) - 1


def save_collectives_case(root, level):
    """The collectives a save issues after two steps at `level` on dp=2, by kind, and the files."""
    _, trainer, data = setup(2, 1, level)
    for _ in range(2):
        trainer.train_step([next(data)])
    with CommDebugMode() as comm:
        path = save_checkpoint(f"{root}/level{level}", trainer, data=data)
    return collective_counts(comm), {
        name: entry["rank"] for name, entry in read_manifest(path)["files"].items()
    }


def test_levels_1_and_3_save_without_gathering(dist_run, tmp_path):
    """A save at level 1 or 3 issues exactly the collectives of a level-0 save (the planning and the one
    agreement; the old path added an all-gather per bucket and state), and every rank wrote a DCP file."""
    reference, _ = dist_run(2, save_collectives_case, str(tmp_path), 0)[0]
    for level in (1, 3):
        counts, writers = dist_run(2, save_collectives_case, str(tmp_path), level)[0]
        assert counts == reference, (level, counts, reference)
        assert writers["dcp/__0_0.distcp"] == 0 and writers["dcp/__1_0.distcp"] == 1
        assert not verify(tmp_path / f"level{level}" / "step_000002")


def hashed_while_writing_case(root):
    """Saves with the manifest's hashing pass (`checksum_of`) counting its calls: none."""
    _, trainer, data = setup(2, 1, 1)
    trainer.train_step([next(data)])
    calls = []
    original = mf.checksum_of
    mf.checksum_of = lambda path, *args: calls.append(path) or original(path, *args)
    try:
        path = save_checkpoint(root, trainer, data=data)
    finally:
        mf.checksum_of = original
    crc = torch.serialization.get_crc32_options()  # switched off for DCP's archives during the save only
    return calls, read_manifest(path)["files"] if env.rank() == 0 else None, crc


def test_every_rank_hashes_what_it_writes(dist_run, tmp_path):
    (calls, files, crc), (other_calls, _, other_crc) = dist_run(2, hashed_while_writing_case, str(tmp_path))
    assert calls == [] and other_calls == []  # no pass over the files after writing them
    assert crc and other_crc
    assert {name: entry["rank"] for name, entry in files.items()} == {
        "dcp/.metadata": 0,
        "dcp/__0_0.distcp": 0,
        "dcp/__1_0.distcp": 1,
        "plan.json": 0,
        "rank_00000.pt": 0,
        "rank_00001.pt": 1,
        "train_state.pt": 0,
    }
    assert not verify(tmp_path / "step_000001")  # the sizes and checksums reported are the files'


def two_saves_case(root):
    _, trainer, data = setup(2, 1, 0)
    for _ in range(2):
        trainer.train_step([next(data)])
        save_checkpoint(root, trainer, data=data)


def verified_load_case(root):
    """Load, recording which files this rank checksums; rank 0's warnings."""
    _, trainer, data = setup(2, 1, 0)
    hashed = []
    original = mf.checksum_of
    mf.checksum_of = lambda path, *args: hashed.append(path.name) or original(path, *args)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            step = load_checkpoint(root, trainer, data=data)
    finally:
        mf.checksum_of = original
    return {"step": step, "hashed": hashed, "warnings": [str(w.message) for w in caught]}


def test_each_rank_verifies_its_share_and_a_corrupt_file_is_named(dist_run, tmp_path):
    """Rank 1's DCP file of the newest checkpoint is corrupt: rank 1, which checks the files rank 1 wrote,
    finds it; every rank falls back to the previous checkpoint, and rank 0's warning names the file."""
    source = tmp_path / "saved"
    dist_run(2, two_saves_case, str(source))
    root = tmp_path / "ckpt"
    shutil.copytree(source, root)
    shard = root / "step_000002" / "dcp" / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    first, second = dist_run(2, verified_load_case, str(root))
    assert first["step"] == second["step"] == 1
    assert "__1_0.distcp" in second["hashed"] and "__1_0.distcp" not in first["hashed"]
    assert "__0_0.distcp" in first["hashed"] and "__0_0.distcp" not in second["hashed"]
    assert any(
        "step_000002" in w and "__1_0.distcp" in w and "checksum mismatch" in w for w in first["warnings"]
    )


def test_the_direct_reader_reads_what_dcp_reads(tmp_path, monkeypatch):
    """On one process: pieces, a scalar, integers, bf16 and a transposed (non-contiguous) tensor saved by DCP
    read back alike by DCP's reader and by `DirectReader`, which reads all but the transposed one directly
    (a part of a saved box included)."""
    import torch.distributed.checkpoint as dcp

    from loom.checkpoint import storage
    from loom.checkpoint.chunks import Piece, Pieces, PiecesLoadPlanner, PiecesSavePlanner

    cube = torch.arange(24.0).view(2, 3, 4)
    saved = {
        "cube": Pieces((2, 3, 4), torch.float32, (Piece((0, 0, 0), cube[:1]), Piece((1, 0, 0), cube[1:]))),
        "scalar": torch.tensor(3.0),
        "ints": torch.arange(10),
        "half": torch.randn(100, dtype=torch.bfloat16),
        "transposed": torch.arange(6.0).view(2, 3).t(),
    }

    def template():
        target = torch.zeros(2, 3, 4)
        boxes = (Piece((0, 1, 0), target[:1, 1:3]), Piece((1, 0, 0), target[1:]))
        state = {"cube": Pieces((2, 3, 4), torch.float32, boxes), "scalar": torch.tensor(0.0)}
        state.update(ints=torch.zeros(10, dtype=torch.long), half=torch.zeros(100, dtype=torch.bfloat16))
        state["transposed"] = torch.zeros(3, 2)
        return state, target

    direct = []
    read_into = storage._read_into
    monkeypatch.setattr(
        storage, "_read_into", lambda *args: direct.append(result := read_into(*args)) or result
    )
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save({"s": saved}, checkpoint_id=tmp_path, planner=PiecesSavePlanner(), no_dist=True)
        ours, ours_cube = template()
        reader = storage.DirectReader(tmp_path)
        dcp.load({"s": ours}, storage_reader=reader, planner=PiecesLoadPlanner(), no_dist=True)
        theirs, theirs_cube = template()
        monkeypatch.setattr(storage, "_read_into", read_into)
        dcp.load({"s": theirs}, checkpoint_id=tmp_path, planner=PiecesLoadPlanner(), no_dist=True)
    assert torch.equal(ours_cube, theirs_cube) and torch.equal(ours_cube[1], cube[1])
    assert torch.equal(ours_cube[0, 1:3], cube[0, 1:3]) and not ours_cube[0, 0].any()
    for key in ("scalar", "ints", "half", "transposed"):
        assert torch.equal(ours[key], theirs[key]) and torch.equal(ours[key], saved[key]), key
    assert sorted(direct) == [False, True, True, True, True, True]  # the transposed tensor: DCP's path


def test_manifests_of_earlier_versions_verify(tmp_path):
    """A manifest whose entries carry sha256 (as loom wrote them before XXH3-128) still verifies."""
    import hashlib
    import json

    (tmp_path / "data.bin").write_bytes(b"weights")
    entry = {"size": 7, "sha256": hashlib.sha256(b"weights").hexdigest()}
    manifest = {"format": mf.FORMAT_VERSION, "step": 1, "files": {"data.bin": entry}}
    (tmp_path / mf.MANIFEST).write_text(json.dumps(manifest))
    assert verify(tmp_path) == []
    (tmp_path / "data.bin").write_bytes(b"weighty")
    assert verify(tmp_path) == [f"{tmp_path / 'data.bin'}: checksum mismatch (corrupt)"]


def test_checksums_of_mapped_and_empty_files_agree_with_the_bytes(tmp_path):
    """`checksum_of` hashes a file where it lies (mapped); an empty file, which cannot be mapped, is read."""
    import hashlib

    import xxhash

    for name, data in (("data.bin", bytes(range(256)) * 5000), ("empty.bin", b"")):
        (tmp_path / name).write_bytes(data)
        assert mf.checksum_of(tmp_path / name) == xxhash.xxh3_128(data).hexdigest()
        assert mf.checksum_of(tmp_path / name, "sha256") == hashlib.sha256(data).hexdigest()


def test_load_arena_tensors_have_storages_of_their_own():
    """A load's optimizer states come from one mapping, each on a storage of its own size (DCP's writer would
    copy a view of a larger one), 64-byte aligned, zero until written, alive after the arena object."""
    import gc

    from loom.checkpoint.memory import Arena

    arena = Arena(Arena.size(10, torch.float32) + Arena.size(3, torch.int64))
    floats, ints = arena.empty(10, torch.float32), arena.empty(3, torch.int64)
    assert floats.untyped_storage().nbytes() == 40 and ints.untyped_storage().nbytes() == 24
    assert floats.data_ptr() % 64 == 0 and ints.data_ptr() % 64 == 0 and not floats.any()
    with pytest.raises(ValueError, match="no room"):
        arena.empty(1, torch.float32)
    floats.fill_(1.5)
    del arena
    gc.collect()
    assert floats.sum().item() == 15.0 and ints.dtype == torch.int64


def unsaved_chunk_states_case(root):
    """Level 0 saves without one parameter's states; level 1 loads: that parameter's states are zero (a fresh
    state's), every other one's the saved ones."""
    from checkpoint_cases import whole_states

    model, trainer, data = setup(2, 1, 0)
    for _ in range(2):
        trainer.train_step([next(data)])
    first = next(iter(model.parameters()))
    del trainer.optimizer.state[first]
    save_checkpoint(root, trainer, data=data)
    saved = whole_states(model, trainer.optimizer)
    model, trainer, data = setup(2, 1, 1)
    load_checkpoint(root, trainer, data=data)
    loaded = {}
    trainer.optimizer.on_build(lambda: loaded.update(whole_states(model, trainer.optimizer)))
    trainer.train_step([next(data)])
    name = next(iter(model.named_parameters()))[0]
    zero = all(not value.any() for key, value in loaded[name].items() if key != "step")
    same = all(
        torch.equal(loaded[other][key], value)
        for other, states in saved.items()
        for key, value in states.items()
    )
    return name not in saved, zero, same


def test_level_1_loads_zero_states_for_a_parameter_saved_without(dist_run, tmp_path):
    assert dist_run(2, unsaved_chunk_states_case, str(tmp_path)) == [(True, True, True)] * 2
