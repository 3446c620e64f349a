"""benchmarks/gpu_deps.py: what `benchmarks/gpu_step.py` needs besides torch is checked before torch loads,
and what is missing is installed from a carried wheel folder (`--wheels DIR`) or named with the fix."""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

from benchmarks import gpu_deps

ROOT = Path(__file__).resolve().parents[1]


def _wheel(folder: Path, name: str) -> Path:
    """A minimal pure-Python wheel of package `name` (module `name`, `VALUE = 7`), built by hand."""
    folder.mkdir(parents=True, exist_ok=True)
    info = f"{name}-0.1.dist-info"
    files = {
        f"{name}/__init__.py": "VALUE = 7\n",
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: hand\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = "".join(f"{path},,\n" for path in files) + f"{info}/RECORD,,\n"
    path = folder / f"{name}-0.1-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as archive:
        for member, text in {**files, f"{info}/RECORD": record}.items():
            archive.writestr(member, text)
    return path


def test_missing_names_what_cannot_be_imported_in_order():
    assert gpu_deps.missing(("json", "loom_no_such_module_b", "pathlib", "loom_no_such_module_a")) == [
        "loom_no_such_module_b",
        "loom_no_such_module_a",
    ]
    assert gpu_deps.missing() == []  # the suite's environment has everything gpu_step needs


def test_install_command_uses_the_wheel_folder_alone():
    command = gpu_deps.install_command(["xxhash", "numpy"], Path("/carry/.gpu-wheels"), python="/py")
    assert command == [
        "/py", "-m", "pip", "install", "--no-index", "--find-links", "/carry/.gpu-wheels", "xxhash", "numpy",
    ]  # fmt: skip


def test_without_a_wheel_folder_the_missing_packages_are_named_with_the_fix(capsys):
    with pytest.raises(SystemExit) as stop:
        gpu_deps.ensure(None, names=("json", "loom_no_such_module"))
    assert stop.value.code == gpu_deps.MISSING_EXIT
    err = capsys.readouterr().err
    assert "missing Python packages: loom_no_such_module (no --wheels folder given)" in err
    assert "make gpu-wheels" in err and "--wheels .gpu-wheels" in err


def test_a_wheel_folder_that_lacks_the_package_stops_with_pips_reason(tmp_path, capsys):
    _wheel(tmp_path / "wheels", "loom_other_probe")
    with pytest.raises(SystemExit) as stop:
        gpu_deps.ensure(tmp_path / "wheels", names=("loom_absent_probe",))
    assert stop.value.code == gpu_deps.MISSING_EXIT
    err = capsys.readouterr().err
    assert "loom_absent_probe" in err and "pip install from" in err and "failed" in err
    with pytest.raises(SystemExit):
        gpu_deps.ensure(tmp_path / "no_such_folder", names=("loom_absent_probe",))
    assert "is not a folder" in capsys.readouterr().err


def test_a_missing_package_is_installed_from_the_wheel_folder(tmp_path, monkeypatch):
    """The real pip, from a hand-built wheel; into a folder of its own (`--target`) so that the suite's
    environment stays as it was."""
    name = "loom_gpu_deps_probe"
    _wheel(tmp_path / "wheels", name)
    site = tmp_path / "site"
    build = gpu_deps.install_command
    monkeypatch.setattr(
        gpu_deps, "install_command", lambda names, wheels: [*build(names, wheels), "--target", str(site)]
    )
    monkeypatch.syspath_prepend(str(site))
    assert gpu_deps.missing((name,)) == [name]
    gpu_deps.ensure(tmp_path / "wheels", names=("json", name))
    assert gpu_deps.missing((name,)) == []
    assert __import__(name).VALUE == 7


def test_the_wheels_argument_is_read_amid_the_scripts_other_arguments(monkeypatch, tmp_path):
    seen = []
    monkeypatch.setattr(gpu_deps, "ensure", seen.append)
    gpu_deps.ensure_from_argv(["--smoke", "--wheels", str(tmp_path), "--out", "x", "--batch", "8"])
    gpu_deps.ensure_from_argv(["--out", "x"])
    assert seen == [tmp_path, None]


def test_required_are_looms_own_dependencies_and_cover_the_scripts_imports():
    """Each name is one of loom's declared dependencies (pip installs it under that name), and importing
    gpu_step (loom, the model, the trainer, the simulator) loads none of loom's other dependencies."""
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    names = {entry.split(">")[0].split("=")[0].split("<")[0].strip() for entry in declared}
    assert set(gpu_deps.REQUIRED) <= names
    code = (
        "import json, sys; import benchmarks.gpu_step; "
        "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    loaded = set(json.loads(done.stdout.splitlines()[-1]))
    assert loaded & names <= set(gpu_deps.REQUIRED) | {"torch"}, loaded & names


def test_the_size_check_counts_the_tree_and_the_folder(tmp_path, capsys):
    (tmp_path / "w").mkdir()
    (tmp_path / "w" / "a.whl").write_bytes(b"x" * 2048)
    assert gpu_deps.folder_bytes(tmp_path / "w") == 2048
    assert gpu_deps.main(["size", str(tmp_path / "w")]) == 0
    assert "of the device tool's 64 MiB" in capsys.readouterr().out
    (tmp_path / "w" / "big.whl").write_bytes(b"\0" * (gpu_deps.CARRY_LIMIT + 1))
    assert gpu_deps.main(["size", str(tmp_path / "w")]) == 1
