"""Documents tokenised and packed: `CorpusDataset` turns text / JSONL / Parquet files into one stream of
token ids (each document followed by the end-of-sequence id) cut into `seq_len + 1` windows, no padding.

The whole corpus is tokenised once per process into an int32 array in memory (4 bytes per token) and kept
in a small in-process cache keyed by the files (path, size, modification time) and the tokenizer, so the
held-out batches built at each evaluation reuse it. A resumed run tokenises the corpus again at start-up:
tokenisation is deterministic, so the windows, and the position saved in a checkpoint (an index into
them), are the same; the corpus `fingerprint` in that position catches a corpus that changed in between.
For a corpus too large to tokenise at every start, `write_corpus_tokens` writes the ids once to a `.bin`
file that `kind = "tokens"` memory-maps.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
import xxhash

from loom.train.data.sources import read_documents, resolve_files
from loom.train.data.tokenize import (
    Encoder,
    byte_encoder,
    hf_encoder,
    load_tokenizer,
    tokenizer_eos_id,
    tokenizer_file,
)
from loom.train.data.windows import WindowDataset, write_token_file

__all__ = ["CorpusDataset", "TextFileDataset", "pack_documents", "tokenize_corpus", "write_corpus_tokens"]

_ENCODE_BATCH = 256  # documents per call of the tokenizer, which encodes a batch on several threads


def _batches(documents: Iterable[str], size: int) -> Iterator[list[str]]:
    batch: list[str] = []
    for document in documents:
        batch.append(document)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def pack_documents(documents: Iterable[str], encode: Encoder, eos_id: int | None) -> np.ndarray:
    """The ids of `documents` concatenated in order, `eos_id` after each one (none when `eos_id` is None)."""
    eos = np.asarray([] if eos_id is None else [eos_id], dtype=np.int32)
    pieces = []
    for batch in _batches(documents, _ENCODE_BATCH):
        for ids in encode(batch):
            pieces += [ids, eos]
    return np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int32)


def _stat(path: Path) -> tuple[str, int, int]:
    stat = path.stat()
    return str(path), stat.st_size, stat.st_mtime_ns


@functools.lru_cache(maxsize=2)
def _tokenized(
    kind: str,
    files: tuple[tuple[str, int, int], ...],
    tokenizer: tuple[str, int, int] | None,
    eos_id: int | None,
    text_field: str,
) -> tuple[np.ndarray, str]:
    """The corpus' ids (read-only, shared by the callers) and their fingerprint. The file stats in the
    arguments are the cache key: a file that changes is tokenised again."""
    encode = byte_encoder if tokenizer is None else hf_encoder(load_tokenizer(tokenizer[0]))
    documents = read_documents(kind, [Path(f[0]) for f in files], text_field)
    tokens = pack_documents(documents, encode, eos_id)
    tokens.flags.writeable = False
    return tokens, xxhash.xxh64(tokens).hexdigest()


def _resolve_eos(tokenizer: str | Path | None, eos_id: int | None) -> int | None:
    if eos_id is not None or tokenizer is None:
        return eos_id
    return tokenizer_eos_id(load_tokenizer(tokenizer), tokenizer)


def tokenize_corpus(
    kind: str,
    path: str | Path,
    *,
    tokenizer: str | Path | None = None,
    eos_id: int | None = None,
    text_field: str = "text",
) -> tuple[np.ndarray, str]:
    """All documents of `data.path` tokenised and concatenated, and the fingerprint (xxh64) of the ids.

    `tokenizer` is a `tokenizer.json` or a directory holding one (None: UTF-8 bytes). Each document is
    followed by `eos_id`, or by the tokenizer's end-of-sequence id when `eos_id` is None (byte tokens: no
    separator). Raises a ValueError naming `data.path` when the files hold no document.
    """
    files = tuple(_stat(file) for file in resolve_files(kind, path))
    key = None if tokenizer is None else (str(tokenizer), *_stat(tokenizer_file(tokenizer))[1:])
    tokens, fingerprint = _tokenized(kind, files, key, _resolve_eos(tokenizer, eos_id), text_field)
    if not len(tokens):
        raise ValueError(
            f"data.path = {str(path)!r} holds no documents ({len(files)} files, all empty or without "
            "text); point data.path at files with text"
        )
    return tokens, fingerprint


class CorpusDataset(WindowDataset):
    """Text / JSONL / Parquet documents tokenised, packed with end-of-sequence ids and cut into
    `seq_len + 1` windows (see the module's docstring; arguments as `tokenize_corpus`).

    `fingerprint` identifies the ids, so that `DistributedBatches` refuses to resume a position saved on
    another corpus or tokenizer.
    """

    def __init__(
        self,
        kind: str,
        path: str | Path,
        seq_len: int,
        *,
        tokenizer: str | Path | None = None,
        eos_id: int | None = None,
        text_field: str = "text",
    ) -> None:
        tokens, self.fingerprint = tokenize_corpus(
            kind, path, tokenizer=tokenizer, eos_id=eos_id, text_field=text_field
        )
        super().__init__(tokens, seq_len, f"data.path = {str(path)!r}")
        self.kind, self.path = kind, path


class TextFileDataset(CorpusDataset):
    """UTF-8 text files (a file, a directory of `.txt` files or a glob), each file one document."""

    def __init__(
        self, path: str | Path, seq_len: int, tokenizer: str | Path | None = None, eos_id: int | None = None
    ) -> None:
        super().__init__("text", path, seq_len, tokenizer=tokenizer, eos_id=eos_id)


def write_corpus_tokens(
    out: str | Path,
    kind: str,
    path: str | Path,
    *,
    tokenizer: str | Path | None = None,
    eos_id: int | None = None,
    text_field: str = "text",
) -> str:
    """Tokenise a corpus once (as `tokenize_corpus`) into a `.bin` token file for `kind = "tokens"`, in
    uint16 when every id fits, else uint32. Returns that dtype, the `data.dtype` to read the file with."""
    tokens, _ = tokenize_corpus(kind, path, tokenizer=tokenizer, eos_id=eos_id, text_field=text_field)
    dtype = "uint16" if tokens.max() < 2**16 else "uint32"
    write_token_file(out, tokens, dtype)
    return dtype
