"""The files `data.path` names and the documents in them.

`data.path` is a file, a directory (every file below it whose name ends with the kind's suffix, e.g.
`.jsonl`, hidden names skipped) or a glob (`*`, `?`, `[`; `**` crosses directories). Files are read in
sorted path order, so every run and every rank sees the same corpus in the same order.

A document is one text file (`kind = "text"`: the whole file, so its line breaks and blank lines stay in
the text), one JSONL record's `data.text_field`, or one Parquet row's `data.text_field` column. Readers are
generators: JSONL is read line by line and Parquet one row group at a time, never a whole file at once.
Null values and empty strings hold no document and are skipped.
"""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Iterator, Sequence
from pathlib import Path

__all__ = ["DOCUMENT_KINDS", "SUFFIXES", "read_documents", "resolve_files"]

# The kinds whose files hold documents (text to tokenise); "tokens" files hold ids already.
DOCUMENT_KINDS = ("text", "jsonl", "parquet")
# The files of a directory that each kind reads.
SUFFIXES = {"text": (".txt",), "jsonl": (".jsonl",), "parquet": (".parquet",), "tokens": (".bin",)}
_WHAT = {
    "text": "UTF-8 text file",
    "jsonl": "JSONL file (one JSON object per line)",
    "parquet": "Parquet file",
    "tokens": "token file (raw ids, see write_token_file)",
}


def _is_glob(path: str) -> bool:
    return any(c in path for c in "*?[")


def _directory_files(directory: Path, suffixes: Sequence[str]) -> list[Path]:
    found = []
    for file in directory.rglob("*"):
        hidden = any(part.startswith(".") for part in file.relative_to(directory).parts)
        if file.is_file() and not hidden and file.name.endswith(tuple(suffixes)):
            found.append(file)
    return found


def resolve_files(kind: str, path: str | Path) -> list[Path]:
    """The files `data.path` names for `data.kind`, sorted, each checked to exist and be readable (nothing
    is read). Raises a ValueError naming `data.path` and how to fix it."""
    shown, what = str(path), _WHAT[kind]
    if _is_glob(shown):
        files = [Path(p) for p in glob.glob(shown, recursive=True) if Path(p).is_file()]
        if not files:
            raise ValueError(
                f"data.path = {shown!r} matches no files; point data.path at a {what} or a glob of them"
            )
    elif not Path(path).exists():
        raise ValueError(f"data.path = {shown!r} does not exist; point data.path at a {what}")
    elif Path(path).is_dir():
        files = _directory_files(Path(path), SUFFIXES[kind])
        if not files:
            raise ValueError(
                f"data.path = {shown!r} is a directory with no {'/'.join(SUFFIXES[kind])} files; point "
                f"data.path at a {what}, a directory of them or a glob"
            )
    else:
        files = [Path(path)]
    for file in files:
        if not os.access(file, os.R_OK):
            raise ValueError(
                f"data.path: {str(file)!r} cannot be read (permission denied); fix its permissions"
            )
    return sorted(files, key=str)


def _text_documents(file: Path, _field: str) -> Iterator[str]:
    try:
        yield file.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(
            f"data.path: text file {str(file)!r} is not valid UTF-8 ({exc}); convert it first"
        ) from exc


def _field_value(record: object, field: str, where: str) -> str | None:
    """`record[field]` of a JSONL record, checked: a string, or None (no document)."""
    if not isinstance(record, dict):
        raise ValueError(
            f"{where} is a JSON {type(record).__name__}, not an object; write one object per line"
        )
    if field not in record:
        raise ValueError(
            f"{where} has no field data.text_field = {field!r} (it has {sorted(record)}); set "
            "data.text_field to the key that holds the text"
        )
    value = record[field]
    if value is not None and not isinstance(value, str):
        raise ValueError(f"{where}: data.text_field = {field!r} holds a {type(value).__name__}, not text")
    return value


def _jsonl_documents(file: Path, field: str) -> Iterator[str]:
    with file.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            where = f"data.path: {str(file)!r} line {number}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{where} is not valid JSON ({exc}); fix or remove that line") from None
            value = _field_value(record, field, where)
            if value:
                yield value


def _import_pyarrow():
    try:
        import pyarrow
        import pyarrow.parquet
    except ImportError:
        raise ValueError(
            "data.kind = 'parquet' needs pyarrow; install it with pip install 'loom[hf]'"
        ) from None
    return pyarrow


def _parquet_documents(file: Path, field: str) -> Iterator[str]:
    pa = _import_pyarrow()
    try:
        table = pa.parquet.ParquetFile(file)
    except Exception as exc:  # pyarrow raises its own error types for a file that is not Parquet
        raise ValueError(f"data.path: {str(file)!r} is not a readable Parquet file ({exc})") from None
    schema = table.schema_arrow
    if field not in schema.names:
        raise ValueError(
            f"data.path: {str(file)!r} has no column data.text_field = {field!r} (it has {schema.names}); "
            "set data.text_field to the column that holds the text"
        )
    kind = schema.field(field).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise ValueError(
            f"data.path: {str(file)!r} column data.text_field = {field!r} holds {kind}, not text; set "
            "data.text_field to a string column"
        )
    for group in range(table.num_row_groups):  # one row group in memory at a time
        for value in table.read_row_group(group, columns=[field]).column(0).to_pylist():
            if value:
                yield value


_READERS = {"text": _text_documents, "jsonl": _jsonl_documents, "parquet": _parquet_documents}


def read_documents(kind: str, files: Sequence[Path], text_field: str = "text") -> Iterator[str]:
    """The documents of `files` in order, read lazily (see the module's docstring for what a document is)."""
    reader = _READERS[kind]
    for file in files:
        yield from reader(file, text_field)
