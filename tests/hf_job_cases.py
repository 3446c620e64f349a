"""Tiny `loom train` jobs on Hugging Face models (GPT-2, Llama, Mixtral: 2 layers, hidden 64; Mixtral with 4
experts, top-2) built offline from a config.json, trained on a text file tokenised by a local word-level
tokenizer."""

from pathlib import Path

import torch
from tiny_tokenizer import SENTENCES, save_tokenizer

from loom.train.config import TrainConfig

VOCAB = 32  # the tokenizer's words and specials fit; a multiple of tp


def hf_config(family: str):
    """The tiny model's Hugging Face config (dropout off, no cache)."""
    from transformers import GPT2Config, LlamaConfig, MixtralConfig

    if family == "gpt2":
        return GPT2Config(
            n_layer=2, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=32, resid_pdrop=0.0,
            embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False, bos_token_id=1, eos_token_id=1,
        )  # fmt: skip
    common = dict(
        num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=32, use_cache=False,
        bos_token_id=1, eos_token_id=1, attention_dropout=0.0,
    )  # fmt: skip
    if family == "mixtral":  # no router loss: the model's loss is the cross entropy alone
        return MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2, output_router_logits=False)
    return LlamaConfig(**common)


def write_corpus(root: Path) -> tuple[Path, Path]:
    """A text file of the tokenizer's sentences (one document, repeated phrases) and the tokenizer's
    directory, under `root` (written once)."""
    text, tokenizer = root / "corpus.txt", root / "tokenizer"
    if not text.exists():
        text.write_text(" . ".join(SENTENCES[i % 5] for i in range(200)))
        save_tokenizer(tokenizer)
    return text, tokenizer


def hf_job(root: Path, family: str, **sections) -> TrainConfig:
    """The tiny job (2 workers, dp=2, 6 steps) on `family`'s model from a config.json under `root`, each of
    `sections` merged over its defaults (`model={"hf_pretrained": dir}` replaces the config file)."""
    text, tokenizer = write_corpus(root)
    config_file = root / f"{family}.json"
    if not config_file.exists():
        hf_config(family).to_json_file(config_file)
    config = {
        "model": {"hf_config": str(config_file)},
        "data": {"kind": "text", "path": str(text), "tokenizer": str(tokenizer), "seq_len": 16},
        "parallel": {"dp": 2},
        "train": {"steps": 6, "global_batch": 8, "workers": 2, "eval_every": 0, "log_every": 100,
                  "warmup_steps": 1, "lr": 1e-2, "eps": 1e-3},
    }  # fmt: skip
    for section, values in sections.items():
        config[section] = {**config.get(section, {}), **values}
    if "hf_pretrained" in config["model"]:
        del config["model"]["hf_config"]
    return TrainConfig.from_dict(config)


def first_batch(config: TrainConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """The job's first global batch (inputs, targets), as one device reads it."""
    from loom.train.data import DistributedBatches, build_dataset

    batches = DistributedBatches(
        build_dataset(config.data), config.train.global_batch, 0, 1, seed=config.train.seed
    )
    return tuple(next(iter(batches)))
