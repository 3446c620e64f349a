"""Tier 3: `loom train` on a JSONL corpus with a local tokenizer (built offline): the loss falls, and a run
killed after step 4 resumes from its checkpoint with the steps of the uninterrupted run (its restart maps
the ids that the first attempt kept in `data.cache_dir`)."""

import json

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from loom.cli.main import main

WORDS = "the cat sat on the mat and the dog lay on the log by the cat".split()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A JSONL file of short documents and the word-level tokenizer of their words (saved with an
    `eos_token` as `transformers` saves one)."""
    root = tmp_path_factory.mktemp("corpus")
    documents = [" ".join(WORDS[i % 7 : i % 7 + 8]) for i in range(200)]
    (root / "train.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in documents))
    tokenizer = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.train_from_iterator(
        documents, trainer=trainers.WordLevelTrainer(special_tokens=["[UNK]", "</s>"])
    )
    (root / "tokenizer").mkdir()
    tokenizer.save(str(root / "tokenizer" / "tokenizer.json"))
    (root / "tokenizer" / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    return root, tokenizer.get_vocab_size()


def write_config(path, corpus_dir, vocab_size, run_dir):
    path.write_text(f"""
[model]
vocab_size = {vocab_size}
d_model = 32
n_layers = 1
n_heads = 2
max_seq_len = 16

[data]
kind = "jsonl"
path = "{corpus_dir / "train.jsonl"}"
tokenizer = "{corpus_dir / "tokenizer"}"
seq_len = 16
cache_dir = "{run_dir / "tokens"}"

[parallel]
dp = 2

[train]
steps = 8
global_batch = 8
workers = 2
lr = 1e-2
warmup_steps = 2
eval_every = 0
log_every = 1
metrics_file = "{run_dir / "metrics.jsonl"}"

[checkpoint]
dir = "{run_dir / "ckpt"}"
every_steps = 4
""")
    return path


def step_losses(run_dir):
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {line["step"]: line["loss"] for line in lines if line["kind"] == "step"}


@pytest.fixture(scope="module")
def straight(tmp_path_factory, corpus):
    """The losses of an uninterrupted 8-step run."""
    corpus_dir, vocab = corpus
    root = tmp_path_factory.mktemp("straight")
    assert main(["train", str(write_config(root / "a.toml", corpus_dir, vocab, root))]) == 0
    return step_losses(root)


def test_train_on_jsonl_with_a_tokenizer(straight):
    assert sorted(straight) == list(range(1, 9))
    assert straight[8] < 0.7 * straight[1], straight  # a corpus of repeated phrases: the loss falls fast


@pytest.mark.slow  # two more runs; resume itself is covered for every data kind in tests/test_data_sources.py
def test_a_killed_run_resumes_at_the_exact_batch(tmp_path, corpus, straight, monkeypatch, capfd):
    corpus_dir, vocab = corpus
    monkeypatch.setenv("LOOM_FAULTS", '[{"kind": "exit", "rank": 0, "step": 5}]')
    assert main(["train", str(write_config(tmp_path / "b.toml", corpus_dir, vocab, tmp_path))]) == 0
    assert "resumed from" in capfd.readouterr().out
    resumed = step_losses(tmp_path)
    # bitwise (the same machine): the restart read the batches that follow step 4's data position
    assert [resumed[s] for s in range(5, 9)] == [straight[s] for s in range(5, 9)]
