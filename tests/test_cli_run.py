"""Tier 3: `loom run` end to end, in-process through `loom.cli.main.main` (the workers are real processes;
capfd sees their output because they write to this process's file descriptors)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from loom.cli import run as run_command
from loom.cli.main import main
from loom.dist.env import free_port

# Each rank all-reduces its rank id and prints one line; "--fail R" makes rank R raise, "--exit R C"
# makes rank R call sys.exit(C).
SCRIPT = textwrap.dedent(
    """
    import sys

    import torch
    import torch.distributed as dist

    import loom
    from loom.dist.env import device_type

    loom.init()
    rank = dist.get_rank()
    total = torch.tensor([float(rank)], device=device_type())
    dist.all_reduce(total)
    print(f"rank {rank}/{dist.get_world_size()} sum={total.item():g} argv={sys.argv[1:]}")
    if "--fail" in sys.argv and rank == int(sys.argv[sys.argv.index("--fail") + 1]):
        raise RuntimeError(f"script failed on purpose on rank {rank}")
    if "--exit" in sys.argv and rank == int(sys.argv[sys.argv.index("--exit") + 1]):
        sys.exit(int(sys.argv[sys.argv.index("--exit") + 2]))
    sys.exit(0)
    """
)


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "allreduce.py"
    path.write_text(SCRIPT)
    return path


def test_run_executes_the_script_on_every_rank(script, capfd):
    assert main(["run", "-n", "2", str(script), "--tag", "x"]) == 0
    out = capfd.readouterr().out
    for rank in range(2):
        assert f"rank {rank}/2 sum=1 argv=['--tag', 'x']" in out


def test_failing_script_exits_1_and_names_the_rank(script, capfd):
    assert main(["run", "-n", "2", "--timeout", "120", str(script), "--fail", "1"]) == 1
    err = capfd.readouterr().err
    assert "failed on rank 1" in err
    assert "RuntimeError: script failed on purpose on rank 1" in err
    assert f'File "{script}", line' in err  # the worker's traceback reaches the user


def test_script_exit_status_is_passed_on(script, capfd):
    assert main(["run", "-n", "2", str(script), "--exit", "1", "3"]) == 3
    assert "rank 1 exited with status 3" in capfd.readouterr().err


def test_missing_script_is_reported_before_any_process_starts(tmp_path, capsys, monkeypatch):
    def no_launch(*args, **kwargs):
        raise AssertionError("launch must not be called")

    monkeypatch.setattr(run_command, "launch", no_launch)
    missing = tmp_path / "missing.py"
    assert main(["run", "-n", "2", str(missing)]) == 2
    err = capsys.readouterr().err
    assert "script not found" in err and str(missing) in err


def test_help_shows_examples(capsys):
    assert main(["--help"]) == 0
    assert "loom run -n 2 train.py" in capsys.readouterr().out
    assert main(["run", "--help"]) == 0
    out = capsys.readouterr().out
    assert "examples:" in out and "--backend" in out and "loom.init()" in out


def test_module_entry_point_runs():
    # `python -m loom.cli.main` needs the `__main__` guard; the child may import what we can.
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    done = subprocess.run(
        [sys.executable, "-m", "loom.cli.main", "run", "--help"], capture_output=True, text=True, env=env
    )
    assert done.returncode == 0, done.stderr
    assert "usage: loom run" in done.stdout


def test_loom_init_under_plain_torchrun(script):
    """The same script under torchrun's own launcher and rendezvous (RANK, WORLD_SIZE, MASTER_ADDR, ...)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p), OMP_NUM_THREADS="1")
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
         str(script), "--tag", "t"],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    for rank in range(2):
        assert f"rank {rank}/2 sum=1 argv=['--tag', 't']" in done.stdout
