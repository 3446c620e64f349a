"""Datasets and distributed loading, deterministic given the seed and the data-parallel rank.

Every dataset here is map-style (`len(ds)`, `ds[i] -> (input_ids, targets)`, LongTensors of `seq_len`
tokens, `targets` shifted by one), so that `DistributedBatches` can shuffle and shard them with nothing
but an index permutation, and a resumed run can continue from an `(epoch, index)` position.

`[data] kind` picks the dataset (`build_dataset`):
- `"arithmetic"`: `ArithmeticCorpus`, a synthetic corpus ("12+7=19") a small GPT learns in minutes.
- `"tokens"`: `TokenFileDataset`, nanoGPT-style `.bin` files of raw token ids, memory-mapped.
- `"text"`, `"jsonl"`, `"parquet"`: `CorpusDataset`, documents read from local files (`sources`),
  tokenised by a local Hugging Face tokenizer or as UTF-8 bytes (`tokenize`), and packed with an
  end-of-sequence id after each document into windows of `seq_len + 1` tokens (`packing`).

Shuffling is by window: `DistributedBatches` draws a permutation of all windows per epoch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from loom.train.data.arithmetic import ArithmeticCorpus
from loom.train.data.batches import DistributedBatches, micro_batches
from loom.train.data.packing import (
    CorpusDataset,
    TextFileDataset,
    pack_documents,
    tokenize_corpus,
    write_corpus_tokens,
)
from loom.train.data.sources import DOCUMENT_KINDS, read_documents, resolve_files
from loom.train.data.tokenize import ByteTokenizer, load_tokenizer
from loom.train.data.windows import TokenDataset, TokenFileDataset, check_data_file, write_token_file

if TYPE_CHECKING:
    from loom.train.config import DataConfig

__all__ = [
    "ArithmeticCorpus",
    "ByteTokenizer",
    "CorpusDataset",
    "DistributedBatches",
    "TextFileDataset",
    "TokenDataset",
    "TokenFileDataset",
    "build_dataset",
    "check_data_file",
    "check_vocab_size",
    "load_tokenizer",
    "micro_batches",
    "pack_documents",
    "read_documents",
    "resolve_files",
    "tokenize_corpus",
    "write_corpus_tokens",
    "write_token_file",
]


def build_dataset(data: DataConfig) -> TokenDataset:
    """The training dataset a `[data]` config section describes."""
    if data.kind == "arithmetic":
        return ArithmeticCorpus(data.seq_len, data.seed, max_operand=data.max_operand)
    if data.path is None:
        raise ValueError(f"data.kind = {data.kind!r} needs data.path; set it to the files to train on")
    if data.kind == "tokens":
        return TokenFileDataset(data.path, data.seq_len, data.dtype)
    if data.kind in DOCUMENT_KINDS:
        return CorpusDataset(data)
    raise ValueError(f"unknown data.kind {data.kind!r}; use 'arithmetic', 'tokens', {DOCUMENT_KINDS}")


def _id_ranges(data: DataConfig) -> list[tuple[int, str]]:
    """Each source of token ids in the data, as (ids it needs, what it is): the tokenizer's vocabulary
    (or byte tokens 0..255 for text without one, and the arithmetic corpus), and `data.eos_id`."""
    ranges = []
    if data.tokenizer is not None:
        size = load_tokenizer(data.tokenizer).get_vocab_size(with_added_tokens=True)
        ranges.append((size, f"the {size} ids of data.tokenizer = {data.tokenizer!r}"))
    elif data.kind != "tokens":
        ranges.append((256, f"the byte tokens (0..255) of data.kind = {data.kind!r} without data.tokenizer"))
    if data.eos_id is not None:
        ranges.append((data.eos_id + 1, f"data.eos_id = {data.eos_id}"))
    return ranges


def check_vocab_size(data: DataConfig, vocab_size: int) -> None:
    """A ValueError naming `model.vocab_size` and the `[data]` key whose ids do not fit in it (token files
    are not read: their ids are not checked)."""
    for needed, what in _id_ranges(data):
        if vocab_size < needed:
            raise ValueError(
                f"model.vocab_size = {vocab_size} is smaller than {what}; set model.vocab_size >= {needed} "
                "(a multiple of parallel.tp)"
            )
