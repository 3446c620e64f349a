"""Named model shapes: GPT-3, Llama 3, Mixtral, and the models of the validation tables; config files."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

from loom.cost.transformer import TransformerConfig
from loom.files import read_table

__all__ = ["PRESETS", "get_model", "load_model_config"]


def _gpt(name: str, layers: int, hidden: int, heads: int) -> TransformerConfig:
    return TransformerConfig(
        name=name, layers=layers, hidden=hidden, heads=heads, vocab=51200, learned_positions=2048
    )


def _llama(name: str, layers: int, hidden: int, heads: int, ffn: int, **extra) -> TransformerConfig:
    options = {"kv_heads": 8, "vocab": 128256, "gated_mlp": True, "norm": "rmsnorm", "biases": False}
    options |= {"dropout": False, "tied_embeddings": False} | extra
    return TransformerConfig(name=name, layers=layers, hidden=hidden, heads=heads, ffn_hidden=ffn, **options)


PRESETS: dict[str, TransformerConfig] = {
    "gpt3-175b": _gpt("gpt3-175b", 96, 12288, 96),
    "llama3-8b": _llama("llama3-8b", 32, 4096, 32, 14336),
    "llama3-70b": _llama("llama3-70b", 80, 8192, 64, 28672),
    "llama3-405b": _llama("llama3-405b", 126, 16384, 128, 53248),
    "mixtral-8x7b": _llama("mixtral-8x7b", 32, 4096, 32, 14336, vocab=32000, experts=8, top_k=2),
    # Korthikanti et al. 2022, Table 3
    "gpt-22b": _gpt("gpt-22b", 48, 6144, 64),
    "gpt-530b": _gpt("gpt-530b", 105, 20480, 128),
    "gpt-1t": _gpt("gpt-1t", 128, 25600, 160),
    # Narayanan et al. 2021, Table 1 (named by their parameter counts in billions)
    "gpt-1.7b": _gpt("gpt-1.7b", 24, 2304, 24),
    "gpt-3.6b": _gpt("gpt-3.6b", 30, 3072, 32),
    "gpt-7.5b": _gpt("gpt-7.5b", 36, 4096, 32),
    "gpt-18.4b": _gpt("gpt-18.4b", 40, 6144, 48),
    "gpt-39.1b": _gpt("gpt-39.1b", 48, 8192, 64),
    "gpt-76.1b": _gpt("gpt-76.1b", 60, 10240, 80),
    "gpt-145.6b": _gpt("gpt-145.6b", 80, 12288, 96),
    "gpt-310.1b": _gpt("gpt-310.1b", 96, 16384, 128),
    "gpt-529.6b": _gpt("gpt-529.6b", 105, 20480, 128),
    "gpt-1008b": _gpt("gpt-1008b", 128, 25600, 160),
}

# Hugging Face config.json keys -> TransformerConfig fields
_HF_KEYS = {
    "num_hidden_layers": "layers",
    "hidden_size": "hidden",
    "num_attention_heads": "heads",
    "num_key_value_heads": "kv_heads",
    "intermediate_size": "ffn_hidden",
    "vocab_size": "vocab",
    "num_local_experts": "experts",
    "num_experts_per_tok": "top_k",
    "tie_word_embeddings": "tied_embeddings",
}


def get_model(name: str) -> TransformerConfig:
    """A preset by name."""
    if name not in PRESETS:
        raise ValueError(
            f"unknown model {name!r}: give a preset ({', '.join(PRESETS)}), --model-config FILE, a CONFIG.toml, "
            "or a Python function that builds the model as MODULE:FUNCTION (e.g. mypkg.models:build)"
        )
    return PRESETS[name]


def load_model_config(path: str | Path) -> TransformerConfig:
    """A model from a TOML or JSON file of `TransformerConfig` fields, or a Hugging Face config.json."""
    path = Path(path)
    data = read_table(path, "model config")
    data = data.get("model", data)
    if not isinstance(data, dict):
        raise ValueError(f"{path}: 'model' must be a table of TransformerConfig fields, got {data!r}")
    data = dict(data)
    if "hidden_size" in data:  # a Hugging Face config: Llama-style unless it says otherwise
        hf = {ours: data[theirs] for theirs, ours in _HF_KEYS.items() if theirs in data}
        hf.setdefault("tied_embeddings", False)
        gated = data.get("hidden_act", "silu") == "silu"
        data = {
            "name": path.stem,
            "gated_mlp": gated,
            "norm": "rmsnorm",
            "biases": False,
            "dropout": False,
        } | hf
    known = {f.name for f in fields(TransformerConfig)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"{path}: unknown model fields {unknown}; known: {sorted(known)}")
    try:
        return TransformerConfig(**data)
    except TypeError as exc:
        raise ValueError(f"{path}: {exc}") from exc
