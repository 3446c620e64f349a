"""Bad files given to `loom simulate` (`--model-config`, `--hardware`): a one-line error that names the file,
the problem and the fix, exit status 2, never a traceback."""

from __future__ import annotations

import pytest

from loom.cli.main import main

FILES = {
    "missing": None,
    "not-json.json": "model: [1, 2",
    "bad.toml": "layers = [",
    "list.json": "[1, 2]",
    "unknown-field.json": '{"layers": 2, "colour": "red"}',
    "profile-fields.json": '{"device": {"name": "x"}}',
}


def _path(tmp_path, name):
    if FILES[name] is None:
        return str(tmp_path / "nowhere" / "config.json")
    path = tmp_path / name
    path.write_text(FILES[name])
    return str(path)


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("missing", "model config file '{path}' does not exist: check the path"),
        (
            "not-json.json",
            "model config file '{path}' is not valid JSON (line 1, column 1: Expecting value); a TOML file needs the suffix .toml",
        ),
        ("bad.toml", "model config file '{path}' is not valid TOML"),
        ("list.json", "model config file '{path}' holds a JSON list, not an object of named fields"),
        ("unknown-field.json", "{path}: unknown model fields ['colour']; known: ["),
        ("directory", "model config file '{path}' is not a file: give the path of a JSON or TOML file"),
    ],
)
def test_a_bad_model_config_file_is_named(tmp_path, capsys, name, expected):
    path = str(tmp_path) if name == "directory" else _path(tmp_path, name)
    assert main(["simulate", "--model-config", path]) == 2
    err = capsys.readouterr().err
    assert expected.format(path=path) in err and "Traceback" not in err


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("missing", "hardware profile file '{path}' does not exist: check the path"),
        (
            "not-json.json",
            "hardware profile file '{path}' is not valid JSON (line 1, column 1: Expecting value); a TOML file needs the suffix .toml",
        ),
        ("profile-fields.json", "hardware profile file '{path}': not a loom hardware profile"),
        ("unknown-name", "unknown hardware 'h900': use one of ['a100-40gb'"),
    ],
)
def test_a_bad_hardware_profile_is_named(tmp_path, capsys, name, expected):
    path = "h900" if name == "unknown-name" else _path(tmp_path, name)
    assert main(["simulate", "--model", "llama3-8b", "--hardware", path]) == 2
    err = capsys.readouterr().err
    assert expected.format(path=path) in err and "Traceback" not in err
