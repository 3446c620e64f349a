"""Tier 1: the operator-level solvers (`loom.plan.solve`): sharding propagation from a few fixed
strategies, the full search with its optimality gap and a memory limit, and the Plan they produce.
Single process; models on the meta device where sizes matter."""

from __future__ import annotations

import pytest
import torch
from equivalence import sgd_losses_and_first_grads
from hf_models import build
from torch import nn
from torch.distributed.tensor import Partial, Replicate, Shard

from loom.cost.hardware import get_cluster
from loom.models import MatMulChain, ReluNet, SoftCrossEntropy, WithLoss
from loom.models.gpt import GPT, GPTConfig
from loom.models.recipes import tensor_plan
from loom.plan import Plan
from loom.plan.capture import capture
from loom.plan.problem import OPTIMIZER_COPIES, build_problem
from loom.plan.redistribute import gradient_layouts, redistribution
from loom.plan.solve import propagate, solve
from loom.plan.to_plan import pins, placements, tensor_spec

R, P, S0, S1 = Replicate(), Partial(), Shard(0), Shard(1)
MESH = {"dp": 2, "tp": 2}
IDS = torch.randint(0, 128, (8, 32), generator=torch.Generator().manual_seed(0))
# loom's GPT multiplies by its weights (x @ w): a column cut is the weight's dim 1
LOOM_GPT_MEGATRON = {
    "*.attention": {"parameter_plan": {"wq": ["None", "tp"], "wk": ["None", "tp"], "wv": ["None", "tp"], "wo": ["tp", "None"]}},
    "*.mlp": {"parameter_plan": {"w_up": ["None", "tp"], "w_down": ["tp", "None"]}},
}  # fmt: skip


class Regression(nn.Module):
    """A Megatron MLP (Linear -> GELU -> Linear) and a squared error."""

    def __init__(self, d: int = 1024) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return ((self.mlp(x) - y) ** 2).mean()


def layouts(solution) -> dict[str, str]:
    """Every decision's choice as text, for the printed reports."""
    shown = {}
    for name, decision in solution.problem.decisions.items():
        option = solution.option(name)
        shown[name] = option.describe() if decision.kind == "op" else str(option)
    return shown


def test_redistributions_are_the_collectives_of_each_axis():
    cluster = get_cluster("h100-sxm", gpus=4)
    kinds = lambda src, dst: [
        (s.axis, s.kind, s.nbytes) for s in redistribution(64.0, src, dst, MESH, cluster)
    ]
    assert kinds((S0, R), (R, R)) == [("dp", "all_gather", 64.0)]
    assert kinds((R, P), (R, R)) == [("tp", "all_reduce", 64.0)]
    assert kinds((R, P), (R, S1)) == [("tp", "reduce_scatter", 64.0)]
    assert kinds((S0, S1), (S0, S0)) == [("tp", "all_to_all", 16.0)]  # each device's piece
    assert kinds((R, R), (S0, P)) == []
    # a data-parallel weight: read whole by an operator that cuts its work along dp -> its gradient sums
    assert gradient_layouts((R, R), (R, R), (True, False)) == ((P, R), (R, R))


def test_tensor_specs_and_placements_translate_both_ways():
    assert placements([2, 1], 2, MESH, "w") == (S0, R)  # a cut of 2: the first free axis of that size
    assert placements([2, 2], 2, MESH, "w") == (S0, S1)
    assert placements([["dp", "tp"], "None"], 2, MESH, "w") == (S0, S0)
    assert placements(["None", "cp"], 2, MESH, "w") == (R, R)  # an axis the mesh lacks cuts nothing
    assert tensor_spec((S0, S0), 2, MESH) == [["dp", "tp"], "None"]
    assert tensor_spec((R, S1), 2, MESH) == ["None", "tp"] and tensor_spec((P, R), 2, MESH) is None
    with pytest.raises(ValueError, match="no unused mesh axis"):
        placements([3, 1], 2, MESH, "w")


@pytest.fixture(scope="module")
def regression():
    with torch.device("meta"):
        model = Regression()
    x = torch.empty(2048, 1024, device="meta")
    return build_problem(capture(model, (x, torch.empty_like(x))), {"tp": 2})


def test_propagation_picks_the_row_parallel_second_matmul(regression):
    fixed = {"mlp.0": {"parameter_plan": {"weight": ["tp", "None"]}}}
    solution = solve(regression, pinned=pins(regression, fixed))
    assert solution.layout("mlp.0.weight") == (S0,)  # as fixed: column parallel
    assert solution.layout("mlp.2.weight") == (S1,)  # row parallel, chosen
    moved = [(where, step.kind) for where, _, step in solution.collectives()]
    assert not any(kind == "all_gather" and "gelu" in where for where, kind in moved)  # the hidden stays cut
    forward = [step.kind for _, direction, step in solution.collectives() if direction == "forward"]
    assert forward[0] in ("all_reduce", "reduce_scatter")  # the row-parallel partial sums, summed once
    assert solution.method == "tree" and solution.gap == 0  # the MLP and its loss form a tree
    integer_program = solve(regression, pinned=pins(regression, fixed), method="milp")
    assert integer_program.method == "milp" and integer_program.gap <= 1e-4
    assert integer_program.cost_s == pytest.approx(solution.cost_s, rel=1e-6)
    plan = solution.plan()
    assert plan.parameter_layouts["mlp.2.weight"] == ["None", "tp"] and plan.tp == 2
    assert plan.primitives_follow_inputs  # priced by DTensor's rules: loom.ops primitives follow their inputs


def test_mindspore_matmul_chain_from_its_first_strategy():
    graph = capture(MatMulChain(), (torch.randn(16, 8),))
    solution = propagate(graph, {"tp": 4}, {"mm": {"in_strategy": [[4, 1], [1, 1]]}})
    chosen = layouts(solution)
    print(chosen, f"{solution.cost_s * 1e6:.1f} us")
    assert chosen["mm"] == "(S(0), R) -> S(0)"  # as given: rows of X
    assert solution.method == "tree"  # a chain: dynamic programming
    assert chosen["mm_1"].startswith(("(R", "(S(0)"))  # the second matmul reads the hidden as it decides
    priced = sum(step.seconds for _, _, step in solution.collectives())
    assert priced == pytest.approx(solution.comm_s, rel=1e-6)


def test_mindspore_relu_net_from_its_first_strategy():
    graph = capture(WithLoss(ReluNet(), SoftCrossEntropy()), (torch.rand(16, 32), torch.rand(16, 16)))
    solution = propagate(graph, {"tp": 2}, {"mm": {"in_strategy": [[1, 2], [2, 1]]}})
    chosen = layouts(solution)
    print(chosen, [(where, step.kind) for where, _, step in solution.collectives()])
    assert chosen["mm"] == "(S(1), S(0)) -> P"  # the contracted dim cut: partial sums
    reduced = [
        step.kind for where, d, step in solution.collectives() if where == "mm -> relu" and d == "forward"
    ]
    assert reduced in (["all_reduce"], ["reduce_scatter"])  # relu needs the sums


def test_a_weight_moved_for_its_matmul_is_kept_until_backward():
    """A linear weight kept cut over dp and read whole (ZeRO-3-like) costs its gathered copy beside its
    shard: autograd keeps the matmul's weight for the backward of its input. Read as kept, it costs
    nothing more (its transposed view shares the parameter's storage); the first layer's, whose input
    takes no gradient, is not kept at all."""
    with torch.device("meta"):
        model = Regression(d=256)
    x = torch.empty(16, 256, device="meta")
    problem = build_problem(capture(model, (x, torch.empty_like(x))), MESH)
    weights = {path: p.node for path, p in problem.graph.params.items() if path.endswith("weight")}
    (first,) = (e for e in problem.edges if e.ref.node == weights["mlp.0.weight"])  # into the weight's `t`
    assert not first.memory
    (edge,) = (e for e in problem.edges if e.ref.node == weights["mlp.2.weight"])
    groups = {out: i for i, (out, _) in enumerate(edge.producer)}
    needs = {need: j for j, ((need, _), _) in enumerate(edge.consumer)}
    whole = 4 * 1024 * 256  # fp32
    assert edge.memory[groups[(S0, R)]][needs[(R, R)]] == pytest.approx(whole)  # gathered over dp
    assert edge.memory[groups[(S0, R)]][needs[(S0, R)]] == 0.0  # read as kept
    assert edge.memory[groups[(R, S0)]][needs[(R, R)]] == pytest.approx(whole)  # gathered over tp
    # the matmul keeps its input (the GELU's output) and the weight's view: the view's copy is an edge's
    (linear,) = (n for n in problem.graph.ops() if n.target == "aten.addmm.default" and n.module == "mlp.2")
    kept = problem.decisions[linear.name]
    assert min(kept.memory) == pytest.approx(4 * 16 * 1024 / 4)  # its input cut over dp and tp
    with_copies = {
        problem.graph[e.ref.node].target for e in problem.edges if e.target == linear.name and e.memory
    }
    assert with_copies == {"aten.t.default"}  # a move of the view costs its copy too; of the input, not


def test_fixed_strategy_errors_name_the_module(regression):
    with pytest.raises(ValueError, match="matches no module"):
        pins(regression, {"mlp.9": {"parameter_plan": {"weight": ["tp", "None"]}}})


def test_memory_limit_forces_sharded_parameters():
    with torch.device("meta"):
        model = Regression()
    x = torch.empty(16, 1024, device="meta")  # few rows: replicated weights and a gradient all-reduce win
    problem = build_problem(capture(model, (x, torch.empty_like(x))), MESH)
    free = solve(problem)
    assert not free.plan().parameter_layouts
    states = sum(d.memory[0] for d in problem.decisions.values() if d.kind == "parameter")  # option 0: whole
    assert states == pytest.approx(OPTIMIZER_COPIES * 4 * sum(p.numel() for p in model.parameters()))
    tight = solve(problem, memory_limit=states / 2)
    assert tight.memory_bytes <= states / 2 < free.memory_bytes
    assert tight.plan().parameter_layouts  # some weights are now cut
    assert tight.cost_s >= free.cost_s
    with pytest.raises(ValueError, match="no layout fits"):
        solve(problem, memory_limit=1.0)


class SelfAttentionHead(nn.Module):
    """A module that owns weights and is called with three positional tensors (q, k, v), then a linear."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(64, 4, batch_first=True)
        self.fc = nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y, _ = self.attn(x, x, x)
        return self.fc(y).square().mean()


def test_an_in_strategy_only_for_modules_called_with_one_input():
    """An in_strategy gives one entry per positional input: a plan must not give one to an attention
    module called as attn(x, x, x), even when it cuts its weights and reads one tensor from outside."""
    with torch.device("meta"):
        model = SelfAttentionHead()
    problem = build_problem(capture(model, (torch.empty(8, 16, 64, device="meta"),)), MESH)
    states = sum(d.memory[0] for d in problem.decisions.values() if d.kind == "parameter")
    plan = solve(problem, memory_limit=states / 2).plan()
    assert any(name.startswith("attn.") for name in plan.parameter_layouts), plan.parameter_layouts
    assert "in_strategy" not in plan.strategies.get("attn", {}), plan.strategies


@pytest.fixture(scope="module")
def loom_gpt():
    model = GPT(GPTConfig(n_layers=2))
    graph = capture(model, (IDS, IDS))
    return graph, build_problem(graph, MESH)


@pytest.mark.slow  # capture, strategy space and two integer programs: about 10 s on 2 cores
def test_search_beats_megatron_on_loom_gpt(loom_gpt):
    graph, problem = loom_gpt
    megatron = solve(problem, pinned=pins(problem, LOOM_GPT_MEGATRON))
    best = solve(problem)
    print(f"search {best.cost_s * 1e6:.1f} us (gap {best.gap:.1e}), Megatron {megatron.cost_s * 1e6:.1f} us")
    assert best.cost_s <= megatron.cost_s * (1 + 1e-6) and 0 <= best.gap <= 1e-3
    assert megatron.plan().parameter_layouts["blocks.*.mlp.w_down"] == ["tp", "None"]
    assert isinstance(best.plan(), Plan) and best.plan().dp == 2


@pytest.mark.slow  # about 15 s on 2 cores
def test_search_beats_megatron_on_hugging_face_gpt2():
    graph = capture(build("gpt2"), (IDS,), {"labels": IDS})
    problem = build_problem(graph, MESH)
    megatron = solve(problem, pinned=pins(problem, tensor_plan(build("gpt2"))))
    best = solve(problem)
    print(f"search {best.cost_s * 1e6:.1f} us (gap {best.gap:.1e}), Megatron {megatron.cost_s * 1e6:.1f} us")
    assert best.cost_s <= megatron.cost_s * (1 + 1e-6) and best.gap <= 1e-3
    layouts_ = megatron.plan().parameter_layouts
    assert layouts_["transformer.h.*.mlp.c_fc.weight"] == ["None", "tp"]
    assert "lm_head.weight" not in layouts_ and layouts_["transformer.wte.weight"] == ["tp", "None"]  # tied


def _one_device_and_parallel(lay_out, steps: int = 3):
    """The MLP regression trained `steps` SGD steps on one device, and on 4 ranks (dp 2 x tp 2, each
    data-parallel replica reading its rows) after `lay_out(model, x_rows, y_rows)`: both runs' losses and
    first-step gradients, and the parallel model."""
    import copy

    import loom

    torch.manual_seed(0)
    reference = Regression(d=16)
    model = copy.deepcopy(reference)
    data = [(torch.randn(8, 16), torch.randn(8, 16)) for _ in range(steps)]
    expected = _sgd(reference, data, lambda t: t)
    mesh = loom.init(MESH)
    rows = lambda t: t.chunk(2)[mesh.dp_rank()]
    lay_out(model, rows(data[0][0]), rows(data[0][1]))
    return expected, _sgd(model, data, rows), model


def auto_plan_case(plan: Plan):
    """One device's and `plan`'s losses and first-step gradients (`_one_device_and_parallel`)."""
    import loom

    expected, actual, _ = _one_device_and_parallel(lambda model, x, y: loom.parallelize(model, plan=plan))
    return expected, actual


def _sgd(model, data, rows):
    return sgd_losses_and_first_grads(model, data, lambda batch: model(rows(batch[0]), rows(batch[1])), 0.1)


@pytest.mark.slow  # 4 ranks
@pytest.mark.parametrize("how", ["propagated", "memory_limited"])
def test_a_solved_plan_trains_as_one_device(dist_run, how):
    x = torch.randn(8, 16)
    problem = build_problem(capture(Regression(d=16), (x, torch.randn(8, 16))), MESH)
    if how == "propagated":
        solution = solve(
            problem, pinned=pins(problem, {"mlp.0": {"parameter_plan": {"weight": ["tp", "None"]}}})
        )
    else:  # weights cut along both axes, activations moved between layouts by all-to-alls
        states = sum(d.memory[0] for d in problem.decisions.values() if d.kind == "parameter")
        solution = solve(problem, memory_limit=states / 3)
    plan = solution.plan()
    assert "tp" in str(plan.parameter_layouts["mlp.0.weight"][0])
    for (ref_losses, ref_grads), (losses, grads) in dist_run(4, auto_plan_case, plan):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
        for name, grad in ref_grads.items():
            torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-6)


def auto_mode_case(memory_limit):
    """`loom.parallelize(mode="auto")` on the MLP regression: the one device's and the parallel run's losses
    and first-step gradients, the plan chosen, and whether this rank holds a strict part of every weight."""
    import loom

    def lay_out(model, x, y):
        loom.parallelize(model, mode="auto", example_inputs=(x, y), memory_limit=memory_limit)

    expected, actual, model = _one_device_and_parallel(lay_out)
    weights = [p for name, p in model.named_parameters() if name.endswith("weight")]
    strict = all(p.to_local().numel() < p.numel() for p in weights)
    return expected, actual, model.loom.plan.to_json(), strict


def test_auto_mode_trains_as_one_device_and_keeps_to_a_memory_limit(dist_run):
    """mode="auto" on 4 ranks: the chosen plan (the same on every rank) gives one device's losses and
    gradients; with a memory limit below the replicated weights' states, every rank holds a strict part of
    each weight and the plan's predicted memory is under the limit."""
    problem = build_problem(capture(Regression(d=16), (torch.randn(8, 16), torch.randn(8, 16))), MESH)
    states = sum(d.memory[0] for d in problem.decisions.values() if d.kind == "parameter")
    for limit in (None, states / 3):
        results = dist_run(4, auto_mode_case, limit)
        assert len({plan for *_, plan, _ in results}) == 1, "every rank applies the same plan"
        for (ref_losses, ref_grads), (losses, grads), plan, strict in results:
            torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
            for name, grad in ref_grads.items():
                torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-6)
            if limit is not None:
                assert strict, plan
                assert Plan.from_json(plan).predicted_memory_bytes <= limit


def redistributions_case(stride: int = 1) -> list:
    """Every `stride`-th move of an 8 x 8 fp32 tensor from placements of {R, P, S0, S1} on each axis to
    placements of {R, S0, S1} on 4 ranks (dp 2 x tp 2): (source, target, the collectives DTensor ran as
    Counter of (kind, axis, bytes)). `make test` samples every fifth of the 144; `make test-all` runs all."""
    import itertools
    from collections import Counter

    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, distribute_tensor

    import loom
    from loom.dist.comm import CollectiveRecorder, mesh_axes

    mesh = loom.init(MESH)
    axes = mesh_axes(tuple(MESH), tuple(MESH.values()), dist.get_rank())
    whole = torch.arange(64.0).reshape(8, 8)
    found = []
    pairs = list(
        itertools.product(
            itertools.product((R, P, S0, S1), repeat=2), itertools.product((R, S0, S1), repeat=2)
        )
    )
    for source, target in pairs[::stride]:
        cut = tuple(R if p.is_partial() else p for p in source)
        local = distribute_tensor(whole, mesh.device_mesh, cut).to_local()
        x = DTensor.from_local(local, mesh.device_mesh, source, run_check=False)
        with CollectiveRecorder() as recorder:
            x.redistribute(mesh.device_mesh, target)
        found.append((source, target, Counter(recorder.summary(axes))))
    return found


@pytest.mark.parametrize("stride", [pytest.param(1, marks=pytest.mark.slow), 5], ids=["all", "sampled"])
def test_redistributions_are_priced_as_dtensor_runs_them(dist_run, stride):
    """The solver's collectives for a move (`redistribution`: DTensor's greedy order, consecutive axes of one
    change merged over the flattened group) are the ones DTensor runs, kind, group and bytes, for every move
    between these layouts; DTensor's all-to-all is an all-gather on gloo, so moves with one are left out."""
    cluster = get_cluster("h100-sxm", gpus=4)
    compared = 0
    for source, target, ran in dist_run(4, redistributions_case, stride)[0]:
        steps = redistribution(256.0, source, target, MESH, cluster)
        if any(s.kind == "all_to_all" for s in steps):
            continue
        priced = {}
        for s in steps:
            priced[(s.kind, s.axis, int(s.nbytes))] = priced.get((s.kind, s.axis, int(s.nbytes)), 0) + 1
        assert priced == dict(ran), (source, target, priced, dict(ran))
        compared += 1
    assert compared > 100 // stride, compared


def strided_redistributions_case() -> list:
    """Moves of strided cuts on 4 ranks (dp 2 x tp 2): an 8 x 8 fp32 tensor cut along dim 1 on some axes
    and flattened (`view(64)`: DTensor's `_StridedShard` there), moved to every layout of {R, S0} per axis;
    and back, whole or cut rows made strided. (source, target, the collectives DTensor ran as a Counter
    of (kind, axis, bytes))."""
    import itertools

    import torch.distributed as dist
    from torch.distributed.tensor import distribute_tensor

    import loom
    from loom.dist.comm import CollectiveRecorder, mesh_axes

    mesh = loom.init(MESH)
    axes = mesh_axes(tuple(MESH), tuple(MESH.values()), dist.get_rank())
    whole = torch.arange(64.0).reshape(8, 8)
    found = []
    for cut in [(R, S1), (S1, R), (S1, S1), (S0, S1)]:
        strided = distribute_tensor(whole, mesh.device_mesh, cut).view(64)
        for target in itertools.product((R, S0), repeat=2):
            with CollectiveRecorder() as recorder:
                try:
                    strided.redistribute(mesh.device_mesh, target)
                except (RuntimeError, AssertionError) as error:  # DTensor's own limits: nothing runs to price
                    recorder = error
            found.append((strided.placements, target, _ran(recorder, axes)))
        for source in [(R, R), (S0, R), (S0, S0), (P, R)]:
            kept = tuple(R if p.is_partial() else p for p in source)
            x = distribute_tensor(whole.view(64), mesh.device_mesh, kept)
            if any(p.is_partial() for p in source):
                x = torch.distributed.tensor.DTensor.from_local(x.to_local(), mesh.device_mesh, source)
            with CollectiveRecorder() as recorder:
                try:
                    x.redistribute(mesh.device_mesh, strided.placements)
                except (RuntimeError, AssertionError) as error:
                    recorder = error
            found.append((source, strided.placements, _ran(recorder, axes)))
    return found


def _ran(recorder, axes):
    """The collectives a recorder saw, as a Counter of (kind, axis, bytes), or the error's text."""
    from collections import Counter

    return (
        f"{type(recorder).__name__}: {recorder}"
        if isinstance(recorder, Exception)
        else Counter(recorder.summary(axes))
    )


@pytest.mark.slow  # 4 ranks, 48 moves
def test_strided_cuts_are_priced_as_dtensor_moves_them(dist_run):
    """A flattened tensor cut along a later dim (`_StridedShard`) holds a part per device; DTensor moves it
    to or from any other layout through a whole tensor, axis by axis (all-gathers, a pending sum all-reduced):
    the solver's `redistribution` prices those collectives, kind, group and bytes."""
    cluster = get_cluster("h100-sxm", gpus=4)
    moves = dist_run(4, strided_redistributions_case)[0]
    assert any("Strided" in repr(source) for source, _, _ in moves), "the view makes strided cuts"
    compared = 0
    for source, target, ran in moves:
        if isinstance(ran, str):
            # DTensor's own limits (torch 2.13): a strided cut on both axes moves over no flattened group,
            # and a cut tensor is not made strided on both axes or under an outer cut of the same dim
            assert "Strided" in repr(source) + repr(target), (source, target, ran)
            continue
        priced = {}
        for s in redistribution(256.0, source, target, MESH, cluster):
            priced[(s.kind, s.axis, int(s.nbytes))] = priced.get((s.kind, s.axis, int(s.nbytes)), 0) + 1
        assert priced == dict(ran), (source, target, priced, dict(ran))
        compared += 1
    assert compared >= 24, compared  # 32 moves, 7 of them refused by DTensor


def test_a_strided_cut_is_priced_apart_from_a_whole_tensor():
    """The edge prices are cached by placement codes: a strided cut (`view(-1)` of a tensor cut along its
    last dim) moved whole costs an all-gather of its pieces, not nothing as a whole tensor would."""
    from torch.distributed.tensor.placement_types import _StridedShard

    from loom.plan.problem import _code

    strided = (_StridedShard(0, split_factor=4), R)
    assert _code(strided) != _code((R, R))
    cluster = get_cluster("h100-sxm", gpus=4)
    steps = redistribution(512.0, strided, (R, R), MESH, cluster)
    assert [(s.axis, s.kind, s.nbytes) for s in steps] == [("dp", "all_gather", 512.0)]  # the whole, gathered
    both = redistribution(512.0, (strided[0], strided[0]), (R, R), MESH, cluster)
    assert [(s.axis, s.kind, s.nbytes) for s in both] == [
        ("tp", "all_gather", 256.0),
        ("dp", "all_gather", 512.0),
    ]
