"""Documents tokenised and packed: `CorpusDataset` turns text / JSONL / Parquet files into one stream of
token ids (each document followed by the end-of-sequence id) cut into `seq_len + 1` windows, no padding.

The whole corpus is tokenised at start-up into an int32 array (4 bytes per token), kept in a small
in-process cache keyed by the files (path, size, modification time) and the tokenizer, so that the
held-out batches built at each evaluation reuse it. Tokenisation is deterministic, so a resumed run cuts
the same windows and the position saved in a checkpoint (an index into them) means the same batch; the
corpus `fingerprint` saved with that position catches a corpus that changed in between.

The trade-off: without `data.cache_dir`, every rank tokenises the whole corpus at every start (and every
restart) and holds its own copy. With `data.cache_dir`, the ids are written there once (under a name
derived from the files and the tokenizer; written to a temporary name and renamed, so ranks that race
write the same bytes and never a half file) and later starts, on every rank, memory-map them: no
tokenising, one copy in the page cache. `write_corpus_tokens` writes a `.bin` file for `kind = "tokens"`.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import numpy as np
import xxhash

from loom.train.config import DataConfig
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


def _disk_cached(cache_dir: str, key: tuple, build: Callable[[], np.ndarray]) -> np.ndarray:
    """The ids `build` makes, memory-mapped from `cache_dir`, where the first call writes them."""
    path = Path(cache_dir) / f"{xxhash.xxh64(repr(key).encode()).hexdigest()}.int32.bin"
    if not path.exists():
        tokens = build()
        if not len(tokens):  # nothing to map; the caller reports the empty corpus
            return tokens
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
            tokens.tofile(partial)
            os.replace(partial, path)  # atomic: another rank sees the whole file or none
        except OSError as exc:
            raise ValueError(
                f"data.cache_dir = {cache_dir!r} cannot be written ({exc}); choose another directory"
            ) from None
    return np.memmap(path, dtype=np.int32, mode="r")


@functools.lru_cache(maxsize=2)
def _tokenized(
    kind: str,
    files: tuple[tuple[str, int, int], ...],
    tokenizer: tuple[str, int, int] | None,
    eos_id: int | None,
    text_field: str,
    cache_dir: str | None,
) -> tuple[np.ndarray, str]:
    """The corpus' ids (read-only, shared by the callers) and their fingerprint. The file stats in the
    arguments are the cache key: a file that changes is tokenised again."""

    def build() -> np.ndarray:
        encode = byte_encoder if tokenizer is None else hf_encoder(load_tokenizer(tokenizer[0]))
        documents = read_documents(kind, [Path(f[0]) for f in files], text_field)
        return pack_documents(documents, encode, eos_id)

    key = (kind, files, tokenizer, eos_id, text_field)
    tokens = build() if cache_dir is None else _disk_cached(cache_dir, key, build)
    tokens.flags.writeable = False
    return tokens, xxhash.xxh64(tokens).hexdigest()


def _eos_id(data: DataConfig) -> int | None:
    if data.eos_id is not None or data.tokenizer is None:
        return data.eos_id
    return tokenizer_eos_id(load_tokenizer(data.tokenizer), data.tokenizer)


def tokenize_corpus(data: DataConfig) -> tuple[np.ndarray, str]:
    """All documents of `data.path` tokenised by `data.tokenizer` (none: UTF-8 bytes) and concatenated,
    each followed by the end-of-sequence id (see `loom.train.data.tokenize`), and the fingerprint (xxh64)
    of the ids. Raises a ValueError naming `data.path` when the files hold no document."""
    files = tuple(_stat(file) for file in resolve_files(data.kind, data.path))
    tokenizer = (
        None if data.tokenizer is None else (data.tokenizer, *_stat(tokenizer_file(data.tokenizer))[1:])
    )
    tokens, fingerprint = _tokenized(
        data.kind, files, tokenizer, _eos_id(data), data.text_field, data.cache_dir
    )
    if not len(tokens):
        raise ValueError(
            f"data.path = {data.path!r} holds no documents ({len(files)} files, all empty or without "
            "text); point data.path at files with text"
        )
    return tokens, fingerprint


class CorpusDataset(WindowDataset):
    """The text / JSONL / Parquet documents a `[data]` section names, tokenised, packed with
    end-of-sequence ids and cut into `data.seq_len + 1` windows (see the module's docstring).

    `fingerprint` identifies the ids, so that `DistributedBatches` refuses to resume a position saved on
    another corpus or tokenizer.
    """

    def __init__(self, data: DataConfig) -> None:
        tokens, self.fingerprint = tokenize_corpus(data)
        super().__init__(tokens, data.seq_len, f"data.path = {data.path!r}")
        self.data = data


class TextFileDataset(CorpusDataset):
    """UTF-8 text files (a file, a directory of `.txt` files or a glob), each file one document, in byte
    tokens or tokenised by the tokenizer at `tokenizer`."""

    def __init__(self, path: str | Path, seq_len: int, tokenizer: str | Path | None = None) -> None:
        tokenizer = None if tokenizer is None else str(tokenizer)
        super().__init__(DataConfig(kind="text", path=str(path), seq_len=seq_len, tokenizer=tokenizer))


def write_corpus_tokens(data: DataConfig, out: str | Path) -> str:
    """Tokenise the corpus of `data` once (as `tokenize_corpus`) into a `.bin` token file for
    `kind = "tokens"`, in uint16 when every id fits, else uint32. Returns that dtype, the `data.dtype` to
    read the file with."""
    tokens, _ = tokenize_corpus(data)
    dtype = "uint16" if tokens.max() < 2**16 else "uint32"
    write_token_file(out, tokens, dtype)
    return dtype
