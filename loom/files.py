"""Reading the small JSON and TOML files a user points loom at (model shapes, hardware profiles), with errors
that name the file, the problem and the fix instead of a traceback; sizes in bytes as people read them."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Any

__all__ = ["byte_size", "read_table"]


def byte_size(count: float) -> str:
    """A byte count for people: "512 bytes", "62.1 KiB", "1.1 GiB"."""
    if count < 1024:
        return f"{count:.0f} bytes"
    value = float(count)
    for unit in ("KiB", "MiB", "GiB"):
        value /= 1024
        if value < 1024:
            return f"{value:.1f} {unit}"
    return f"{value / 1024:.1f} TiB"


def read_table(path: str | Path, what: str) -> dict[str, Any]:
    """The table in a `.toml` file, or the object in a JSON file (any other suffix). `what` names the file's
    role in messages ("model config", "hardware profile"). `ValueError` for a missing file, a directory, a
    syntax error (with its line and column) or a file whose top level is not a table."""
    path = Path(path)
    if not path.exists():
        raise ValueError(f"{what} file {str(path)!r} does not exist: check the path")
    if not path.is_file():
        raise ValueError(f"{what} file {str(path)!r} is not a file: give the path of a JSON or TOML file")
    text = path.read_text(encoding="utf-8", errors="replace")
    if path.suffix == ".toml":
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise ValueError(f"{what} file {str(path)!r} is not valid TOML: {exc}") from None
    else:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(
                f"{what} file {str(path)!r} is not valid JSON (line {exc.lineno}, column {exc.colno}: "
                f"{exc.msg}); a TOML file needs the suffix .toml"
            ) from None
    if not isinstance(data, dict):
        raise ValueError(
            f"{what} file {str(path)!r} holds a JSON {type(data).__name__}, not an object of named fields"
        )
    return data
