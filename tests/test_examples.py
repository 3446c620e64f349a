"""Tier 2: MindSpore's two documentation examples (examples/mindspore_docs.py, which `make demo` prints)
reproduce the single-device run, with the expected collectives."""

import torch
from torch.distributed.tensor.debug import CommDebugMode

import loom
from examples.mindspore_docs import matmul_chain, relu_net
from loom.dist.comm import collective_counts


def test_matmul_chain_on_4_ranks(dist_run):
    for result in dist_run(4, matmul_chain):
        checks = result["checks"]
        assert checks["Z"] < 1e-5 and checks["grad W"] < 1e-4 and checks["grad V"] < 1e-4, checks
        assert result["v_local_shape"] == (12, 4)  # V cut by columns: each rank keeps a quarter
        # forward: the hidden activation goes from rows-over-4 to replicated in ONE all-gather over 4 ranks
        # (not two over a 2 x 2 mesh); backward: its transpose (one reduce-scatter), one all-reduce for
        # W's gradient, which the four row blocks computed in parts, and the tiny all-reduce with which the
        # ranks agree on which parameters got gradients.
        assert result["collectives"] == {"all_gather": 1}, result
        assert result["backward_collectives"] == {"reduce_scatter": 1, "all_reduce": 2}, result


def test_relu_net_on_2_ranks_matches_every_step(dist_run):
    for result in dist_run(2, relu_net):
        expected, losses = zip(*result["losses"], strict=True)
        assert len(losses) == 20  # 5 epochs of 4 steps
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-6, atol=0)
        assert result["checks"]["final weight"] < 1e-6
        assert result["weight_local_shape"] == (16, 16)  # weight (32, 16) cut in two by rows
        assert result["collectives"] == {
            "reduce_scatter": 1
        }  # matmul's pending sum straight into relu's rows


def matmul_reduction_case():
    loom.init()
    generator = torch.Generator().manual_seed(0)
    x, w = torch.randn(6, 8, generator=generator), torch.randn(8, 4, generator=generator)
    matmul = loom.ops.MatMul().shard(((1, 2), (2, 1)))
    with CommDebugMode() as comm:
        y = matmul(x, w)
        full = loom.full(y)
    return collective_counts(comm), y.placements, torch.allclose(full, x @ w, atol=1e-6)


def test_matmul_with_cut_contraction_reduces_the_output_once(dist_run):
    for counts, placements, equal in dist_run(2, matmul_reduction_case):
        assert equal
        assert [p.is_partial() for p in placements] == [True]  # a pending sum until someone needs the value
        assert counts == {"all_reduce": 1}  # loom.full: one reduction of the output, nothing else
