"""Tier 1: real-data sources (text / JSONL / Parquet / token files), a local tokenizer built offline, packing
with end-of-sequence ids, shuffling, exact resume (also on another data-parallel size), and errors."""

import json
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from tiny_tokenizer import SENTENCES, save_tokenizer, word_tokenizer
from tokenizers import Tokenizer

from loom.train.config import DataConfig, TrainConfig
from loom.train.data import (
    CorpusDataset,
    DistributedBatches,
    TokenFileDataset,
    build_dataset,
    packing,
    read_documents,
    resolve_files,
    tokenize_corpus,
    write_corpus_tokens,
    write_token_file,
)

DOCS = [" ".join(SENTENCES[i % 5] for i in range(k, k + 3)) for k in range(12)]  # 12 documents


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    """The tokenizer saved as `transformers` saves one (tokenizer.json + tokenizer_config.json)."""
    return save_tokenizer(tmp_path_factory.mktemp("tokenizer"))


def expected_ids(tokenizer_dir, documents, eos=1):
    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    return [i for d in documents for i in [*tok.encode(d, add_special_tokens=False).ids, eos]]


def write_jsonl(path, documents, field="text"):
    lines = [json.dumps({field: d, "id": i}) for i, d in enumerate(documents)]
    path.write_text("\n".join(lines[:3] + [""] + lines[3:]) + "\n")  # a blank line is skipped
    return path


def write_parquet(path, documents, field="text", row_group_size=5):
    table = pa.table({"id": list(range(len(documents))), field: documents})
    pq.write_table(table, path, row_group_size=row_group_size)
    return path


def data_config(kind, path, seq_len=8, *, tokenizer=None, **keys) -> DataConfig:
    """A `[data]` section for the corpus at `path`."""
    tokenizer = None if tokenizer is None else str(tokenizer)
    return DataConfig(kind=kind, path=str(path), seq_len=seq_len, tokenizer=tokenizer, **keys)


def take(batches, steps):
    return [next(batches) for _ in range(steps)]


# --- sources --------------------------------------------------------------------------------------------


def test_paths_resolve_to_sorted_files(tmp_path):
    for name in ["b.jsonl", "a.jsonl", "sub/c.jsonl", ".hidden/d.jsonl", "notes.txt"]:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("{}\n")
    names = lambda files: [f.relative_to(tmp_path).as_posix() for f in files]  # noqa: E731
    assert names(resolve_files("jsonl", tmp_path)) == ["a.jsonl", "b.jsonl", "sub/c.jsonl"]
    assert names(resolve_files("jsonl", f"{tmp_path}/*.jsonl")) == ["a.jsonl", "b.jsonl"]
    assert names(resolve_files("jsonl", f"{tmp_path}/**/c.jsonl")) == ["sub/c.jsonl"]
    assert names(resolve_files("text", tmp_path / "notes.txt")) == ["notes.txt"]
    with pytest.raises(ValueError, match=r"data.path = .*missing.jsonl' does not exist"):
        resolve_files("jsonl", tmp_path / "missing.jsonl")
    with pytest.raises(ValueError, match=r"matches no files; point data.path at a JSONL file"):
        resolve_files("jsonl", f"{tmp_path}/*.json")
    with pytest.raises(ValueError, match=r"is a directory with no .parquet files"):
        resolve_files("parquet", tmp_path)


def test_jsonl_and_parquet_yield_the_same_documents(tmp_path):
    documents = DOCS[:7]
    jsonl = write_jsonl(tmp_path / "d.jsonl", documents, field="body")
    parquet = write_parquet(tmp_path / "d.parquet", documents, field="body", row_group_size=3)
    assert pq.ParquetFile(parquet).num_row_groups == 3
    assert list(read_documents("jsonl", [jsonl], "body")) == documents
    assert list(read_documents("parquet", [parquet], "body")) == documents
    text = tmp_path / "t.txt"
    text.write_text("para one\n\npara two\n")
    assert list(read_documents("text", [text])) == ["para one\n\npara two\n"]  # one document per file


def test_nulls_and_empty_texts_are_skipped(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "a b"}\n{"text": null}\n{"text": ""}\n{"text": "c"}\n')
    assert list(read_documents("jsonl", [path])) == ["a b", "c"]
    write_parquet(tmp_path / "d.parquet", ["x", None, "", "y"])
    assert list(read_documents("parquet", [tmp_path / "d.parquet"])) == ["x", "y"]


def test_source_errors_name_the_key(tmp_path):
    jsonl = write_jsonl(tmp_path / "d.jsonl", DOCS[:2])
    with pytest.raises(
        ValueError, match=r"line 1 has no field data.text_field = 'body' \(it has \['id', 'text'\]\)"
    ):
        list(read_documents("jsonl", [jsonl], "body"))
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{"text": oops}\n')
    with pytest.raises(ValueError, match=r"line 2 is not valid JSON"):
        list(read_documents("jsonl", [tmp_path / "bad.jsonl"]))
    (tmp_path / "list.jsonl").write_text('["text"]\n')
    with pytest.raises(ValueError, match=r"line 1 is a JSON list, not an object"):
        list(read_documents("jsonl", [tmp_path / "list.jsonl"]))
    (tmp_path / "num.jsonl").write_text('{"text": 3}\n')
    with pytest.raises(ValueError, match=r"data.text_field = 'text' holds a int, not text"):
        list(read_documents("jsonl", [tmp_path / "num.jsonl"]))
    parquet = write_parquet(tmp_path / "d.parquet", DOCS[:2])
    with pytest.raises(ValueError, match=r"no column data.text_field = 'body' \(it has \['id', 'text'\]\)"):
        list(read_documents("parquet", [parquet], "body"))
    with pytest.raises(ValueError, match=r"column data.text_field = 'id' holds int64, not text"):
        list(read_documents("parquet", [parquet], "id"))
    with pytest.raises(ValueError, match=r"is not a readable Parquet file"):
        list(read_documents("parquet", [jsonl]))
    (tmp_path / "latin1.txt").write_bytes(b"caf\xe9")
    with pytest.raises(ValueError, match="not valid UTF-8"):
        list(read_documents("text", [tmp_path / "latin1.txt"]))


def test_parquet_without_pyarrow_says_what_to_install(tmp_path, monkeypatch):
    parquet = write_parquet(tmp_path / "d.parquet", DOCS[:2])
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # import pyarrow now raises ImportError
    with pytest.raises(
        ValueError, match=r"data.kind = 'parquet' needs pyarrow; install it with pip install 'loom\[hf\]'"
    ):
        list(read_documents("parquet", [parquet]))


# --- tokenising and packing -----------------------------------------------------------------------------


def test_documents_are_tokenised_with_eos_after_each(tmp_path, tokenizer_dir):
    write_jsonl(tmp_path / "a.jsonl", DOCS[:5])
    write_jsonl(tmp_path / "b.jsonl", DOCS[5:])
    tokens, _ = tokenize_corpus(data_config("jsonl", tmp_path, tokenizer=tokenizer_dir))
    assert tokens.tolist() == expected_ids(tokenizer_dir, DOCS)
    assert (tokens == 1).sum() == len(DOCS) and tokens[-1] == 1 and not (tokens == 0).any()  # no [UNK]
    # the same documents from Parquet (several row groups), from text files, or from tokenizer.json alone
    # with an explicit eos_id, give the same ids
    write_parquet(tmp_path / "all.parquet", DOCS)
    assert (
        tokenize_corpus(data_config("parquet", tmp_path / "all.parquet", tokenizer=tokenizer_dir))[0].tolist()
        == tokens.tolist()
    )
    for i, document in enumerate(DOCS):
        (tmp_path / f"doc{i:02d}.txt").write_text(document)
    assert (
        tokenize_corpus(data_config("text", tmp_path, tokenizer=tokenizer_dir))[0].tolist() == tokens.tolist()
    )
    bare = tokenize_corpus(
        data_config("jsonl", tmp_path, tokenizer=tokenizer_dir / "tokenizer.json", eos_id=1)
    )[0]
    assert bare.tolist() == tokens.tolist()


def test_byte_tokens_without_a_tokenizer(tmp_path):
    write_jsonl(tmp_path / "d.jsonl", ["héllo", "wörld"])
    tokens, _ = tokenize_corpus(data_config("jsonl", tmp_path / "d.jsonl"))
    assert bytes(tokens.tolist()) == "héllowörld".encode()  # no separator unless data.eos_id sets one
    tokens, _ = tokenize_corpus(data_config("jsonl", tmp_path / "d.jsonl", eos_id=10))
    assert bytes(tokens.tolist()) == "héllo\nwörld\n".encode()


def test_windows_pack_the_token_stream_without_padding(tmp_path, tokenizer_dir):
    write_jsonl(tmp_path / "d.jsonl", DOCS)
    ds = CorpusDataset(data_config("jsonl", tmp_path / "d.jsonl", seq_len=8, tokenizer=tokenizer_dir))
    ids = expected_ids(tokenizer_dir, DOCS)
    assert len(ds) == (len(ids) - 1) // 8
    for i in range(len(ds)):
        x, y = ds[i]
        assert (
            x.dtype == torch.long
            and x.tolist() == ids[i * 8 : i * 8 + 8]
            and y.tolist() == ids[i * 8 + 1 : i * 8 + 9]
        )
    documents_crossed = [(ds[i][0] == 1).any().item() for i in range(len(ds))]
    assert any(documents_crossed)  # windows run across document ends: packing, not one document per row


def test_corpus_is_tokenised_once_per_process_and_again_when_a_file_changes(tmp_path, tokenizer_dir):
    path = write_jsonl(tmp_path / "d.jsonl", DOCS)
    first, fingerprint = tokenize_corpus(data_config("jsonl", path, tokenizer=tokenizer_dir))
    again, same = tokenize_corpus(data_config("jsonl", path, tokenizer=tokenizer_dir))
    assert again is first and same == fingerprint and not first.flags.writeable
    write_jsonl(path, DOCS[::-1])
    changed, other = tokenize_corpus(data_config("jsonl", path, tokenizer=tokenizer_dir))
    assert other != fingerprint and sorted(changed.tolist()) == sorted(first.tolist())


def test_cache_dir_keeps_the_ids_for_later_starts(tmp_path, tokenizer_dir, monkeypatch):
    path = write_jsonl(tmp_path / "d.jsonl", DOCS)
    data = data_config("jsonl", path, tokenizer=tokenizer_dir, cache_dir=str(tmp_path / "cache"))
    tokens, fingerprint = tokenize_corpus(data)
    (cached,) = (tmp_path / "cache").iterdir()
    assert tokens.tolist() == expected_ids(tokenizer_dir, DOCS) and cached.stat().st_size == 4 * len(tokens)
    packing._tokenized.cache_clear()  # as a new process would start

    def no_tokenising(*args):
        raise AssertionError("the corpus was tokenised again")

    monkeypatch.setattr(packing, "pack_documents", no_tokenising)
    again, same = tokenize_corpus(data)
    assert isinstance(again, np.memmap) and again.tolist() == tokens.tolist() and same == fingerprint
    monkeypatch.undo()
    write_jsonl(path, DOCS[:6])  # another corpus: another file in the cache
    assert len(tokenize_corpus(data)[0]) < len(tokens) and len(list((tmp_path / "cache").iterdir())) == 2
    (tmp_path / "blocked").write_text("")
    with pytest.raises(ValueError, match=r"data.cache_dir = .*blocked/sub' cannot be written"):
        tokenize_corpus(data_config("jsonl", path, cache_dir=str(tmp_path / "blocked" / "sub")))


def test_pre_tokenised_corpus_reads_like_the_documents(tmp_path, tokenizer_dir):
    write_jsonl(tmp_path / "d.jsonl", DOCS)
    dtype = write_corpus_tokens(
        data_config("jsonl", tmp_path / "d.jsonl", tokenizer=tokenizer_dir), tmp_path / "d.bin"
    )
    packed = CorpusDataset(data_config("jsonl", tmp_path / "d.jsonl", 8, tokenizer=tokenizer_dir))
    tokens = TokenFileDataset(tmp_path / "d.bin", 8, dtype)
    assert dtype == "uint16" and len(tokens) == len(packed)
    assert all(torch.equal(tokens[i][0], packed[i][0]) for i in range(len(packed)))


def test_several_token_files_are_one_stream(tmp_path):
    (tmp_path / "shards").mkdir()
    write_token_file(tmp_path / "shards/00.bin", range(0, 10))
    write_token_file(tmp_path / "shards/01.bin", [])
    write_token_file(tmp_path / "shards/02.bin", range(10, 25))
    ds = TokenFileDataset(tmp_path / "shards", seq_len=4)
    assert len(ds) == 6
    for i in range(len(ds)):  # window 2 spans the first, empty and last files
        assert ds[i][0].tolist() == list(range(4 * i, 4 * i + 4)) and ds[i][1].tolist() == list(
            range(4 * i + 1, 4 * i + 5)
        )
    with pytest.raises(ValueError, match=r"shards/02.bin' has 30 bytes, not a multiple of the 4-byte uint32"):
        TokenFileDataset(tmp_path / "shards", seq_len=4, dtype="uint32")


def test_corpus_errors(tmp_path, tokenizer_dir):
    (tmp_path / "empty.jsonl").write_text('{"text": ""}\n\n')
    with pytest.raises(ValueError, match=r"data.path = .*empty.jsonl' holds no documents"):
        CorpusDataset(data_config("jsonl", tmp_path / "empty.jsonl", 8, tokenizer=tokenizer_dir))
    write_jsonl(tmp_path / "short.jsonl", ["the cat"])
    with pytest.raises(ValueError, match=r"holds 3 tokens, fewer than one sample of seq_len \+ 1 = 9"):
        CorpusDataset(data_config("jsonl", tmp_path / "short.jsonl", 8, tokenizer=tokenizer_dir))
    with pytest.raises(ValueError, match=r"data.tokenizer = .*nowhere'.*no such file"):
        CorpusDataset(data_config("jsonl", tmp_path / "short.jsonl", 2, tokenizer=tmp_path / "nowhere"))
    (tmp_path / "broken.json").write_text("{not a tokenizer")
    with pytest.raises(ValueError, match=r"is not a tokenizer file"):
        CorpusDataset(data_config("jsonl", tmp_path / "short.jsonl", 2, tokenizer=tmp_path / "broken.json"))
    bare = tmp_path / "bare"
    bare.mkdir()
    word_tokenizer().save(str(bare / "tokenizer.json"))
    with pytest.raises(ValueError, match=r"names no end-of-sequence token .*'<eos>': 1.*set data.eos_id"):
        CorpusDataset(data_config("jsonl", tmp_path / "short.jsonl", 2, tokenizer=bare))


# --- config ---------------------------------------------------------------------------------------------


def config(tmp_path, tokenizer_dir, model=None, **data):
    write_jsonl(tmp_path / "d.jsonl", DOCS)
    data = {
        "kind": "jsonl",
        "path": str(tmp_path / "d.jsonl"),
        "tokenizer": str(tokenizer_dir),
        "seq_len": 8,
        **data,
    }
    return TrainConfig.from_dict({"model": {"max_seq_len": 8, **(model or {})}, "data": data})


def test_build_dataset_and_vocab_checks(tmp_path, tokenizer_dir):
    vocab = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json")).get_vocab_size()
    cfg = config(tmp_path, tokenizer_dir, model={"vocab_size": vocab})
    cfg.validate()
    assert isinstance(build_dataset(cfg.data), CorpusDataset)
    with pytest.raises(
        ValueError,
        match=rf"model.vocab_size = {vocab - 1} is smaller than the {vocab} ids of data.tokenizer = .*; set model.vocab_size >= {vocab}",
    ):
        config(tmp_path, tokenizer_dir, model={"vocab_size": vocab - 1}).validate()
    with pytest.raises(
        ValueError, match=rf"smaller than data.eos_id = {vocab}; set model.vocab_size >= {vocab + 1}"
    ):
        config(tmp_path, tokenizer_dir, model={"vocab_size": vocab}, eos_id=vocab).validate()
    with pytest.raises(
        ValueError, match=r"byte tokens \(0..255\) of data.kind = 'jsonl' without data.tokenizer"
    ):
        config(tmp_path, tokenizer_dir, model={"vocab_size": 100}, tokenizer=None).validate()
    with pytest.raises(
        ValueError, match=r"data.tokenizer = .* out of range: the arithmetic corpus is byte tokens"
    ):
        DataConfig(kind="arithmetic", tokenizer=str(tokenizer_dir))
    with pytest.raises(ValueError, match=r"data.eos_id = -1 is out of range"):
        DataConfig(kind="jsonl", path="x", eos_id=-1)


# --- shuffling and exact resume -------------------------------------------------------------------------


@pytest.fixture
def corpus(tmp_path, tokenizer_dir):
    write_jsonl(tmp_path / "d.jsonl", DOCS)
    return lambda: CorpusDataset(data_config("jsonl", tmp_path / "d.jsonl", 8, tokenizer=tokenizer_dir))


def test_window_shuffle_is_deterministic_by_seed(corpus):
    ds = corpus()
    a, b = take(DistributedBatches(ds, 4, seed=3), 6), take(DistributedBatches(corpus(), 4, seed=3), 6)
    assert all(torch.equal(x, x2) and torch.equal(y, y2) for (x, y), (x2, y2) in zip(a, b, strict=True))
    c = take(DistributedBatches(ds, 4, seed=4), 6)
    assert not all(torch.equal(x, x2) for (x, _), (x2, _) in zip(a, c, strict=True))
    straight = torch.cat([ds[i][0] for i in range(len(ds))])
    assert not torch.equal(torch.cat([x.flatten() for x, _ in a]), straight[: 6 * 4 * 8])  # shuffled


@pytest.mark.parametrize("resume_dp", [2, 1, 4])
def test_resume_from_the_saved_position_gives_the_next_batches(corpus, resume_dp):
    """Read 7 steps on dp=2, save the position, rebuild the corpus and loaders from nothing (dp may change):
    the following global batches equal those of an uninterrupted run, across an epoch boundary."""
    straight = take(DistributedBatches(corpus(), 8, seed=5), 20)
    assert len(corpus()) // 8 == 5  # steps per epoch: the run crosses epochs, the position is inside one
    ranks = [DistributedBatches(corpus(), 8, dp_rank=r, dp_size=2, seed=5) for r in range(2)]
    for _ in range(7):
        [next(r) for r in ranks]
    state = ranks[0].state_dict()
    assert state == ranks[1].state_dict() and state["fingerprint"] == corpus().fingerprint
    assert (state["epoch"], state["index"]) == (1, 16)  # inside the second epoch
    resumed = [
        DistributedBatches(corpus(), 8, dp_rank=r, dp_size=resume_dp, seed=5) for r in range(resume_dp)
    ]
    for loader in resumed:
        loader.load_state_dict(state)
    for step in range(7, 20):
        rows = [next(loader) for loader in resumed]
        assert torch.equal(torch.cat([x for x, _ in rows]), straight[step][0])
        assert torch.equal(torch.cat([y for _, y in rows]), straight[step][1])


def test_resume_refuses_another_corpus(tmp_path, tokenizer_dir):
    path = write_jsonl(tmp_path / "d.jsonl", DOCS)
    state = DistributedBatches(
        CorpusDataset(data_config("jsonl", path, 4, tokenizer=tokenizer_dir)), 4
    ).state_dict()
    write_jsonl(path, DOCS[::-1])  # same tokens, other order: same length, other fingerprint
    other = DistributedBatches(CorpusDataset(data_config("jsonl", path, 4, tokenizer=tokenizer_dir)), 4)
    assert len(other.dataset) == state["dataset_len"]
    with pytest.raises(
        ValueError, match=r"the saved data position has fingerprint=.* resume with the data settings"
    ):
        other.load_state_dict(state)


def test_token_positions_without_fingerprint_still_resume(tmp_path):
    write_token_file(tmp_path / "t.bin", np.arange(200) % 50)
    state = DistributedBatches(TokenFileDataset(tmp_path / "t.bin", 8), 4).state_dict()
    assert "fingerprint" not in state  # token files are memory-mapped, never hashed whole
    DistributedBatches(TokenFileDataset(tmp_path / "t.bin", 8), 4).load_state_dict(state)
