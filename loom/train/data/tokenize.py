"""Tokenizers: UTF-8 bytes (`ByteTokenizer`, no file needed) or a local Hugging Face `tokenizers` file.

`data.tokenizer` names a `tokenizer.json` or a directory holding one (as `save_pretrained` of
`transformers` writes it); it is read with `tokenizers.Tokenizer.from_file`, offline. Documents are encoded
without the tokenizer's own special tokens (no BOS from its post-processor) and each is followed by one
end-of-sequence id: `data.eos_id` when set, else the `eos_token` that the directory's
`tokenizer_config.json` (or `special_tokens_map.json`) names. Byte tokens have no EOS unless `data.eos_id`
sets one.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "ByteTokenizer",
    "Encoder",
    "byte_encoder",
    "hf_encoder",
    "load_tokenizer",
    "tokenizer_eos_id",
    "tokenizer_file",
]

# Encodes a batch of documents into one id array each.
Encoder = Callable[[Sequence[str]], list[np.ndarray]]


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


def tokenizer_file(path: str | Path) -> Path:
    """The `tokenizer.json` that `data.tokenizer` names (the file, or the one inside a directory)."""
    path = Path(path)
    file = path / "tokenizer.json" if path.is_dir() else path
    if not file.is_file():
        raise ValueError(
            f"data.tokenizer = {str(path)!r}: no such file{' (tokenizer.json)' if path.is_dir() else ''}; point "
            "data.tokenizer at a tokenizer.json or a directory saved by save_pretrained"
        )
    return file


def load_tokenizer(path: str | Path) -> Any:
    """The `tokenizers.Tokenizer` that `data.tokenizer` names, read offline."""
    file = tokenizer_file(path)
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise ValueError(
            "data.tokenizer needs the tokenizers package; install it with pip install 'loom[hf]'"
        ) from None
    try:
        return Tokenizer.from_file(str(file))
    except Exception as exc:  # tokenizers raises a bare Exception for a malformed file
        raise ValueError(
            f"data.tokenizer = {str(path)!r}: {str(file)!r} is not a tokenizer file ({exc})"
        ) from None


def _configured_eos(directory: Path) -> str | None:
    """The `eos_token` that `transformers` saved beside the tokenizer, if any."""
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        file = directory / name
        if file.is_file():
            eos = json.loads(file.read_text(encoding="utf-8")).get("eos_token")
            if isinstance(eos, dict):  # an AddedToken saved as {"content": ..., ...}
                eos = eos.get("content")
            if isinstance(eos, str):
                return eos
    return None


def tokenizer_eos_id(tokenizer: Any, path: str | Path) -> int:
    """The end-of-sequence id of the tokenizer at `path`, from the `eos_token` of its directory's
    `tokenizer_config.json` or `special_tokens_map.json`; a ValueError saying to set `data.eos_id` when
    there is none (the message lists the tokenizer's special tokens)."""
    directory = Path(path) if Path(path).is_dir() else Path(path).parent
    eos = _configured_eos(directory)
    if eos is not None and tokenizer.token_to_id(eos) is not None:
        return tokenizer.token_to_id(eos)
    why = (
        f"its eos_token {eos!r} is not in the vocabulary"
        if eos is not None
        else "no eos_token in tokenizer_config.json or special_tokens_map.json"
    )
    specials = {t.content: i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}
    found = f"the special tokens are {specials}" if specials else "it has no special tokens"
    raise ValueError(
        f"data.tokenizer = {str(path)!r} names no end-of-sequence token ({why}; {found}); set data.eos_id "
        "to the id that ends a document"
    )


def hf_encoder(tokenizer: Any) -> Encoder:
    """An `Encoder` over a `tokenizers.Tokenizer` (batches are encoded in parallel by the library)."""

    def encode(texts: Sequence[str]) -> list[np.ndarray]:
        encodings = tokenizer.encode_batch(list(texts), add_special_tokens=False)
        return [np.asarray(e.ids, dtype=np.int32) for e in encodings]

    return encode


def byte_encoder(texts: Sequence[str]) -> list[np.ndarray]:
    """An `Encoder` of UTF-8 bytes (ids 0..255), as `ByteTokenizer.encode` without specials."""
    return [np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32) for text in texts]
