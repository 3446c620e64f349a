"""Tier 1: datasets (shapes, shift, determinism, errors), the arithmetic corpus, and DistributedBatches."""

import pickle
import re

import numpy as np
import pytest
import torch

from loom.train.config import DataConfig
from loom.train.data import (
    ArithmeticCorpus,
    ByteTokenizer,
    DistributedBatches,
    TextFileDataset,
    TokenFileDataset,
    build_dataset,
    micro_batches,
    write_token_file,
)


class RangeDataset:
    """Sample i is (i, i + 1) repeated: rows of a batch tell which samples it holds."""

    def __init__(self, n: int, seq_len: int = 3) -> None:
        self.n, self.seq_len = n, seq_len

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.full((self.seq_len,), i), torch.full((self.seq_len,), i + 1)


# --- token and text files -------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_token_file_windows_are_shifted_by_one(tmp_path, dtype):
    path = tmp_path / "train.bin"
    big = 70_000 if dtype == "uint32" else 60_000
    tokens = [big, *range(1, 41)]
    write_token_file(path, tokens, dtype)
    ds = TokenFileDataset(path, seq_len=8, dtype=dtype)
    assert len(ds) == (41 - 1) // 8
    x, y = ds[0]
    assert x.dtype == y.dtype == torch.long and x.shape == y.shape == (8,)
    assert x.tolist() == tokens[:8] and y.tolist() == tokens[1:9]
    x, y = ds[4]
    assert x.tolist() == tokens[32:40] and y.tolist() == tokens[33:41]
    with pytest.raises(IndexError):
        ds[5]


def test_token_file_errors(tmp_path):
    short = tmp_path / "short.bin"
    write_token_file(short, [1, 2, 3], "uint16")
    with pytest.raises(ValueError, match=r"3 tokens, fewer than one sample of seq_len \+ 1 = 9"):
        TokenFileDataset(short, seq_len=8)
    odd = tmp_path / "odd.bin"
    odd.write_bytes(b"\x00" * 10)
    with pytest.raises(ValueError, match="10 bytes, not a multiple of the 4-byte uint32"):
        TokenFileDataset(odd, seq_len=1, dtype="uint32")
    with pytest.raises(ValueError, match="does not exist"):
        TokenFileDataset(tmp_path / "missing.bin", seq_len=4)
    with pytest.raises(ValueError, match="token dtype 'int8'"):
        TokenFileDataset(short, seq_len=1, dtype="int8")
    with pytest.raises(ValueError, match="outside uint16; use dtype='uint32'"):
        write_token_file(tmp_path / "big.bin", [70_000], "uint16")


def test_byte_tokenizer_round_trip_and_specials():
    tok = ByteTokenizer(specials=("<bos>", "<eos>", "<pad>"))
    assert tok.vocab_size == 259 and tok.special_id("<eos>") == 257
    ids = tok.encode("héllo", bos="<bos>", eos="<eos>")
    assert ids[0] == 256 and ids[-1] == 257 and len(ids) == 2 + len("héllo".encode())
    assert tok.decode(ids) == "héllo"
    assert tok.decode(list("é".encode())[:1]) == "\ufffd"  # half a character: replaced, never raises
    with pytest.raises(ValueError, match="no special token '<sep>'"):
        tok.special_id("<sep>")
    assert ByteTokenizer().vocab_size == 256


def test_text_file_dataset(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text("hello world, héllo wörld\n" * 4, encoding="utf-8")
    ds = TextFileDataset(path, seq_len=16)
    data = path.read_bytes()
    assert len(ds) == (len(data) - 1) // 16
    x, y = ds[1]
    assert bytes(x.tolist()) == data[16:32] and bytes(y.tolist()) == data[17:33]
    bad = tmp_path / "latin1.txt"
    bad.write_bytes(b"caf\xe9" * 10)
    with pytest.raises(ValueError, match="not valid UTF-8"):
        TextFileDataset(bad, seq_len=4)


def test_build_dataset_from_config(tmp_path):
    assert isinstance(build_dataset(DataConfig()), ArithmeticCorpus)
    path = tmp_path / "t.bin"
    write_token_file(path, range(100), "uint32")
    ds = build_dataset(DataConfig(kind="tokens", path=str(path), dtype="uint32", seq_len=9))
    assert isinstance(ds, TokenFileDataset) and len(ds) == 11


# --- arithmetic corpus ----------------------------------------------------------------------------------


def test_arithmetic_lines_parse_and_are_correct():
    corpus = ArithmeticCorpus(seq_len=64, seed=3, max_operand=50)
    seen_ops = set()
    for i in range(50):
        text = corpus.text(i)
        assert len(text) == 65
        for line in text.split("\n")[:-1]:  # the last line is cut by the window
            a, op, b, result = re.fullmatch(r"(\d+)([+-])(\d+)=(\d+)", line).groups()
            a, b, result = int(a), int(b), int(result)
            assert 0 <= b <= 50 and 0 <= a <= 50
            assert result == (a + b if op == "+" else a - b)
            seen_ops.add(op)
    assert seen_ops == {"+", "-"}
    x, y = corpus[7]
    assert x.shape == y.shape == (64,) and torch.equal(x[1:], y[:-1])
    assert bytes(x.tolist()).decode() == corpus.text(7)[:64]


def test_arithmetic_samples_depend_only_on_seed_and_index():
    a, b = ArithmeticCorpus(32, seed=1), ArithmeticCorpus(32, seed=1)
    order = [5, 0, 999_999, 5]
    assert [a.text(i) for i in order] == [b.text(i) for i in reversed(order)][::-1]
    assert a.text(5) != ArithmeticCorpus(32, seed=2).text(5)
    assert a.text(5) != a.text(6)
    with pytest.raises(IndexError):
        a.text(len(a))


def test_arithmetic_prompts_and_accuracy():
    corpus = ArithmeticCorpus(32, seed=0, max_operand=20, ops="+")
    pairs = corpus.prompts(20, seed=7)
    assert pairs == corpus.prompts(20, seed=7) and pairs != corpus.prompts(20, seed=8)
    for prompt, answer in pairs:
        a, b = re.fullmatch(r"(\d+)\+(\d+)=", prompt).groups()
        assert int(answer) == int(a) + int(b)
    asked = []

    def oracle(prompts: list[str], max_new_tokens: int) -> list[str]:
        asked.append((len(prompts), max_new_tokens))
        sums = (sum(map(int, prompt[:-1].split("+"))) for prompt in prompts)
        return [f"{total}\n7+" for total in sums]

    assert corpus.accuracy(oracle, n=20) == 1.0
    assert asked == [(20, corpus.max_answer_tokens)] and corpus.max_answer_tokens == 3
    assert corpus.accuracy(lambda ps, n: [p + "0\n" for p in ps], n=20) == pytest.approx(
        sum(a == "0" for _, a in corpus.prompts(20)) / 20
    )
    with pytest.raises(ValueError, match="answered 1 texts for 20 prompts"):
        corpus.accuracy(lambda ps, n: ["0"], n=20)
    with pytest.raises(ValueError, match="ops '\\*'"):
        ArithmeticCorpus(32, ops="*")


# --- distributed batches --------------------------------------------------------------------------------


def take(batches: DistributedBatches, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [next(batches) for _ in range(steps)]


def test_dp_ranks_concatenate_to_the_global_batch():
    ds = RangeDataset(50)
    whole = take(DistributedBatches(ds, 8, seed=4), 12)  # crosses epochs (6 steps each)
    ranks = [take(DistributedBatches(ds, 8, dp_rank=r, dp_size=4, seed=4), 12) for r in range(4)]
    for step, (x, y) in enumerate(whole):
        assert x.shape == (8, 3)
        assert torch.equal(torch.cat([ranks[r][step][0] for r in range(4)]), x)
        assert torch.equal(torch.cat([ranks[r][step][1] for r in range(4)]), y)
    epoch0 = torch.cat([x[:, 0] for x, _ in whole[:6]])
    assert len(set(epoch0.tolist())) == 48  # no repeats inside an epoch
    assert not torch.equal(epoch0, torch.cat([x[:, 0] for x, _ in whole[6:]]))  # reshuffled per epoch


def test_tensor_parallel_peers_read_the_same_data():
    ds = ArithmeticCorpus(16, seed=0, size=64)
    peers = [take(DistributedBatches(ds, 4, dp_rank=1, dp_size=2, seed=9), 3) for _ in range(2)]
    for (x0, y0), (x1, y1) in zip(*peers, strict=True):
        assert torch.equal(x0, x1) and torch.equal(y0, y1)


def test_state_round_trip_resumes_identically():
    ds = RangeDataset(30)
    straight = take(DistributedBatches(ds, 4, dp_rank=1, dp_size=2, seed=1), 20)
    first = DistributedBatches(ds, 4, dp_rank=1, dp_size=2, seed=1)
    take(first, 9)
    state = first.state_dict()
    assert state["epoch"] == 1 and state["index"] == 8  # 7 steps per epoch
    resumed = DistributedBatches(ds, 4, dp_rank=1, dp_size=2, seed=1)
    resumed.load_state_dict(state)
    for (x, y), (x_ref, y_ref) in zip(take(resumed, 11), straight[9:], strict=True):
        assert torch.equal(x, x_ref) and torch.equal(y, y_ref)
    with pytest.raises(ValueError, match="seed=1 but this loader has seed=2"):
        DistributedBatches(ds, 4, seed=2).load_state_dict(state)


def test_no_shuffle_and_keep_last():
    batches = DistributedBatches(RangeDataset(5), 2, shuffle=False, drop_last=False)
    assert batches.steps_per_epoch == 3
    rows = [x[:, 0].tolist() for x, _ in take(batches, 4)]
    assert rows == [[0, 1], [2, 3], [4, 0], [0, 1]]


def test_distributed_batches_errors():
    with pytest.raises(ValueError, match="global_batch 10 is not divisible by the data-parallel size 4"):
        DistributedBatches(RangeDataset(40), 10, dp_size=4)
    with pytest.raises(ValueError, match="dp_rank 2 out of range"):
        DistributedBatches(RangeDataset(40), 8, dp_rank=2, dp_size=2)
    with pytest.raises(ValueError, match="fewer than one global batch of 8"):
        DistributedBatches(RangeDataset(5), 8)


def test_micro_batches_split_rows():
    x, y = torch.arange(12).reshape(6, 2), torch.arange(12).reshape(6, 2) + 1
    parts = micro_batches((x, y), 3)
    assert len(parts) == 3 and all(px.shape == (2, 2) for px, _ in parts)
    assert torch.equal(torch.cat([p[0] for p in parts]), x) and torch.equal(
        torch.cat([p[1] for p in parts]), y
    )
    with pytest.raises(ValueError, match="6 rows cannot be split into 4 micro-batches"):
        micro_batches((x, y), 4)


def test_token_file_with_numpy_memmap_is_not_copied(tmp_path):
    path = tmp_path / "t.bin"
    write_token_file(path, np.arange(1000), "uint16")
    ds = TokenFileDataset(path, 10)
    assert isinstance(ds.tokens, np.memmap)
    copy = pickle.loads(pickle.dumps(ds))  # as sent to a worker process: re-opened, not copied
    assert len(pickle.dumps(ds)) < 1000 and isinstance(copy.tokens, np.memmap)
    assert torch.equal(copy[3][0], ds[3][0])
