"""The README runs as written: its ```python blocks as scripts (the tour, in a subprocess, as a user runs it)
and the `loom` commands of its ```bash blocks, through the `loom` entry point (`loom.cli.main.main`, in this
process: the same code without a fresh interpreter per command).

Commands that train or measure run as written with options appended that make them end in seconds (`SHORT`
below). Fast tests: the tour, every command parsed (and every `loom train` config validated with its
overrides), the `loom simulate` and `loom checkpoint` commands run, on a checkpoint that one short 1-worker
`loom train` writes. Slow tests (`-m slow`): each `loom train` and `loom bench` line on its own workers.
A README line that is not a `loom` command is skipped only when `NOT_RUN` says why.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from loom.cli.main import build_parser, main, parse_arguments
from loom.train.config import load_config

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"

# README lines that are not run, and why.
NOT_RUN = {
    "make demo": "the whole demo (about 2 minutes of training); its `loom train configs/demo.toml` runs below",
    "make test": "the test suite, which includes this test",
    "python benchmarks/simulator_validation.py": "a benchmark script, run by hand (not a loom command)",
    "python benchmarks/simulator_calibration.py": "a benchmark: it times a training step on this machine",
    "python benchmarks/gpu_step.py --out gpu-results": "needs a GPU (docs/gpu.md); tests/test_gpu_path.py "
    "runs its --smoke form",
}

# Appended to a command (by its first two words) so that it ends in seconds: 2 steps, a checkpoint at the
# last one, a log line per step; `loom bench` one small size and one repeat.
SHORT = {
    "loom train": ["--train.steps", "2", "--train.log_every", "1", "--train.warmup_steps", "1",
                   "--checkpoint.every_steps", "2"],
    "loom bench": ["--sizes", "4096", "--repeats", "1", "--matmul-sizes", "16", "32"],
}  # fmt: skip
# The fast stand-in for `loom train`: the same config on one worker (the README's own lines run in `slow`).
ONE_WORKER = ["--train.workers", "1", "--parallel.dp", "1", "--parallel.tp", "1"]

# README commands that exit 1 today because the plan they show does not fit in memory (the simulator says
# so and exits 1; the timeline is still drawn). Either status passes; the message must say why.
DOES_NOT_FIT = {
    "loom simulate --model gpt3-175b --gpus 64": "needs 116.4 GiB per device, more than the 80 GiB",
}


def python_blocks() -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", README.read_text(), flags=re.S | re.M)


def shell_commands() -> list[str]:
    """The commands of the README's ```bash blocks: continuation lines joined, comments dropped."""
    commands = []
    for block in re.findall(r"^```bash\n(.*?)^```", README.read_text(), flags=re.S | re.M):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if words:
                commands.append(shlex.join(words))
    return commands


def loom_commands(program: str = "") -> list[str]:
    return [c for c in shell_commands() if c.startswith(f"loom {program}".rstrip() + " ")]


def _run(command: str, extra: list[str] = ()) -> int:
    return main([*shlex.split(command)[1:], *extra])


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """A fresh directory with the repository's configs, as the README's relative paths expect."""
    (tmp_path / "configs").symlink_to(ROOT / "configs")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_every_readme_command_is_run_or_excluded_for_a_reason():
    commands = shell_commands()
    assert loom_commands("train") and loom_commands("simulate") and loom_commands("checkpoint")
    for command in commands:
        assert command.startswith("loom ") or command in NOT_RUN, f"add {command!r} to the test or NOT_RUN"
    for command in NOT_RUN:
        assert command in commands, f"NOT_RUN lists {command!r}, which the README no longer has"
    assert (
        len(python_blocks()) == 3
    )  # the tour, the any-model and DiLoCo snippets; a new one needs its own test


def test_every_readme_command_parses(workdir):
    parser = build_parser()
    for command in loom_commands():
        args = parse_arguments(parser, shlex.split(command)[1:])
        if args.command == "train":  # the config and its overrides are valid for the workers it starts
            config = load_config(args.config, args.overrides)
            config.validate(config.train.workers)
    for prefix, extra in SHORT.items():  # and so are the options the tests append
        for command in loom_commands(prefix.split()[1]):
            parse_arguments(parser, [*shlex.split(command)[1:], *extra])


# Appended to the tour: every rank's result is x @ w @ v of the tensors rank 0 drew, which are the ones this
# process draws after loom.seed(0) (launch's default seed).
TOUR_CHECK = """
if __name__ == "__main__":  # appended by tests/test_readme.py
    loom.seed(0)
    x, w, v = torch.randn(16, 8), torch.randn(8, 12), torch.randn(12, 4)
    assert len(results) == 4
    for z in results:
        torch.testing.assert_close(z.detach(), x @ w @ v, rtol=1e-5, atol=1e-5)
    print("tour: every rank's result is x @ w @ v")
"""


def _run_script(path: Path, text: str, preload: str = "") -> subprocess.CompletedProcess:
    """Run `text` as the script `path`; `preload`: modules its workers' forkserver imports once for all of
    them (the suite starts workers from a forkserver, see tests/conftest.py), as a speed-up only."""
    path.write_text(text)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    if preload and env.get("LOOM_START_METHOD") == "forkserver":
        env["LOOM_FORKSERVER_PRELOAD"] = ",".join(filter(None, [env.get("LOOM_FORKSERVER_PRELOAD"), preload]))
    return subprocess.run(
        [sys.executable, str(path)], capture_output=True, text=True, cwd=path.parent, env=env, timeout=300
    )


def test_readme_tour_runs_as_written_and_gives_the_one_process_answer(tmp_path):
    tour = python_blocks()[0]
    done = _run_script(tmp_path / "tour.py", tour + TOUR_CHECK)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "tour: every rank's result is x @ w @ v" in done.stdout


def test_readme_any_model_snippet_trains_like_one_device(tmp_path):
    """The Hugging Face snippet asserts itself that 4 ranks (dp=2 x tp=2) give one device's losses."""
    # each worker imports the script, so transformers: about 3.5 s of CPU each, paid once by the server instead
    done = _run_script(
        tmp_path / "any_model.py", python_blocks()[1], "transformers.models.llama.modeling_llama"
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "q_proj.weight: (2, 1) [tp, -]" in done.stdout, done.stdout


def test_readme_diloco_snippet_runs_as_written(tmp_path):
    done = _run_script(tmp_path / "diloco.py", python_blocks()[2])
    assert done.returncode == 0, done.stderr[-3000:]
    assert "both replicas hold the same global weights" in done.stdout


def test_readme_simulate_and_checkpoint_commands_run(workdir, capfd):
    for command in loom_commands("simulate"):
        status = _run(command)
        output = capfd.readouterr()
        known = next((why for start, why in DOES_NOT_FIT.items() if command.startswith(start)), None)
        if status != 0 and known is not None:
            assert status == 1 and known in output.out + output.err, command
        else:
            assert status == 0, (command, output.err[-2000:])
    # A checkpoint for `loom checkpoint ls runs/ckpt` and `export runs/ckpt ...`: the README's first
    # `loom train` line, short and on one worker.
    train = loom_commands("train")[0]
    assert _run(train, [*SHORT["loom train"], *ONE_WORKER, "--checkpoint.dir", "runs/ckpt"]) == 0
    capfd.readouterr()
    for command in loom_commands("checkpoint"):
        status, output = _run(command), capfd.readouterr()
        assert status == 0, (command, output.err[-2000:])
        if command.startswith("loom checkpoint ls"):
            assert re.search(r"\b2\s+1\s+1\s+full\b.*\bok\b", output.out), output.out  # step 2, 1 worker
    assert (workdir / "model.safetensors").exists() and (workdir / "runs" / "ft").is_dir()


@pytest.mark.slow
@pytest.mark.parametrize("command", loom_commands("train") + loom_commands("bench"), ids=lambda c: c[:60])
def test_readme_training_and_bench_commands_run_short(workdir, command):
    extra = SHORT[" ".join(command.split()[:2])]
    if command.startswith("loom train"):
        extra = [*extra, "--checkpoint.dir", "runs/ckpt"]
    assert _run(command, extra) == 0
