"""Tier 1: `loom train` refuses every bad input before it starts a worker, naming the key, the value and a
fix; and the supervisor does not retry an error that a restart cannot fix, nor crash on its events file.

Every case here runs in-process in milliseconds: nothing is spawned (a case that reached the workers would
fail the test by taking seconds and returning another status)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import pytest

from loom.cli.main import main
from loom.dist.launch import WorkerError
from loom.fault import supervisor
from loom.fault.supervisor import RestartPolicy, supervise

DEMO = "configs/demo.toml"  # dp 2 x tp 2 on 4 workers, sequence parallel, 2 layers, global batch 32


def _file(tmp: Path, name: str, data: bytes = b"") -> str:
    (tmp / name).write_bytes(data)
    return str(tmp / name)


# (overrides, the substrings the message must hold: the key and value, then the fix); "{tmp}" is a fresh
# folder, "{file}" a file in it, "{odd}" a 3-byte token file.
CASES = {
    "type_text_for_int": (["--train.steps", "abc"], ["train.steps = 'abc'", "is not an integer"]),
    "type_float_for_int": (["--parallel.tp", "1.5"], ["parallel.tp = '1.5'", "is not an integer"]),
    "type_bool": (["--checkpoint.async_save", "maybe"], ["checkpoint.async_save = 'maybe'", "true or false"]),
    "range_steps": (["--train.steps", "0"], ["train.steps = 0", "use a value >= 1"]),
    "range_lr": (["--train.lr", "-1"], ["train.lr = -1.0", "use a value > 0"]),
    "range_min_lr": (["--train.min_lr", "1"], ["train.min_lr = 1.0", "must not exceed train.lr"]),
    "range_dropout": (["--model.dropout", "1"], ["model.dropout = 1.0", "[0, 1)"]),
    "range_optimizer_level": (
        ["--parallel.optimizer_level", "4"],
        ["parallel.optimizer_level = 4", "use 0 (none), 1 (states)"],
    ),
    "range_betas": (["--train.betas", "0.9,1.5"], ["train.betas = (0.9, 1.5)", "two numbers in (0, 1)"]),
    "choice": (
        ["--model.norm", "batchnorm"],
        ["model.norm = 'batchnorm'", "use one of ('layernorm', 'rmsnorm')"],
    ),
    "unknown_key": (["--train.stpes", "5"], ["'train.stpes'", "did you mean 'train.steps'"]),
    "unknown_section": (["--trian.steps", "5"], ["'trian'", "did you mean 'train'"]),
    "override_without_value": (["--train.steps"], ["'--train.steps' has no value", "--section.key VALUE"]),
    "tp_heads": (
        ["--parallel.tp", "3", "--parallel.dp", "-1", "--train.workers", "3"],
        ["parallel.tp = 3 must divide model.n_heads = 4", "choose tp in [1, 2, 4]"],
    ),
    "tp_vocab": (
        ["--model.vocab_size", "257"],
        ["model.vocab_size", "= 257", "choose tp in [1] or change model.vocab_size"],
    ),
    "tp_d_ff": (["--model.d_ff", "513"], ["model.d_ff (MLP size) = 513", "choose tp in"]),
    "mesh_does_not_fill": (
        ["--train.workers", "3"],
        [
            "parallel.dp = 2",
            "dp * tp * pp * cp = 2 * 2 * 1 * 1 does not fill 3 devices",
            "make the product 3",
        ],
    ),
    "global_batch": (["--train.global_batch", "33"], ["train.global_batch = 33", "use a multiple of 2"]),
    "global_batch_accum": (
        ["--train.global_batch", "34", "--train.grad_accum", "4"],
        ["train.global_batch = 34", "dp * grad_accum = 2 * 4", "use a multiple of 8"],
    ),
    "seq_len_over_max": (
        ["--data.seq_len", "64"],
        ["data.seq_len = 64 exceeds model.max_seq_len = 32", "raise"],
    ),
    "sequence_parallel_cut": (
        ["--data.seq_len", "31"],
        ["data.seq_len = 31", "parallel.tp = 2", "set sequence_parallel = false"],
    ),
    "byte_vocab": (["--model.vocab_size", "128"], ["model.vocab_size = 128", "set model.vocab_size >= 256"]),
    "pp_microbatches": (
        ["--parallel.pp", "2", "--parallel.dp", "1"],
        ["parallel.microbatches = 1", "for 2 pipeline stages", "use >= 2"],
    ),
    "pp_interleaved_layers": (
        [
            "--parallel.pp",
            "2",
            "--parallel.dp",
            "1",
            "--parallel.schedule",
            "interleaved",
            "--parallel.microbatches",
            "4",
        ],
        ["parallel.pp = 2: schedule 'interleaved'", "raise model.n_layers or lower pp"],
    ),  # fmt: skip
    "pp_over_layers": (
        ["--parallel.pp", "4", "--parallel.dp", "1", "--parallel.tp", "1", "--parallel.microbatches", "4"],
        ["parallel.pp = 4 exceeds model.n_layers = 2", "lower pp"],
    ),
    "pp_rows_per_microbatch": (
        ["--parallel.pp", "2", "--parallel.dp", "1", "--parallel.microbatches", "3"],
        ["32 rows", "parallel.microbatches = 3", "change global_batch or microbatches"],
    ),
    "tokens_without_path": (["--data.kind", "tokens"], ["data.kind = 'tokens' needs data.path", "set it"]),
    "missing_tokens_file": (
        ["--data.kind", "tokens", "--data.path", "{tmp}/missing.bin"],
        ["data.path = '{tmp}/missing.bin' does not exist", "point data.path at a token file"],
    ),
    "missing_text_file": (
        ["--data.kind", "text", "--data.path", "{tmp}/missing.txt"],
        ["data.path = '{tmp}/missing.txt' does not exist", "point data.path at a UTF-8 text file"],
    ),
    "data_path_is_a_directory": (
        ["--data.kind", "text", "--data.path", "{tmp}"],
        ["data.path = '{tmp}' is a directory", "point data.path at"],
    ),
    "token_file_odd_size": (
        ["--data.kind", "tokens", "--data.path", "{odd}"],
        ["data.path = '{odd}' has 3 bytes", "set data.dtype to the dtype the file was written with"],
    ),
    "checkpoint_dir_is_a_file": (
        ["--checkpoint.dir", "{file}"],
        ["checkpoint.dir = '{file}'", "is an existing file, not a directory", "move the file away"],
    ),
    "checkpoint_dir_under_a_file": (
        ["--checkpoint.dir", "{file}/ckpt"],
        ["checkpoint.dir = '{file}/ckpt'", "is a file, so the directory cannot be created"],
    ),
    "checkpoint_every_without_dir": (
        ["--checkpoint.every_steps", "10"],
        ["checkpoint.every_steps / every_minutes are set but checkpoint.dir is not", "set dir"],
    ),
    "metrics_file_is_a_directory": (
        ["--train.metrics_file", "{tmp}"],
        ["train.metrics_file = '{tmp}' is a directory", "name a file"],
    ),
    "tensorboard_dir_is_a_file": (
        ["--train.tensorboard_dir", "{file}"],
        ["train.tensorboard_dir = '{file}'", "not a directory"],
    ),
    "rollback_needs_skip": (
        ["--fault.skip_nonfinite", "false"],
        ["fault.rollback_after counts skipped steps", "fault.skip_nonfinite = true"],
    ),
    "negative_timeout": (["--fault.collective_timeout_s", "0"], ["fault.collective_timeout_s = 0.0", "> 0"]),
}


def _fill(text: str, tmp: Path) -> str:
    return text.format(tmp=tmp, file=tmp / "a_file", odd=tmp / "odd.bin")


@pytest.mark.parametrize("case", list(CASES))
def test_bad_config_is_refused_before_workers_start(case, tmp_path, capfd):
    _file(tmp_path, "a_file", b"not a directory")
    _file(tmp_path, "odd.bin", b"\x01\x02\x03")
    overrides, expected = CASES[case]
    code = main(["train", DEMO, *[_fill(arg, tmp_path) for arg in overrides]])
    captured = capfd.readouterr()
    assert code == 2, captured.out + captured.err
    assert "plan:" not in captured.out  # no worker started
    for text in expected:
        assert _fill(text, tmp_path) in captured.err, captured.err


@pytest.mark.parametrize(
    ("toml", "expected"),
    [
        ("[train]\nsteps = '100'\n", ["train.steps = '100' is str", "expected an integer"]),
        ("[trian]\nsteps = 1\n", ["unknown section 'trian'", "did you mean 'train'"]),
        ("[train]\nsteps = \n", ["is not valid TOML"]),
        ("train = 3\n", ["[train] in", "must be a table of keys"]),
    ],
    ids=["type_in_file", "unknown_section_in_file", "invalid_toml", "section_not_a_table"],
)
def test_bad_config_file_is_refused(toml, expected, tmp_path, capfd):
    path = tmp_path / "bad.toml"
    path.write_text(toml)
    assert main(["train", str(path)]) == 2
    err = capfd.readouterr().err
    assert all(text in err for text in expected), err


def test_missing_config_file_is_named(tmp_path, capfd):
    assert main(["train", str(tmp_path / "nope.toml")]) == 2
    assert f"config file '{tmp_path / 'nope.toml'}' does not exist" in capfd.readouterr().err


def test_unwritable_checkpoint_dir_is_refused(tmp_path, capfd, monkeypatch):
    target = tmp_path / "locked"
    target.mkdir()
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: False if Path(p) == target else real(p, mode))
    assert main(["train", DEMO, "--checkpoint.dir", str(target / "ckpt")]) == 2
    err = capfd.readouterr().err
    assert f"no permission to write in '{target}'" in err and "choose a directory you can write to" in err


@pytest.mark.parametrize(
    ("faults", "expected"),
    [
        ("not json", ["LOOM_FAULTS='not json'", "expected a JSON list like"]),
        ('[{"kind": "boom", "rank": 0}]', ["fault kind 'boom'", "choose one of"]),
        (
            '[{"kind": "raise", "rank": 0, "during": "startup", "phase": "napping"}]',
            ["unknown start-up phase 'napping'", "choose one of"],
        ),
    ],
    ids=["not_json", "unknown_kind", "unknown_phase"],
)
def test_bad_fault_injection_is_refused(faults, expected, capfd, monkeypatch):
    monkeypatch.setenv("LOOM_FAULTS", faults)
    assert main(["train", DEMO]) == 2
    err = capfd.readouterr().err
    assert all(text in err for text in expected), err


def test_step_faults_with_pipelines_are_refused_before_start(capfd, monkeypatch):
    monkeypatch.setenv("LOOM_FAULTS", '[{"kind": "raise", "rank": 0, "step": 2}]')
    assert (
        main(["train", DEMO, "--parallel.pp", "2", "--parallel.dp", "1", "--parallel.microbatches", "2"]) == 2
    )
    assert "which pipeline runs (parallel.pp > 1) do not call yet" in capfd.readouterr().err


def test_help_lists_every_config_key_with_its_default(capsys):
    from loom.train.config import _SECTIONS

    assert main(["train", "--help"]) == 0
    out = capsys.readouterr().out
    for name, cls in _SECTIONS.items():
        for key in cls.field_types():
            assert f"{name}.{key} = " in out, key
    assert "train.steps = 300" in out and "checkpoint.dir = none" in out and "(layernorm | rmsnorm)" in out


# ---- the supervisor: errors a restart cannot fix --------------------------------------------------------------


@dataclass
class _Beat:
    step: int | None


class _FakeGroup:
    """Stands in for `WorkerGroup`: each attempt raises the next error, after rank 0 reported step 3."""

    errors: list[BaseException] = []
    attempts = 0

    def __init__(self, nprocs: int, backend: str | None = None, *, env: dict) -> None:
        self.heartbeats = {0: _Beat(3)}

    def __enter__(self) -> _FakeGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def run(self, fn, *args, **kwargs):
        type(self).attempts += 1
        if self.errors:
            raise self.errors.pop(0)
        return ["done"]


def _worker_error(cause: BaseException) -> WorkerError:
    error = WorkerError(
        f"rank 0 raised {type(cause).__name__} while training: {cause}",
        rank=0,
        exc_type=type(cause).__qualname__,
        failed_ranks=[0],
    )
    error.__cause__ = cause
    return error


@pytest.fixture
def fake_group(monkeypatch):
    monkeypatch.setattr(supervisor, "WorkerGroup", _FakeGroup)
    _FakeGroup.attempts = 0
    return _FakeGroup


@pytest.mark.parametrize(
    "cause",
    [
        NotADirectoryError(20, "Not a directory", "runs/ckpt/step_000002"),
        FileExistsError(17, "File exists", "runs/ckpt"),
        PermissionError(13, "Permission denied", "/ckpt"),
        ValueError("parallel.tp = 3 must divide model.n_heads = 4"),
    ],
    ids=lambda e: type(e).__name__,
)
def test_errors_a_restart_cannot_fix_are_not_retried(cause, fake_group, tmp_path):
    fake_group.errors = [_worker_error(cause)]
    lines: list[str] = []
    policy = RestartPolicy(max_restarts=3, events_file=tmp_path / "events.jsonl")
    with pytest.raises(WorkerError):
        supervise(lambda: None, 2, policy=policy, log=lines.append)
    assert fake_group.attempts == 1
    assert "not retried: a restart cannot fix this error" in lines[0]
    assert (tmp_path / "events.jsonl").read_text().count("\n") == 1


def test_other_errors_after_the_first_step_are_retried(fake_group):
    fake_group.errors = [_worker_error(RuntimeError("NCCL timeout"))]
    lines: list[str] = []
    done = supervise(lambda: None, 2, policy=RestartPolicy(max_restarts=1), log=lines.append)
    assert done.results == ["done"] and fake_group.attempts == 2 and "restarting" in lines[0]


def test_an_unwritable_events_file_is_logged_not_fatal(fake_group, tmp_path):
    blocker = tmp_path / "ckpt"
    blocker.write_text("a file where the checkpoint directory should be")
    fake_group.errors = [_worker_error(RuntimeError("a worker died"))]
    lines: list[str] = []
    policy = RestartPolicy(max_restarts=1, events_file=blocker / "events.jsonl")
    done = supervise(lambda: None, 2, policy=policy, log=lines.append)
    assert done.results == ["done"]
    assert any("could not append the event to" in line and "logged only" in line for line in lines), lines
