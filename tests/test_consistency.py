"""Tier 2: nothing wrong in silence. Ranks that break loom's promises (the same strategy everywhere, plain
tensors the same global tensor on every rank, even local batches) get a clear error naming what differs and
which ranks disagree, instead of garbage. The cases run batched, one worker round trip per world size."""

from __future__ import annotations

import os
from contextlib import contextmanager

import pytest
import torch
from torch import nn
from torch.distributed.tensor.debug import CommDebugMode

import loom
from loom import ops
from loom.dist import consistency
from loom.dist.comm import collective_counts


@contextmanager
def check_setting(value: str | None):
    saved = os.environ.get(consistency.ENV)
    if value is None:
        os.environ.pop(consistency.ENV, None)
    else:
        os.environ[consistency.ENV] = value
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(consistency.ENV, None)
        else:
            os.environ[consistency.ENV] = saved


def _error(fn) -> str | None:
    """The message of the error `fn()` raises (None if it returns)."""
    try:
        fn()
    except Exception as error:  # noqa: BLE001  (the message is what the tests check)
        return str(error)
    return None


class Chain(nn.Module):
    """x @ w with a strategy given per rank (to break it on purpose)."""

    def __init__(self, strategy):
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 4, generator=torch.Generator().manual_seed(1)))
        self.mm = ops.MatMul().shard(strategy)

    def forward(self, x):
        return self.mm(x, self.w)


def _same(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def two_rank_cases() -> dict:
    rank = loom.rank()
    loom.init()
    own = _same(8, 8, seed=100 + rank)  # a different tensor on every rank
    same = _same(8, 8)
    w = _same(8, 4, seed=1)
    out: dict = {}
    # 1. ranks that pass different strategies to the same operator
    strategy = ((2, 1), (1, 1)) if rank == 0 else ((1, 2), (2, 1))
    out["strategy"] = _error(lambda: ops.MatMul().shard(strategy)(same, w))
    # 2. a "replicated" (plain) input that differs across ranks, to a primitive and to loom.shard
    out["primitive input"] = _error(lambda: ops.MatMul().shard(((2, 1), (1, 1)))(own, w))
    out["shard input"] = _error(lambda: loom.shard(torch.relu, ((2, 1),))(own))
    # agreeing ranks pass; one all-gather of 40 bytes per rank per check, hidden from CommDebugMode
    before = consistency.stats()
    matmul = ops.MatMul().shard(((1, 2), (2, 1)))
    with CommDebugMode() as comm:
        y = loom.full(matmul(same, w))
    after = consistency.stats()
    out["counted"] = collective_counts(comm)
    out["cost"] = (after["checks"] - before["checks"], after["bytes_sent"] - before["bytes_sent"])
    out["equal"] = torch.allclose(y, same @ w, atol=1e-5)
    # the default checks the first call only; LOOM_CHECK=1 every call; LOOM_CHECK=0 never
    out["second call"] = _error(lambda: matmul(own, w))
    with check_setting("1"):
        out["second call, LOOM_CHECK=1"] = _error(lambda: matmul(own, w))
    with check_setting("0"):
        out["LOOM_CHECK=0"] = _error(lambda: ops.MatMul().shard(((2, 1), (1, 1)))(own, w))
    with check_setting("maybe"):
        out["bad setting"] = _error(lambda: ops.MatMul().shard(((2, 1), (1, 1)))(own, w))
    # 3. semi_auto: a strategy that depends on the rank is refused before any parameter moves
    out["semi_auto strategy"] = _error(
        lambda: loom.parallelize(Chain(strategy), mode="semi_auto", example_inputs=(same,), full_batch=True)
    )
    # 4. full_batch=True with different data per rank: the first forward refuses it
    model = loom.parallelize(
        Chain(((2, 1), (1, 1))), mode="semi_auto", example_inputs=(same,), full_batch=True
    )
    out["full batch"] = _error(lambda: model(own))
    out["full batch agreeing"] = _error(lambda: model(same))
    # a lone tensor as example_inputs is taken as (x,); a plain target outside the model: model.loom.distribute
    model = loom.parallelize(Chain(((2, 1), (1, 1))), mode="semi_auto", example_inputs=same)
    target = _same(8, 4, seed=5)
    output = model(same)
    out["mixed"] = _error(lambda: output - target) or "no error"
    out["distributed target"] = torch.allclose(
        loom.full(output - model.loom.distribute(target)),
        torch.cat([same, same]) @ w - torch.cat([target, target]),
        atol=1e-5,
    )
    # 5. data parallelism: local batches of 4 and 1 rows are refused at the gradient sync
    loom.init()
    dp = loom.parallelize(nn.Linear(8, 2), mode="data_parallel")
    rows = 4 if rank == 0 else 1
    out["uneven dp"] = _error(lambda: dp(_same(rows, 8)).sum().backward())
    out["even dp"] = _error(lambda: dp(_same(4, 8)).sum().backward())
    with torch.no_grad():
        out["uneven dp, no grad"] = _error(lambda: dp(_same(rows, 8)))
    # 6. a mesh without a batch axis: refused unless batch_axes says what the axes carry
    loom.init({"tp": 2})
    out["no batch axis"] = _error(
        lambda: loom.parallelize(Chain(((1, 1), (1, 2))), "semi_auto", example_inputs=(same,))
    )
    model = loom.parallelize(Chain(((1, 1), (1, 2))), "semi_auto", example_inputs=(same,), batch_axes=())
    out["batch_axes=() differing"] = _error(lambda: model(own))
    model = loom.parallelize(Chain(((2, 1), (1, 1))), "semi_auto", example_inputs=(own,), batch_axes="tp")
    local = model(own)
    out["batch_axes=tp rows"] = torch.allclose(
        loom.full(local), torch.cat([_same(8, 8, seed=100 + r) for r in range(2)]) @ w, atol=1e-5
    )
    out["unknown batch axis"] = _error(
        lambda: loom.parallelize(
            Chain(((1, 1), (1, 2))), "semi_auto", example_inputs=(same,), batch_axes="dp"
        )
    )
    return out


@pytest.fixture(scope="module")
def two_ranks(dist_run):
    return dist_run(2, two_rank_cases)


def test_different_strategies_on_the_ranks_are_named(two_ranks):
    for result in two_ranks:
        message = result["strategy"]
        assert "the strategy of MatMul differs" in message, message
        assert (
            "rank 0: MatMul().shard(((2, 1), (1, 1)))" in message
            and "rank 1: MatMul().shard(((1, 2), (2, 1)))" in message
        )
        assert "same strategy" in message and "LOOM_CHECK=0" in message


@pytest.mark.parametrize("case", ["primitive input", "shard input"])
def test_replicated_inputs_that_differ_are_named(two_ranks, case):
    what = {"primitive input": "MatMul input x (a plain tensor)", "shard input": "loom.shard(relu) input #0"}[
        case
    ]
    for result in two_ranks:
        message = result[case]
        assert f"{what}" in message and "differs across ranks" in message, message
        assert "rank 0: shape (8, 8) float32" in message and "rank 1: shape (8, 8) float32" in message
        assert "torch.manual_seed" in message


def test_agreeing_ranks_pass_with_one_hidden_all_gather(two_ranks):
    for result in two_ranks:
        assert result["equal"]
        assert result["counted"] == {"all_reduce": 1}  # loom.full of the pending sum only, not the check
        assert result["cost"] == (1, 40)  # one all-gather, 5 int64 from each rank


def test_check_settings(two_ranks):
    for result in two_ranks:
        assert result["second call"] is None  # first call only, by default: the documented limit
        assert "MatMul input x" in result["second call, LOOM_CHECK=1"]
        assert result["LOOM_CHECK=0"] is None
        assert "LOOM_CHECK='maybe' is not a setting: use LOOM_CHECK=1" in result["bad setting"]


def test_semi_auto_refuses_rank_dependent_strategies_and_differing_full_batches(two_ranks):
    for result in two_ranks:
        message = result["semi_auto strategy"]
        assert "loom.parallelize(mode='semi_auto')" in message, message
        assert "the strategy of operator #0 (MatMul) differs" in message
        message = result["full batch"]
        assert "the first forward of a semi_auto model" in message and "input #0 (a plain tensor)" in message
        assert "full_batch=True every rank must bring the same whole batch" in message
        assert result["full batch agreeing"] is None


def test_target_outside_the_model_is_distributed_like_the_inputs(two_ranks):
    for result in two_ranks:
        assert "mixed torch.Tensor and DTensor" in result["mixed"]  # torch's own error, documented
        assert result["distributed target"]


def test_uneven_data_parallel_batches_are_refused_with_sizes_per_rank(two_ranks):
    for result in two_ranks:
        message = result["uneven dp"]
        assert "local batches of different sizes" in message and "rank 0: 4, rank 1: 1" in message, message
        assert "drop_last=True" in message
        assert result["even dp"] is None and result["uneven dp, no grad"] is None


def test_mesh_without_batch_axis_needs_batch_axes(two_ranks):
    for result in two_ranks:
        message = result["no batch axis"]
        assert (
            "has no 'dp' axis" in message and "batch_axes=('tp',)" in message and "batch_axes=()" in message
        )
        assert "input #0 (a plain tensor) differs" in result["batch_axes=() differing"]
        assert result["batch_axes=tp rows"]  # the tp ranks' rows stacked: the global batch
        assert "batch_axes names 'dp', which is not an axis" in result["unknown batch axis"]


class TensorParallel(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(_same(8, 4, seed=1))
        self.mm = ops.MatMul().shard(((2, 1), (1, 2)))

    def forward(self, x):
        return self.mm(x, self.w)


def four_rank_cases() -> dict:
    mesh = loom.init({"dp": 2, "tp": 2})
    dp_rank, tp_rank = mesh.dp_rank(), mesh.axis_rank("tp")
    rows = _same(4, 8, seed=10 + dp_rank)  # each dp rank its own rows; tp peers the same
    model = loom.parallelize(TensorParallel(), "semi_auto", example_inputs=(rows,))
    out = {"agreeing": _error(lambda: model(rows))}
    model = loom.parallelize(TensorParallel(), "semi_auto", example_inputs=(rows,))
    out["tp peers differ"] = _error(lambda: model(_same(4, 8, seed=10 + dp_rank + 2 * tp_rank)))
    return out


def test_ranks_reading_the_same_rows_must_agree(dist_run):
    for result in dist_run(4, four_rank_cases):
        assert result["agreeing"] is None
        message = result["tp peers differ"]
        assert "differs across ranks that read the same rows of the batch (they must agree)" in message, (
            message
        )
        assert "ranks 0" not in message and "rank 0:" in message and "rank 1:" in message
