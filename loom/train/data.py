"""Datasets and distributed loading, deterministic given the seed and the data-parallel rank.

Every dataset here is map-style (`len(ds)`, `ds[i] -> (input_ids, targets)`, LongTensors of `seq_len`
tokens, `targets` shifted by one), so that `DistributedBatches` can shuffle and shard them with nothing
but an index permutation, and a resumed run can continue from an `(epoch, index)` position.

- `TokenFileDataset`: a nanoGPT-style `.bin` file of raw token ids, memory-mapped.
- `TextFileDataset`: a UTF-8 text file, tokenized with `ByteTokenizer`.
- `ArithmeticCorpus`: a synthetic corpus ("12+7=19") that a small GPT learns in a few hundred CPU steps.
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch

if TYPE_CHECKING:
    from loom.train.config import DataConfig

__all__ = [
    "ArithmeticCorpus",
    "ByteTokenizer",
    "DistributedBatches",
    "TextFileDataset",
    "TokenDataset",
    "TokenFileDataset",
    "build_dataset",
    "check_data_file",
    "micro_batches",
    "write_token_file",
]

Batch = tuple[torch.Tensor, torch.Tensor]
TOKEN_DTYPES = ("uint16", "uint32")


class TokenDataset(Protocol):
    """What `DistributedBatches` reads: a length and `(input_ids, targets)` pairs of equal length."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> Batch: ...


def _check_dtype(dtype: str) -> np.dtype:
    if dtype not in TOKEN_DTYPES:
        raise ValueError(f"token dtype {dtype!r} is not supported; use one of {TOKEN_DTYPES}")
    return np.dtype(dtype)


def _check_seq_len(seq_len: int) -> None:
    if not isinstance(seq_len, int) or isinstance(seq_len, bool) or seq_len < 1:
        raise ValueError(f"seq_len must be a positive integer, got {seq_len!r}")


def check_data_file(kind: str, path: str | Path, dtype: str = "uint16") -> Path:
    """The file `data.path` names for `data.kind` ("tokens" or "text"), checked without reading it: it exists,
    is a file, can be read and (tokens) holds whole `dtype` ids. Raises a ValueError naming `data.path`."""
    path = Path(path)
    what = "token file (raw ids, see write_token_file)" if kind == "tokens" else "UTF-8 text file"
    if not path.exists():
        raise ValueError(f"data.path = {str(path)!r} does not exist; point data.path at a {what}")
    if not path.is_file():
        raise ValueError(f"data.path = {str(path)!r} is a directory, not a file; point data.path at a {what}")
    if not os.access(path, os.R_OK):
        raise ValueError(f"data.path = {str(path)!r} cannot be read (permission denied); fix its permissions")
    if kind == "tokens":
        size, itemsize = path.stat().st_size, _check_dtype(dtype).itemsize
        if size % itemsize:
            raise ValueError(
                f"data.path = {str(path)!r} has {size} bytes, not a multiple of the {itemsize}-byte "
                f"{dtype} of data.dtype; set data.dtype to the dtype the file was written with"
            )
    return path


def _window(tokens: np.ndarray | Sequence[int], start: int, seq_len: int) -> Batch:
    """`seq_len + 1` tokens from `start`, as (inputs, targets) shifted by one."""
    chunk = torch.from_numpy(np.asarray(tokens[start : start + seq_len + 1], dtype=np.int64))
    return chunk[:-1], chunk[1:]


class _WindowDataset:
    """Non-overlapping windows of `seq_len + 1` tokens over a 1-D token array (the last token of a window
    is the first of the next, so every token is a target exactly once)."""

    def __init__(self, tokens: np.ndarray, seq_len: int, source: str) -> None:
        _check_seq_len(seq_len)
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
        return _window(self.tokens, index * self.seq_len, self.seq_len)


def write_token_file(path: str | Path, tokens: Sequence[int] | np.ndarray, dtype: str = "uint16") -> None:
    """Write token ids as a raw `.bin` file (native byte order, no header), as nanoGPT's prepare scripts do."""
    np_dtype = _check_dtype(dtype)
    array = np.asarray(tokens, dtype=np.int64)
    if array.size and (array.min() < 0 or array.max() > np.iinfo(np_dtype).max):
        raise ValueError(
            f"token ids span [{array.min()}, {array.max()}], outside {dtype}; use dtype='uint32' for vocabularies over 65536"
        )
    array.astype(np_dtype).tofile(path)


class TokenFileDataset(_WindowDataset):
    """A `.bin` file of raw token ids (nanoGPT format), memory-mapped: only the windows read are paged in.

    Sample `i` is tokens `[i * seq_len, (i + 1) * seq_len + 1)`, returned as `(input_ids, targets)`.
    """

    def __init__(self, path: str | Path, seq_len: int, dtype: str = "uint16") -> None:
        np_dtype = _check_dtype(dtype)
        path = check_data_file("tokens", path, dtype)
        size = path.stat().st_size
        tokens = np.memmap(path, dtype=np_dtype, mode="r") if size else np.zeros(0, dtype=np_dtype)
        super().__init__(tokens, seq_len, f"token file {str(path)!r}")
        self.path, self.dtype = path, dtype

    def __getstate__(self) -> dict[str, Any]:
        # Pickling a memmap copies the whole file; a worker process re-opens the file instead.
        return {"path": self.path, "seq_len": self.seq_len, "dtype": self.dtype}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["path"], state["seq_len"], state["dtype"])


class ByteTokenizer:
    """Bytes of UTF-8 as tokens 0..255; special tokens (e.g. "<bos>", "<eos>", "<pad>") get ids 256, 257, ...

    `vocab_size` is `256 + len(specials)`. `decode` drops special ids and replaces invalid UTF-8 (a model's
    output may cut a multi-byte character in half).
    """

    def __init__(self, specials: Sequence[str] = ()) -> None:
        if len(set(specials)) != len(specials):
            raise ValueError(f"special tokens {list(specials)} contain duplicates")
        self.specials = tuple(specials)
        self._special_ids = {name: 256 + i for i, name in enumerate(self.specials)}

    @property
    def vocab_size(self) -> int:
        """Number of token ids: 256 bytes plus the specials."""
        return 256 + len(self.specials)

    def special_id(self, name: str) -> int:
        """The id of special token `name` (e.g. `tok.special_id("<eos>")`)."""
        if name not in self._special_ids:
            raise ValueError(f"no special token {name!r}; this tokenizer has {list(self.specials)}")
        return self._special_ids[name]

    def encode(self, text: str, *, bos: str | None = None, eos: str | None = None) -> list[int]:
        """Byte ids of `text`, optionally framed by the special tokens named `bos` and `eos`."""
        ids = list(text.encode("utf-8"))
        if bos is not None:
            ids.insert(0, self.special_id(bos))
        if eos is not None:
            ids.append(self.special_id(eos))
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        """Text of the byte ids in `ids`; special ids are dropped, invalid UTF-8 becomes U+FFFD."""
        data = bytes(int(i) for i in ids if 0 <= int(i) < 256)
        return data.decode("utf-8", errors="replace")


class TextFileDataset(_WindowDataset):
    """A UTF-8 text file, tokenized once in memory, sampled in windows like `TokenFileDataset`."""

    def __init__(self, path: str | Path, seq_len: int, tokenizer: ByteTokenizer | None = None) -> None:
        path = check_data_file("text", path)
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            raise ValueError(f"text file {str(path)!r} is not valid UTF-8 ({exc}); convert it first") from exc
        self.tokenizer = tokenizer or ByteTokenizer()
        # int32 holds any vocabulary a byte tokenizer can have, at half the memory of int64.
        tokens = np.asarray(self.tokenizer.encode(text), dtype=np.int32)
        super().__init__(tokens, seq_len, f"text file {str(path)!r}")
        self.path = path


class ArithmeticCorpus:
    """Synthetic arithmetic in bytes: lines such as `"12+7=19\\n"` and `"40-13=27\\n"`, packed into windows.

    The task: operands are uniform integers in `[0, max_operand]`; `ops` picks among addition and
    subtraction (the larger operand comes first, so results are never negative). Sample `i` is the first
    `seq_len + 1` bytes of a run of fresh lines drawn from a generator seeded with `(seed, i)` only, so it
    never depends on what was read before, on the rank or on the process; each window starts at a line.
    The question digits are random (unlearnable), the answer digits after `=` are a function of the
    question: that is what a model learns, and what `accuracy` measures by exact match on prompts drawn
    from another seed (with small operands every fact also occurs in training: this tests learning, not
    generalisation).
    The default, single-digit operands, is what a small model learns in a few hundred CPU steps: with 32
    sequences of 32 tokens per step and AdamW at 3e-3 (cosine), a byte-level GPT with d_model=128 answered
    about 55% of 200 prompts exactly after 300 steps with 2 layers (0.44M parameters) and about 80%
    with 4 layers (0.83M). Operands up to 19 or 99 stayed under 15% after 300 steps: they need longer runs.

    Token ids are bytes (vocab 256): use `ByteTokenizer` to encode prompts and decode generations.
    """

    def __init__(
        self, seq_len: int, seed: int = 0, *, max_operand: int = 9, ops: str = "+-", size: int = 1_000_000
    ) -> None:
        _check_seq_len(seq_len)
        if not isinstance(max_operand, int) or max_operand < 1:
            raise ValueError(f"max_operand must be an integer >= 1, got {max_operand!r}")
        if not ops or set(ops) - {"+", "-"}:
            raise ValueError(f"ops {ops!r} must be made of '+' and '-', e.g. '+' or '+-'")
        if size < 1:
            raise ValueError(f"size must be >= 1, got {size}")
        self.seq_len, self.seed, self.max_operand, self.ops, self.size = seq_len, seed, max_operand, ops, size
        self.tokenizer = ByteTokenizer()

    def __len__(self) -> int:
        # The corpus is unbounded; `size` only gives shuffling and epochs something finite to count.
        return self.size

    def _problem(self, rng: random.Random) -> tuple[str, str]:
        a, b = rng.randint(0, self.max_operand), rng.randint(0, self.max_operand)
        op = rng.choice(self.ops)
        if op == "-":
            a, b = max(a, b), min(a, b)
            return f"{a}-{b}=", str(a - b)
        return f"{a}+{b}=", str(a + b)

    def text(self, index: int) -> str:
        """The `seq_len + 1` characters of sample `index`."""
        if not 0 <= index < self.size:
            raise IndexError(f"sample {index} out of range for {self.size} samples")
        # A string seed is hashed with SHA-512 by `random`, the same in every process (unlike hash()).
        rng = random.Random(f"loom-arithmetic:{self.seed}:{index}")
        parts, length = [], 0
        while length < self.seq_len + 1:
            prompt, answer = self._problem(rng)
            parts.append(f"{prompt}{answer}\n")
            length += len(parts[-1])
        return "".join(parts)[: self.seq_len + 1]

    def __getitem__(self, index: int) -> Batch:
        return _window(self.tokenizer.encode(self.text(index)), 0, self.seq_len)

    def prompts(self, n: int, seed: int | None = None) -> list[tuple[str, str]]:
        """`n` evaluation pairs such as `("12+7=", "19")`, from `seed` (default: the corpus seed)."""
        rng = random.Random(f"loom-arithmetic-prompts:{self.seed if seed is None else seed}")
        return [self._problem(rng) for _ in range(n)]

    @property
    def max_answer_tokens(self) -> int:
        """Tokens an answer may take, with its closing newline."""
        return len(str(2 * self.max_operand)) + 1

    def accuracy(self, generate: Callable[[str, int], str], n: int = 100, seed: int | None = None) -> float:
        """Exact-match accuracy of `generate(prompt, max_new_tokens) -> text` on `n` prompts.

        The generated text is read up to its first newline; a generation that repeats the prompt first is
        accepted too (the prompt is stripped).
        """
        if n < 1:
            raise ValueError(f"accuracy needs n >= 1 prompts, got {n}")
        correct = 0
        for prompt, answer in self.prompts(n, seed):
            out = generate(prompt, self.max_answer_tokens)
            out = out.removeprefix(prompt)
            correct += out.split("\n", 1)[0].strip() == answer
        return correct / n


class DistributedBatches:
    """This data-parallel rank's rows of each global batch, one step after another, epoch after epoch.

    Each epoch visits the dataset in the order of `torch.randperm(len(dataset))` drawn from a generator
    seeded with `seed + epoch` (or in order when `shuffle=False`); step `k` of an epoch takes the global
    batch `order[k * global_batch : (k + 1) * global_batch]` and this rank keeps rows
    `[dp_rank * local, (dp_rank + 1) * local)`, `local = global_batch // dp_size`. So the global batch is
    the local batches concatenated on dim 0 in dp-rank order, whatever `dp_size` is, and tensor-parallel
    peers (same `dp_rank`) read the same rows. A short last batch is dropped (`drop_last=True`) or filled
    with the first samples of the epoch's order, so every step has `global_batch` rows.

    The iterator is endless; `state_dict()` records `(epoch, index)` so that `load_state_dict` continues
    exactly where a checkpointed run stopped (also with another `dp_size`).
    """

    def __init__(
        self,
        dataset: TokenDataset,
        global_batch: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        seed: int = 0,
        shuffle: bool = True,
        drop_last: bool = True,
    ) -> None:
        if global_batch < 1 or dp_size < 1:
            raise ValueError(f"global_batch ({global_batch}) and dp_size ({dp_size}) must be >= 1")
        if global_batch % dp_size:
            raise ValueError(
                f"global_batch {global_batch} is not divisible by the data-parallel size {dp_size}; "
                f"use a multiple of {dp_size}"
            )
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} out of range for dp_size {dp_size}")
        if drop_last and len(dataset) < global_batch:
            raise ValueError(
                f"the dataset has {len(dataset)} samples, fewer than one global batch of {global_batch}; "
                "use more data, a smaller global batch, or drop_last=False"
            )
        self.dataset, self.global_batch, self.seed = dataset, global_batch, seed
        self.dp_rank, self.dp_size, self.shuffle, self.drop_last = dp_rank, dp_size, shuffle, drop_last
        self.local_batch = global_batch // dp_size
        self.epoch, self.index = 0, 0  # position: samples of this epoch's order already consumed
        self._order: torch.Tensor | None = None

    @property
    def steps_per_epoch(self) -> int:
        """Global batches in one pass over the dataset."""
        n = len(self.dataset)
        return n // self.global_batch if self.drop_last else -(-n // self.global_batch)

    def _epoch_order(self) -> torch.Tensor:
        if self._order is None:
            n = len(self.dataset)
            if self.shuffle:
                generator = torch.Generator().manual_seed(self.seed + self.epoch)
                self._order = torch.randperm(n, generator=generator)
            else:
                self._order = torch.arange(n)
        return self._order

    def _global_indices(self) -> torch.Tensor:
        order = self._epoch_order()
        indices = order[self.index : self.index + self.global_batch]
        if len(indices) < self.global_batch:  # drop_last=False: fill from the start of the epoch
            fill = order.repeat(-(-self.global_batch // len(order)))
            indices = torch.cat([indices, fill[: self.global_batch - len(indices)]])
        return indices

    def _advance(self) -> None:
        self.index += self.global_batch
        if self.index + (self.global_batch if self.drop_last else 1) > len(self.dataset):
            self.epoch, self.index, self._order = self.epoch + 1, 0, None

    def __iter__(self) -> Iterator[Batch]:
        return self

    def __next__(self) -> Batch:
        rows = self._global_indices()[self.dp_rank * self.local_batch : (self.dp_rank + 1) * self.local_batch]
        samples = [self.dataset[int(i)] for i in rows]
        self._advance()
        return torch.stack([s[0] for s in samples]), torch.stack([s[1] for s in samples])

    def state_dict(self) -> dict[str, Any]:
        """The data position (and what it depends on), for a checkpoint."""
        return {"epoch": self.epoch, "index": self.index, "seed": self.seed, "dataset_len": len(self.dataset)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a position saved by `state_dict` (the same dataset and seed are required)."""
        for key, mine in (("seed", self.seed), ("dataset_len", len(self.dataset))):
            if key in state and state[key] != mine:
                raise ValueError(
                    f"the saved data position has {key}={state[key]} but this loader has {key}={mine}; "
                    "resume with the data settings of the checkpointed run"
                )
        self.epoch, self.index, self._order = int(state["epoch"]), int(state["index"]), None


def micro_batches(batch: Sequence[torch.Tensor], n: int) -> list[tuple[torch.Tensor, ...]]:
    """Split a local batch (tensors sharing dim 0) into `n` gradient-accumulation micro-batches."""
    rows = batch[0].shape[0]
    if n < 1 or rows % n:
        raise ValueError(
            f"a local batch of {rows} rows cannot be split into {n} micro-batches; "
            "make global_batch divisible by dp * grad_accum"
        )
    return list(zip(*(t.chunk(n, dim=0) for t in batch), strict=True))


def build_dataset(data: DataConfig) -> TokenDataset:
    """The training dataset a `[data]` config section describes."""
    if data.kind == "arithmetic":
        return ArithmeticCorpus(data.seq_len, data.seed, max_operand=data.max_operand)
    if data.path is None:
        raise ValueError(f"data.kind = {data.kind!r} needs data.path; set it to the file to train on")
    if data.kind == "tokens":
        return TokenFileDataset(data.path, data.seq_len, data.dtype)
    if data.kind == "text":
        return TextFileDataset(data.path, data.seq_len)
    raise ValueError(f"unknown data.kind {data.kind!r}; use 'arithmetic', 'tokens' or 'text'")
