"""Bad inputs to the launcher (`loom.launch`, `loom.seed`, `loom run`): each is refused with a message that
names the offending value and the fix, before any worker starts where it can be. Also the launcher's
newcomer paths that used to fail: a script without the main guard, functions typed on stdin or defined
under the guard, `sys.exit` in a worker, a torchrun script's own `init_process_group` under `loom run`, and
the rendezvous store's listening address.

Cases that need processes run on the session pool (`dist_run`) where they can; three run a real Python
process, as a user would (a script without the guard, a script on stdin, `loom run`).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import types

import pytest
import torch
import torch.distributed as dist

import loom
from loom.cli.main import main
from loom.dist import launch as launch_module
from loom.dist.launch import WorkerError, launch


def _never_called(*args, **kwargs):
    raise AssertionError("no worker may start for a bad input")


@pytest.fixture
def no_spawn(monkeypatch):
    """Fail the test if any worker process would start."""
    monkeypatch.setattr(launch_module.WorkerGroup, "_start", _never_called)


def _two_args(a, b):
    return a + b


def _takes_seed(seed):
    return seed


# ------------------------------------------------------------------ loom.launch: refused before any worker

# (id, call, expected exception type, regex the message must match: the value and the fix)
LAUNCH_CASES = [
    ("nprocs-zero", lambda: launch(_two_args, 0, 1, 2), ValueError, r"nprocs must be a positive int.*got 0\. E\.g\. loom\.launch\(fn, 4\)"),
    ("nprocs-negative", lambda: launch(_two_args, -2, 1, 2), ValueError, r"got -2\. E\.g\. loom\.launch\(fn, 4\)"),
    ("nprocs-float", lambda: launch(_two_args, 2.0, 1, 2), TypeError, r"nprocs must be a positive int.*got 2\.0 \(float\)"),
    ("nprocs-str", lambda: launch(_two_args, "4", 1, 2), TypeError, r"got '4' \(str\)"),
    ("nprocs-bool", lambda: launch(_two_args, True, 1, 2), TypeError, r"got True \(bool\)"),
    ("fn-not-callable", lambda: launch("main", 2), TypeError, r"fn must be a callable.*got 'main' \(str\).*loom\.launch\(main, 4\)"),
    ("fn-and-nprocs-swapped", lambda: launch(4, _two_args), TypeError, r"got 4 \(int\)|fn first"),
    ("timeout-zero", lambda: launch(_two_args, 2, 1, 2, timeout=0), ValueError, r"timeout must be a positive number of seconds, or None for no limit; got 0"),
    ("timeout-negative", lambda: launch(_two_args, 2, 1, 2, timeout=-5), ValueError, r"got -5"),
    ("timeout-str", lambda: launch(_two_args, 2, 1, 2, timeout="10"), TypeError, r"timeout must be a number of seconds.*got '10' \(str\)"),
    ("timeout-nan", lambda: launch(_two_args, 2, 1, 2, timeout=float("nan")), TypeError, r"got nan"),
    ("timeout-inf", lambda: launch(_two_args, 2, 1, 2, timeout=float("inf")), TypeError, r"or None for no limit; got inf"),
    ("backend-unknown", lambda: launch(_two_args, 2, 1, 2, backend="glo"), ValueError, r"unknown backend 'glo'.*knows 'gloo'.*Use 'gloo' on CPUs"),
    ("backend-not-str", lambda: launch(_two_args, 2, 1, 2, backend=1), TypeError, r"backend must be a string.*got 1"),
    ("seed-negative", lambda: launch(_two_args, 2, 1, 2, seed=-1), ValueError, r"seed must be an int between 0 and 2\*\*64 - 1; got -1"),
    ("seed-float", lambda: launch(_two_args, 2, 1, 2, seed=1.5), TypeError, r"seed must be an int.*or None not to seed; got 1\.5 \(float\)"),
    ("args-do-not-bind", lambda: launch(_two_args, 2, 1, 2, 3), TypeError, r"_two_args\(a, b\) cannot be called with the arguments given \(args=\(1, 2, 3\).*too many positional"),
    ("kwarg-unknown", lambda: launch(_two_args, 2, 1, 2, c=3), TypeError, r"kwargs=\{'c': 3\}.*unexpected keyword argument 'c'"),
    ("seed-taken-by-launch", lambda: launch(_takes_seed, 2, seed=3), TypeError, r"missing a required argument: 'seed'.*keeps seed= for itself.*functools\.partial\(fn, seed=\.\.\.\)"),
    ("loom-seed-str", lambda: loom.seed("0"), TypeError, r"loom\.seed: n must be an int.*got '0' \(str\)"),
    ("loom-seed-too-big", lambda: loom.seed(2**64), ValueError, r"got 18446744073709551616"),
]  # fmt: skip

if not torch.cuda.is_available():
    LAUNCH_CASES.append(
        ("nccl-without-gpus", lambda: launch(_two_args, 2, 1, 2, backend="nccl"), ValueError,
         r"backend 'nccl' (needs one GPU per rank: nprocs=2 but torch sees 0 GPU\(s\); use backend='gloo'|is not available in this torch build .*use 'gloo')")
    )  # fmt: skip
if not dist.is_backend_available("mpi"):
    LAUNCH_CASES.append(
        ("backend-unavailable", lambda: launch(_two_args, 2, 1, 2, backend="mpi"), ValueError,
         r"backend 'mpi' is not available in this torch build.*use 'gloo'")
    )  # fmt: skip


@pytest.mark.parametrize(
    ("call", "error", "message"), [c[1:] for c in LAUNCH_CASES], ids=[c[0] for c in LAUNCH_CASES]
)
def test_launch_refuses_bad_input_before_any_worker_starts(no_spawn, call, error, message):
    with pytest.raises(error, match=message):
        call()


def test_unpicklable_argument_is_refused_before_any_worker_starts(no_spawn):
    import threading

    with pytest.raises(
        TypeError, match=r"cannot send .*_two_args and its arguments.*create the rest \(locks"
    ):
        launch(_two_args, 2, threading.Lock(), 1)


# ------------------------------------------------------------------ loom run: refused before any worker

RUN_CASES = [
    ("missing-script", ["run", "-n", "2", "{tmp}/missing.py"], r"script not found: .*/missing\.py \(no such file; nothing was started\)"),
    ("toml-not-a-script", ["run", "-n", "2", "{tmp}/demo.toml"], r"demo\.toml is not a Python script.*run `loom train .*demo\.toml`"),
    ("text-not-a-script", ["run", "-n", "2", "{tmp}/notes.txt"], r"notes\.txt is not a Python script \(loom run runs a \.py file"),
    ("directory", ["run", "-n", "2", "{tmp}"], r"is a directory, not a Python script; name the \.py file"),
    ("nprocs-zero", ["run", "-n", "0", "{tmp}/ok.py"], r"argument -n/--nprocs: must be a positive number of ranks, e\.g\. -n 4; got 0"),
    ("nprocs-negative", ["run", "-n", "-3", "{tmp}/ok.py"], r"-n/--nprocs: must be a positive number of ranks.*got -3"),
    ("nprocs-word", ["run", "-n", "two", "{tmp}/ok.py"], r"-n/--nprocs: must be a whole number of ranks, e\.g\. -n 4; got 'two'"),
    ("timeout-zero", ["run", "--timeout", "0", "{tmp}/ok.py"], r"--timeout: must be a positive number of seconds \(leave it out for no limit\); got 0"),
    ("timeout-word", ["run", "--timeout", "soon", "{tmp}/ok.py"], r"--timeout: must be a number of seconds, e\.g\. --timeout 600; got 'soon'"),
    ("seed-word", ["run", "--seed", "x", "{tmp}/ok.py"], r"--seed: must be an int between 0 and 2\*\*64 - 1, or 'none' not to seed; got 'x'"),
    ("backend-unknown", ["run", "--backend", "mpi", "{tmp}/ok.py"], r"--backend: invalid choice: 'mpi' \(choose from"),
]  # fmt: skip


@pytest.mark.parametrize(("argv", "message"), [c[1:] for c in RUN_CASES], ids=[c[0] for c in RUN_CASES])
def test_loom_run_refuses_bad_input_before_any_worker_starts(tmp_path, capsys, monkeypatch, argv, message):
    from loom.cli import run as run_command

    monkeypatch.setattr(run_command, "launch", _never_called)
    for name in ("ok.py", "demo.toml", "notes.txt"):
        (tmp_path / name).write_text("print('hi')\n")
    argv = [arg.replace("{tmp}", str(tmp_path)) for arg in argv]
    try:
        status = main(argv)
    except SystemExit as exc:  # argparse's own errors
        status = exc.code
    assert status == 2
    assert len(_search(message, capsys.readouterr().err)) == 1


def _search(pattern: str, text: str) -> list[str]:
    import re

    return [match.group(0) for match in re.finditer(pattern, text)]


# ------------------------------------------------------------------ sys.exit in a worker (session pool)


def _exit_on(rank_codes: dict[int, object]) -> int:
    code = rank_codes.get(dist.get_rank(), "return")
    if code == "return":
        return dist.get_rank()
    sys.exit(*(() if code == "no-arg" else (code,)))


@pytest.mark.parametrize("code", [0, None, "no-arg"], ids=["exit-0", "exit-None", "exit-no-arg"])
def test_sys_exit_zero_in_a_worker_returns_none(dist_run, code):
    assert dist_run(2, _exit_on, {1: code}) == [0, None]


@pytest.mark.parametrize(
    ("code", "shown"),
    [(3, "sys.exit(3)"), ("bad config", "sys.exit('bad config')")],
    ids=["exit-3", "exit-str"],
)
def test_sys_exit_nonzero_in_a_worker_names_the_rank_and_code(dist_run, code, shown):
    with pytest.raises(WorkerError) as info:
        dist_run(2, _exit_on, {1: code})
    message = str(info.value)
    assert message.startswith(f"rank 1 called {shown} while running")
    assert "return a value" in message and "raise an exception to report a failure" in message
    assert info.value.rank == 1 and info.value.exc_type == "SystemExit"


# ------------------------------------------------------------------ functions from __main__ (pool)

GUARDED_SCRIPT = textwrap.dedent(
    """
    import torch.distributed as dist

    def top_level():
        return "top"

    if __name__ == "__main__":
        def under_the_guard(x):
            return (dist.get_rank(), x * 2)
    """
)


def test_function_defined_under_the_main_guard_runs_in_workers(worker_pool, tmp_path, monkeypatch):
    # The pool's workers imported pytest's __main__, not this script: only a function sent by value reaches
    # them (by reference it was "Can't get attribute 'under_the_guard'").
    path = tmp_path / "guarded.py"
    path.write_text(GUARDED_SCRIPT)
    fake_main = types.ModuleType("__main__")
    fake_main.__file__ = str(path)
    exec(compile(GUARDED_SCRIPT, str(path), "exec"), fake_main.__dict__)
    monkeypatch.setitem(sys.modules, "__main__", fake_main)
    fn = fake_main.under_the_guard
    assert not launch_module._workers_import(fn) and launch_module._workers_import(fake_main.top_level)
    payload = launch_module._dump_task(fn, (21,), {})
    monkeypatch.undo()
    assert worker_pool.group(2)._run_payload(payload, "running under_the_guard", 120) == [(0, 42), (1, 42)]


# ------------------------------------------------------------------ as a user runs them: real processes


def _python(
    args: list[str], cwd, stdin: str | None = None, timeout: float = 240
) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    return subprocess.run(
        [sys.executable, *args],
        input=stdin,
        capture_output=True,
        text=True,
        cwd=cwd,
        env=env,
        timeout=timeout,
    )


UNGUARDED_SCRIPT = textwrap.dedent(
    """
    import loom

    def work():
        return loom.rank()

    print("importing the script")
    results = loom.launch(work, 2)
    print("results", results)
    """
)


def test_script_without_main_guard_is_explained_once(tmp_path):
    path = tmp_path / "unguarded.py"
    path.write_text(UNGUARDED_SCRIPT)
    done = _python([str(path)], tmp_path)
    assert done.returncode == 1
    expected = (
        f"{path}, line 8 (`results = loom.launch(work, 2)`) calls loom.launch at the top level of the script, "
        'without an `if __name__ == "__main__":` guard.'
    )
    assert done.stderr.count(expected) == 1, done.stderr
    assert '    if __name__ == "__main__":\n        results = loom.launch(work, 2)\n' in done.stderr
    # Not multiprocessing's bootstrapping error from every rank, nor a hint about memory.
    assert "RuntimeError" not in done.stderr and "out of memory" not in done.stderr
    assert done.stderr.count("Traceback") == 1  # the caller's, one frame deep in loom
    assert "results" not in done.stdout


STDIN_SCRIPT = textwrap.dedent(
    """
    import torch, loom

    class Scaled:
        def __init__(self, value):
            self.value = value

    def work(k):
        return Scaled(torch.randn(2) * k), loom.rank()

    results = loom.launch(work, 2, 10)
    assert all(type(r) is Scaled for r, _ in results)
    print("ranks", [rank for _, rank in results], "same", torch.equal(results[0][0].value, results[1][0].value))
    print("lambda", loom.launch(lambda: loom.world_size(), 1))
    """
)


def test_functions_typed_on_stdin_run_in_workers(tmp_path):
    # `python - < script`: __main__.__file__ is "<stdin>", which spawn used to run in every worker
    # (FileNotFoundError); the functions now travel by value, a lambda too.
    done = _python(["-"], tmp_path, stdin=STDIN_SCRIPT)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "ranks [0, 1] same True" in done.stdout  # seeded alike
    assert "lambda [1]" in done.stdout


PACKAGE_MAIN = textwrap.dedent(
    """
    import loom

    def world():
        return loom.world_size()

    if __name__ == "__main__":
        print("package", loom.launch(world, 2))
    """
)


def test_a_package_run_with_python_m_launches(tmp_path):
    # `python -m package`: multiprocessing imports no __main__.py in the workers, so its functions travel
    # by value (by reference they would be looked up in a __main__ that has none: "Can't get attribute")
    package = tmp_path / "mypackage"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "__main__.py").write_text(PACKAGE_MAIN)
    done = _python(["-m", "mypackage"], tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "package [2, 2]" in done.stdout


TORCHRUN_SCRIPT = textwrap.dedent(
    """
    import os
    import torch
    import torch.distributed as dist

    dist.init_process_group(backend="gloo")  # as written for torchrun
    rank = int(os.environ["RANK"])
    total = torch.tensor([float(rank)])
    dist.all_reduce(total)
    print(f"rank {rank} sum={total.item():g}")
    try:
        dist.init_process_group(backend="gloo", world_size=3)
    except ValueError as exc:
        print(f"rank {rank} refused: {exc}")
    dist.destroy_process_group()
    """
)


def test_torchrun_script_calling_init_process_group_runs_under_loom_run(tmp_path, capfd):
    path = tmp_path / "torchrun_style.py"
    path.write_text(TORCHRUN_SCRIPT)
    assert main(["run", "-n", "2", "--timeout", "200", str(path)]) == 0
    out = capfd.readouterr().out
    for rank in range(2):
        assert f"rank {rank} sum=1" in out
        assert (
            f"rank {rank} refused: torch.distributed.init_process_group was called under `loom run`, which "
            "already joined every rank to the default process group, but asks for world_size=3 (the "
            "group's is 2: loom run -n sets the world size" in out
        )


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="nccl can run here")
def test_loom_run_with_nccl_and_no_gpus_is_refused_before_any_worker_starts(no_spawn, tmp_path, capsys):
    (tmp_path / "ok.py").write_text("print('hi')\n")
    assert main(["run", "-n", "2", "--backend", "nccl", str(tmp_path / "ok.py")]) == 2
    err = capsys.readouterr().err
    # a CPU build of torch has no NCCL, a CUDA build on too few GPUs has NCCL but not the GPUs: both name gloo
    assert err.startswith("loom run: error: loom.launch: backend 'nccl'") and "'gloo'" in err
