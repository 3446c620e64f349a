"""Token arrays cut into training windows: the map-style dataset every file-backed kind shares, and the
nanoGPT-style `.bin` token files (`TokenFileDataset`, `write_token_file`)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from loom.train.data.sources import resolve_files

__all__ = [
    "TOKEN_DTYPES",
    "Batch",
    "TokenDataset",
    "TokenFileDataset",
    "ConcatTokens",
    "WindowDataset",
    "check_data_file",
    "check_dtype",
    "check_seq_len",
    "window",
    "write_token_file",
]

Batch = tuple[torch.Tensor, torch.Tensor]
TOKEN_DTYPES = ("uint16", "uint32")


class TokenDataset(Protocol):
    """What `DistributedBatches` reads: a length and `(input_ids, targets)` pairs of equal length."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> Batch: ...


def check_dtype(dtype: str) -> np.dtype:
    """The numpy dtype of a token file's ids; a ValueError for any other than `TOKEN_DTYPES`."""
    if dtype not in TOKEN_DTYPES:
        raise ValueError(f"token dtype {dtype!r} is not supported; use one of {TOKEN_DTYPES}")
    return np.dtype(dtype)


def check_seq_len(seq_len: int) -> None:
    """A ValueError unless `seq_len` is a positive integer."""
    if not isinstance(seq_len, int) or isinstance(seq_len, bool) or seq_len < 1:
        raise ValueError(f"seq_len must be a positive integer, got {seq_len!r}")


def check_data_file(kind: str, path: str | Path, dtype: str = "uint16") -> list[Path]:
    """The files `data.path` names for `data.kind` (see `resolve_files`), checked without reading them:
    they exist, can be read and (tokens) hold whole `dtype` ids. Raises a ValueError naming `data.path`."""
    files = resolve_files(kind, path)
    if kind == "tokens":
        itemsize = check_dtype(dtype).itemsize
        for file in files:
            where = f"data.path = {str(path)!r}" + ("" if file == Path(path) else f": {str(file)!r}")
            if file.stat().st_size % itemsize:
                raise ValueError(
                    f"{where} has {file.stat().st_size} bytes, not a multiple of the "
                    f"{itemsize}-byte {dtype} of data.dtype; set data.dtype to the dtype the file was written with"
                )
    return files


def window(tokens: np.ndarray | Sequence[int], start: int, seq_len: int) -> Batch:
    """`seq_len + 1` tokens from `start`, as (inputs, targets) shifted by one."""
    chunk = torch.from_numpy(np.asarray(tokens[start : start + seq_len + 1], dtype=np.int64))
    return chunk[:-1], chunk[1:]


class WindowDataset:
    """Non-overlapping windows of `seq_len + 1` tokens over a 1-D token array (the last token of a window
    is the first of the next, so every token is a target exactly once). `tokens` is anything with `len`
    and slicing: a numpy array, a memmap, or `ConcatTokens` over several files."""

    def __init__(self, tokens: Any, seq_len: int, source: str) -> None:
        check_seq_len(seq_len)
        if len(tokens) < seq_len + 1:
            raise ValueError(
                f"{source} holds {len(tokens)} tokens, fewer than one sample of seq_len + 1 = {seq_len + 1}; "
                "use a longer file or a smaller seq_len"
            )
        self.tokens = tokens
        self.seq_len = seq_len

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.seq_len

    def __getitem__(self, index: int) -> Batch:
        if not 0 <= index < len(self):
            raise IndexError(f"sample {index} out of range for {len(self)} samples")
        return window(self.tokens, index * self.seq_len, self.seq_len)


def write_token_file(path: str | Path, tokens: Sequence[int] | np.ndarray, dtype: str = "uint16") -> None:
    """Write token ids as a raw `.bin` file (native byte order, no header), as nanoGPT's prepare scripts do."""
    np_dtype = check_dtype(dtype)
    array = np.asarray(tokens, dtype=np.int64)
    if array.size and (array.min() < 0 or array.max() > np.iinfo(np_dtype).max):
        raise ValueError(
            f"token ids span [{array.min()}, {array.max()}], outside {dtype}; use dtype='uint32' for vocabularies over 65536"
        )
    array.astype(np_dtype).tofile(path)


class ConcatTokens:
    """Several 1-D token arrays read as one, in order: `len` and `[start:stop]` slices that may cross from
    one array into the next (a window that spans two token files)."""

    def __init__(self, parts: Sequence[np.ndarray]) -> None:
        self.parts = list(parts)
        self.starts = np.cumsum([0] + [len(p) for p in self.parts])  # offset of each part, then the total

    def __len__(self) -> int:
        return int(self.starts[-1])

    def __getitem__(self, span: slice) -> np.ndarray:
        start, stop, _ = span.indices(len(self))
        first = int(np.searchsorted(self.starts, start, side="right")) - 1
        pieces = []
        for i in range(max(first, 0), len(self.parts)):
            if self.starts[i] >= stop:
                break
            lo, hi = max(start - self.starts[i], 0), min(stop - self.starts[i], len(self.parts[i]))
            pieces.append(self.parts[i][lo:hi])
        return np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int64)


def _open_tokens(path: Path, np_dtype: np.dtype) -> np.ndarray:
    # np.memmap refuses an empty file; an empty array stands in for it.
    return np.memmap(path, dtype=np_dtype, mode="r") if path.stat().st_size else np.zeros(0, dtype=np_dtype)


class TokenFileDataset(WindowDataset):
    """`.bin` files of raw token ids (nanoGPT format), memory-mapped: only the windows read are paged in.

    `path` is a file, a directory (its `.bin` files) or a glob; several files are read as one stream in
    sorted order, as they are (no separator is added: pre-tokenised files carry their own end-of-document
    ids). Sample `i` is tokens `[i * seq_len, (i + 1) * seq_len + 1)`, returned as `(input_ids, targets)`.
    """

    def __init__(self, path: str | Path, seq_len: int, dtype: str = "uint16") -> None:
        np_dtype = check_dtype(dtype)
        files = check_data_file("tokens", path, dtype)
        parts = [_open_tokens(file, np_dtype) for file in files]
        tokens = parts[0] if len(parts) == 1 else ConcatTokens(parts)
        super().__init__(tokens, seq_len, f"data.path = {str(path)!r}")
        self.path, self.dtype = path, dtype

    def __getstate__(self) -> dict[str, Any]:
        # Pickling a memmap copies the whole file; a worker process re-opens the file instead.
        return {"path": self.path, "seq_len": self.seq_len, "dtype": self.dtype}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["path"], state["seq_len"], state["dtype"])
