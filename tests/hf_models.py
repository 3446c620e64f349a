"""Hugging Face `transformers` models for the suite: tiny, built offline from a config, never edited."""

from __future__ import annotations

import torch
from torch import nn

VOCAB = 128


def build(family: str, layers: int = 2, seed: int = 0, experts: int = 4) -> nn.Module:
    """A tiny GPT-2, Llama or Mixtral (of `experts` experts, top-2) causal LM in fp32, dropout off,
    initialised from `seed`."""
    import transformers
    from transformers import GPT2Config, LlamaConfig, MixtralConfig

    transformers.logging.set_verbosity_error()  # a tiny vocabulary makes GPT-2's config warn about its token ids
    torch.manual_seed(seed)
    if family == "gpt2":
        config = GPT2Config(
            n_layer=layers, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=64,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
        )  # fmt: skip
        return transformers.GPT2LMHeadModel(config)
    common = dict(
        num_hidden_layers=layers, hidden_size=64, intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64, use_cache=False,
    )  # fmt: skip
    if family == "llama":
        return transformers.LlamaForCausalLM(LlamaConfig(**common))
    if family == "mixtral":
        config = MixtralConfig(**common, num_local_experts=experts, num_experts_per_tok=2)
        return transformers.MixtralForCausalLM(config)
    raise ValueError(f"unknown family {family!r}")


def batches(count: int = 3, rows: int = 4, seq: int = 16, seed: int = 1) -> list[torch.Tensor]:
    """`count` batches of token ids (rows, seq), the same on every rank."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (rows, seq), generator=generator) for _ in range(count)]
