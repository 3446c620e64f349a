"""Tier 1: the per-operator strategy space (`loom.plan.space`) from DTensor's sharding rules, and the one
adapter to DTensor's private API (`loom.plan._dtensor_rules`). Single process, no workers."""

from __future__ import annotations

import pytest
import torch
from hf_models import build
from torch import nn
from torch.distributed.tensor import Partial, Replicate, Shard

from loom.models.mlp import MLP
from loom.plan import _dtensor_rules
from loom.plan.capture import capture
from loom.plan.opcost import meta_tensor
from loom.plan.space import edges, layouts, op_space, strategy_space

R, P, S0, S1, S2 = Replicate(), Partial(), Shard(0), Shard(1), Shard(2)
IDS = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))


@torch.library.custom_op("loom_plan_test::mystery", mutates_args=())
def mystery(x: torch.Tensor) -> torch.Tensor:
    """An operator DTensor has no sharding rule (and autograd no formula) for."""
    return x * 2


@mystery.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


class Mysterious(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return mystery(self.linear(x)).sum()


def axis(space, name: str = "tp") -> dict[tuple, tuple]:
    """One axis's candidates as {(input placements...): (output placements...)} with one placement each."""
    return {
        tuple(ps[0] for ps in c.inputs): tuple(ps[0] if ps else None for ps in c.outputs)
        for c in space.per_axis[name]
    }


def shares(space, name: str = "tp") -> dict[tuple, float]:
    return {tuple(ps[0] for ps in c.inputs): c.share[name] for c in space.per_axis[name]}


@pytest.fixture(scope="module")
def mlp():
    return capture(MLP(16, 32, 8, depth=2), (torch.randn(4, 16),))


@pytest.fixture(scope="module")
def llama():
    return capture(build("llama", layers=3), (IDS,), {"labels": IDS})


def test_the_private_dtensor_api_is_where_the_adapter_expects_it():
    problems = _dtensor_rules.check()
    assert problems == [], (
        f"DTensor's private sharding API moved: {problems}. Only loom/plan/_dtensor_rules.py uses it "
        f"({', '.join(_dtensor_rules.PRIVATE_API)}); adapt that module to this torch."
    )


def test_a_linear_layer_has_column_and_row_parallel_candidates():
    graph = capture(nn.Linear(16, 32, bias=False), (torch.randn(2, 8, 16),))
    (mm,) = (n.name for n in graph.ops() if n.target == "aten.mm.default")
    space = op_space(graph, mm, {"tp": 2})
    found = axis(space)
    assert found[(R, S1)] == (S1,)  # column parallel: the weight's output features cut, outputs cut alike
    assert found[(S1, S0)] == (P,)  # row parallel: the inner dim cut, each device holds a partial sum
    assert found[(S0, R)] == (S0,)  # data parallel: the rows cut
    assert found[(R, R)] == (R,)
    assert shares(space)[(R, S1)] == shares(space)[(S1, S0)] == shares(space)[(S0, R)] == 0.5
    assert shares(space)[(R, R)] == 1.0
    (transpose,) = (n.name for n in graph.ops() if n.target == "aten.t.default")
    assert axis(op_space(graph, transpose, {"tp": 2}))[(S0,)] == (S1,)  # weight rows = mm's columns


def test_a_linear_layer_with_bias(mlp):
    (first, _) = (n.name for n in mlp.ops() if n.target == "aten.addmm.default")
    found = axis(op_space(mlp, first, {"tp": 2}))  # inputs: bias, activation, transposed weight
    assert found[(S0, R, S1)] == (S1,)
    assert any(ins[1:] == (S1, S0) and outs == (P,) for ins, outs in found.items())


def test_a_pointwise_operator_follows_its_input(mlp):
    (gelu,) = (n.name for n in mlp.ops() if n.target == "aten.gelu.default")
    space = op_space(mlp, gelu, {"dp": 2, "tp": 2})
    found = axis(space)
    assert found == {(R,): (R,), (S0,): (S0,), (S1,): (S1,)}  # gelu of a partial sum needs the sum first
    assert all(c.outputs == c.inputs for c in space.candidates)
    assert ((S0, S1),) in [c.inputs for c in space.candidates]
    assert shares(space) == {(R,): 1.0, (S0,): 0.5, (S1,): 0.5}


def test_candidates_on_a_two_axis_mesh(mlp):
    (_, second) = (n.name for n in mlp.ops() if n.target == "aten.addmm.default")
    space = op_space(mlp, second, {"dp": 2, "tp": 2})
    batch_and_columns = next(c for c in space.candidates if c.inputs[1:] == ((S0, R), (R, S1)))
    assert batch_and_columns.outputs == ((S0, S1),)
    assert dict(batch_and_columns.share) == {"dp": 0.5, "tp": 0.5} and batch_and_columns.total_share == 0.25
    assert len(space.candidates) == len(space.per_axis["dp"]) * len(space.per_axis["tp"])
    # rows of 4 cannot be cut 4 x 4 ways: no candidate cuts the rows on both axes of a 4 x 4 mesh
    wide = op_space(mlp, second, {"dp": 4, "tp": 4})
    assert wide.candidates and all(c.inputs[1][0] != S0 or c.inputs[1][1] != S0 for c in wide.candidates)


def test_a_convolution_never_cuts_one_dim_over_two_axes():
    """DTensor runs convolutions by a propagation rule that maps each tensor dim to one mesh axis: a batch cut
    over dp and tp ([Shard(0), Shard(0)]) is refused at run time, so it is no candidate, while a linear
    layer, run by a strategy, keeps it."""
    conv = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.Flatten(), nn.Linear(8 * 4 * 4, 4))
    graph = capture(conv, (torch.randn(8, 3, 4, 4),))
    mesh = {"dp": 2, "tp": 2}
    twice = lambda c: any(_dtensor_rules.cuts_a_dim_twice(ps) for ps in (*c.inputs, *c.outputs) if ps)  # noqa: E731
    (convolution,) = (n.name for n in graph.ops() if n.target == "aten.convolution.default")
    (linear,) = (n.name for n in graph.ops() if n.target == "aten.addmm.default")
    assert _dtensor_rules.refuses_dims_cut_twice(graph[convolution].op)
    conv_space = op_space(graph, convolution, mesh)
    assert conv_space.candidates and not any(twice(c) for c in conv_space.candidates)
    assert any(c.inputs[0] == (S0, R) for c in conv_space.candidates)  # the batch cut over one axis stays
    assert any(twice(c) for c in op_space(graph, linear, mesh).candidates)


def test_a_convolution_cannot_receive_one_dim_cut_over_two_axes():
    """DTensor's convolution rule reads the layout that arrives before it could move it: an edge into a
    convolution from a producer whose output cuts one dim over two axes is priced infinite (never chosen),
    and the solved plan's second convolution reads an input it can take."""
    from loom.plan.problem import build_problem
    from loom.plan.solve import solve

    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1))
    graph = capture(model, (torch.randn(8, 3, 4, 4),))
    problem = build_problem(graph, {"dp": 2, "tp": 2})
    (second,) = [n.name for n in graph.ops() if n.target == "aten.convolution.default"][1:]
    (edge,) = [e for e in problem.edges if e.target == second and e.index == 0]
    refused = [i for i, (out, _) in enumerate(edge.producer) if _dtensor_rules.cuts_a_dim_twice(out)]
    assert refused and len(refused) < len(edge.producer)  # the ReLU may cut the batch over both axes
    assert all(c == float("inf") for i in refused for c in edge.cost[i])
    assert all(c < float("inf") for i, row in enumerate(edge.cost) if i not in refused for c in row)
    for method in ("auto", "milp"):  # dynamic programming over the chain, and the integer program
        solution = solve(problem, method=method)
        made = solution.option(edge.ref.node).outputs[0]
        assert not _dtensor_rules.cuts_a_dim_twice(made) and solution.cost_s < float("inf"), method


class Flatten(nn.Module):
    """(batch, seq, hidden) rows flattened for a linear layer, as a transformer's projections read them."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x.view(-1, 8))


def test_a_flattened_dim_cut_on_two_axes_is_strided_as_dtensor_counts_it():
    """Mesh axes cut a tensor one after the other: rows (4, 16) cut S(0)|S(1) and flattened are, on the tp
    axis, a strided cut of each dp rank's 2 rows (split factor 2), not of all 4 (the tp axis alone answers 4).
    Every candidate making a strided cut makes the one DTensor's dispatcher makes on the whole mesh."""
    graph = capture(Flatten(), (torch.randn(4, 16, 8),))
    (view,) = (n for n in graph.ops() if n.target == "aten.view.default")
    space = op_space(graph, view.name, {"dp": 2, "tp": 2})
    strided = [c for c in space.candidates if any(_dtensor_rules.is_strided(p) for p in c.outputs[0])]
    assert strided
    infos = [graph.tensor(ref) for ref in view.inputs]
    args, kwargs = view.call_args([meta_tensor(info) for info in infos])
    for candidate in strided:
        runs = _dtensor_rules.dispatch(view.op, args, kwargs, candidate.inputs, (2, 2))
        assert (runs.inputs, runs.outputs) == (candidate.inputs, candidate.outputs)
    rows = next(c for c in strided if c.inputs == ((S0, S1),))
    assert rows.outputs == ((S0, _dtensor_rules.strided(0, 2)),)


def test_masked_partial_sums_made_apart_are_equal_layouts():
    """DTensor's masked partial sum (an embedding's output over a table cut along its rows) compares its mask
    buffer by identity; `placement_key` compares what the placement says."""
    from torch.distributed.tensor._ops._embedding_ops import _MaskPartial

    first, second = (_MaskPartial(offset_shape=torch.Size([64, 32]), offset_dim=0) for _ in range(2))
    assert first != second  # torch's own equality: never, for two made apart
    assert _dtensor_rules.layouts_key([(S0, first)]) == _dtensor_rules.layouts_key([(S0, second)])
    assert _dtensor_rules.placement_key(first) != _dtensor_rules.placement_key(Partial())


def test_an_operator_without_a_rule_is_replicated():
    graph = capture(Mysterious(), (torch.randn(4, 8),))
    (node,) = (n for n in graph.ops() if n.target == "loom_plan_test.mystery.default")
    space = strategy_space(graph, {"dp": 2, "tp": 2})
    mysterious = space[node.name]
    assert mysterious.fallback and len(mysterious.candidates) == 1
    (only,) = mysterious.candidates
    assert only.inputs == ((R, R),) and only.outputs == ((R, R),) and only.source == "replicate"
    assert only.total_share == 1.0
    assert space.fallbacks() == ["loom_plan_test.mystery.default"]
    assert any("loom_plan_test.mystery" in note for note in graph.notes)  # and its backward is unknown


def test_llama_space_covers_one_block_and_its_boundaries(llama):
    space = strategy_space(llama, {"tp": 2})
    blocks = llama.blocks
    assert not blocks.between
    assert set(space.ops) == {*blocks.representative, *blocks.before, *blocks.after}
    assert not set(space.ops) & set(blocks.nodes[1])
    assert space.fallbacks() == []
    assert all(op.candidates for op in space.ops.values())
    factories = [op for op in space.ops.values() if op.target == "aten.arange.default"]
    assert factories and all(op.candidates[0].source == "factory" and not op.fallback for op in factories)
    found = edges(llama, space.ops)
    assert len(found) == sum(len(llama[name].inputs) for name in space.ops)
    assert all(edge.tensor == llama.tensor(edge.source) for edge in found)


class CausalAttention(nn.Module):
    """Self-attention through `F.scaled_dot_product_attention` with causality and no mask tensor."""

    def __init__(self, dim: int = 16, heads: int = 4) -> None:
        super().__init__()
        self.qkv, self.heads = nn.Linear(dim, 3 * dim), heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        split = lambda t: t.unflatten(-1, (self.heads, -1)).transpose(1, 2)
        q, k, v = (split(t) for t in self.qkv(x).chunk(3, dim=-1))
        return nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)


def test_attention_cuts_heads_or_rows():
    graph = capture(CausalAttention(), (torch.randn(2, 8, 16),))
    (attention,) = (n.name for n in graph.ops() if "scaled_dot_product" in n.target)
    found = axis(op_space(graph, attention, {"tp": 2}))  # (batch, heads, seq, head dim) each
    assert found[(S1, S1, S1)] == (S1, S1)  # heads; outputs: attention, log-sum-exp
    assert found[(S0, S0, S0)] == (S0, S0)  # rows of the batch
    assert found[(R, R, R)] == (R, R)
    assert (S2, S2, S2) not in found  # a cut sequence needs ring attention, which DTensor's rule lacks


def test_attention_with_a_mask_keeps_the_mask_whole_across_heads(llama):
    (attention,) = (
        name for name in llama.blocks.representative if "scaled_dot_product" in llama[name].target
    )
    # query, key, value (keys and values repeated to the 4 query heads), mask (batch, 1, seq, seq)
    found = axis(op_space(llama, attention, {"tp": 2}))
    assert found[(S1, S1, S1, R)][0] == S1
    assert found[(S0, S0, S0, S0)][0] == S0
    assert found[(R, R, R, R)][0] == R


def test_source_layouts_and_mesh_checks(mlp):
    weight = mlp.params["0.weight"].info  # (32, 16)
    found = layouts(weight, {"dp": 2, "tp": 2})
    assert len(found) == 9 and (S0, S1) in found and (S0, S0) in found
    assert (S1, S1) in layouts(weight, {"dp": 4, "tp": 4}) and (S1, S1) not in layouts(
        weight, {"dp": 8, "tp": 4}
    )
    for bad in ({}, {"tp": 0}, {"tp": 2.0}):
        with pytest.raises(ValueError, match="mesh"):
            strategy_space(mlp, bad)
    with pytest.raises(ValueError, match="not an operator"):
        op_space(mlp, "0.weight", {"tp": 2})


def test_the_adapter_asks_cpu_attention_with_a_two_dim_mask_as_efficient_attention():
    query = torch.empty(2, 4, 16, 8, device="meta")
    mask = torch.empty(16, 16, device="meta")  # (seq, seq), broadcast over batch and heads
    op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    ask = lambda placements: _dtensor_rules.propose(
        op, (query, query, query, 0.0, False), {"attn_mask": mask, "scale": None}, placements, 2
    )
    heads = ask((S1, S1, S1, R))
    assert heads.inputs == (S1, S1, S1, R) and heads.outputs == (S1, S1)
    rows = ask((S0, S0, S0, R))
    assert rows.inputs == (S0, S0, S0, R) and rows.outputs == (S0, S0)
