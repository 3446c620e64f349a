"""The planner's outer search (`loom.plan.outer`) and `loom plan`: published configurations ranked
against the search's best, the memory limit obeyed, infeasible regions explained, the CLI's output."""

from __future__ import annotations

import json

import pytest

from loom.cli.main import main
from loom.cost.hardware import GIB, PROFILES
from loom.cost.plan import ParallelPlan
from loom.cost.transformer import TransformerConfig
from loom.plan import Plan
from loom.plan.outer import search_plans, to_plan
from loom.plan.outer_space import even_split, meshes, micro_batch_sizes, stage_options
from loom.sim.simulator import compute_bound, simulate
from loom.sim.validation import cases

SMALL = TransformerConfig(name="small", layers=8, hidden=1024, heads=16, vocab=32000)


def _case(source: str, label: str):
    return next(c for c in cases() if c.source == source and c.label == label)


@pytest.mark.parametrize(
    "source,label",
    [("korthikanti2022", "22B selective_sp"), ("korthikanti2022", "175B selective_sp"),
     ("korthikanti2022", "22B full"), ("narayanan2021", "1.7B"),
     pytest.param("narayanan2021", "310.1B", marks=pytest.mark.slow)],
)  # fmt: skip
def test_search_matches_or_beats_the_published_configuration(source: str, label: str) -> None:
    case = _case(source, label)
    p, cluster = case.plan, case.cluster
    published = simulate(case.model, p, cluster)
    # the published run's techniques: its recompute policy and sequence parallelism, no sharded optimizer
    found = search_plans(
        case.model, cluster, cluster.gpus, p.global_batch, p.seq, **p.system(),
        recompute=(p.recompute,), optimizer_levels=(0,), sequence_parallel=(p.sequence_parallel,),
    )  # fmt: skip
    best = found.best.result
    assert best.tokens_per_s >= published.tokens_per_s * (1 - 1e-9)
    top = [c.plan for c in found.candidates[:10]]
    assert p in top
    assert published.iteration_s <= 1.1 * best.iteration_s


@pytest.mark.parametrize(
    "fraction,choices",
    [(0.6, {}), (0.6, {"recompute": ("none",), "optimizer_levels": (0,)}), (0.4, {}),
     (0.6, {"sequence_parallel": (False,), "optimizer_levels": (0,)})],
)  # fmt: skip
def test_a_memory_limit_below_pure_data_parallelism_is_obeyed(fraction: float, choices: dict) -> None:
    cluster = PROFILES["h100-sxm"]
    pure_dp = ParallelPlan(dp=8, global_batch=64, seq=2048)
    limit = simulate(SMALL, pure_dp, cluster.with_size(8)).memory_per_device_gib * fraction
    found = search_plans(SMALL, cluster, 8, 64, 2048, memory_limit=limit * GIB, keep=20, **choices)
    assert found.candidates and found.memory_limit_gib == pytest.approx(limit)
    for candidate in found.candidates:  # priced again, apart from the search
        again = simulate(SMALL, candidate.plan, cluster.with_size(8))
        assert again.memory_per_device_gib <= limit and candidate.result.memory_per_device_gib <= limit
    best = found.best.plan
    assert (best.dp, best.recompute, best.optimizer_level) != (8, "none", 0)


def test_nothing_fits_says_why_per_region() -> None:
    found = search_plans(SMALL, PROFILES["h100-sxm"], 8, 64, 2048, memory_limit=0.01 * GIB)
    assert found.best is None
    reasons = {item.region: item.reason for item in found.infeasible}
    assert reasons["dp=8 tp=1 pp=1"].startswith("does not fit:")
    assert "of 0.01" in reasons["dp=8 tp=1 pp=1"]


def test_infeasible_regions_name_the_cause() -> None:
    found = search_plans(SMALL, PROFILES["h100-sxm"].with_size(32, 8), 32, 64, 2048)
    reasons = {item.region: item.reason for item in found.infeasible}
    assert "exceeds the 8 GPUs per node" in reasons["tp=16"]
    assert "exceeds the model's 8 layers" in reasons["dp=2 tp=1 pp=16"]


def test_uneven_stages_put_extra_layers_in_the_middle() -> None:
    assert even_split(10, 4) == (2, 3, 3, 2)
    assert even_split(7, 2) == (4, 3)
    assert (1, (7, 8, 8, 7)) in stage_options(30, 4, 8)  # light ends: (30 + 2) splits over 4
    assert stage_options(10, 4, 8) == [(1, (2, 3, 3, 2))]


def test_the_best_plan_converts_to_a_plan_that_prices_the_same() -> None:
    cluster = PROFILES["h100-sxm"]
    found = search_plans(SMALL, cluster, 8, 64, 2048)
    plan = to_plan(found.best)
    again = simulate(SMALL, plan.parallel_plan(global_batch=64, seq=2048), cluster.with_size(8))
    assert again.iteration_s == pytest.approx(found.best.result.iteration_s)
    assert plan.predicted_step_s == pytest.approx(found.best.result.iteration_s)


def test_loom_plan_takes_a_config_as_the_model(capsys) -> None:
    assert main(["plan", "--model", "configs/demo.toml", "--gpus", "8", "--top", "1"]) == 0
    assert "best plan dp" in capsys.readouterr().out


def test_loom_plan_prints_writes_and_reports(tmp_path, capsys) -> None:
    out = tmp_path / "plan.json"
    args = ["plan", "--model", "gpt3-175b", "--hardware", "h100-sxm", "--gpus", "64", "--global-batch", "64"]
    assert main([*args, "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "best plan" in text and "runners-up" in text and "slower by" in text and "infeasible" in text
    assert Plan.load(out).predicted_step_s > 0
    assert main([*args, "--json", "--top", "3"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert len(data["runners_up"]) == 3 and data["best"]["result"]["fits"]
    assert any("exceeds" in item["reason"] for item in data["infeasible"])


@pytest.mark.parametrize(
    "argv,message",
    [(["--gpus", "8"], "--model NAME"), (["--model", "gpt3-175b", "--global-batch", "8"], "--gpus"),
     (["--model", "nope", "--gpus", "8", "--global-batch", "8"], "unknown model"),
     (["configs/demo.toml", "--model", "gpt3-175b"], "give one model"),
     (["--model", "gpt3-175b", "--gpus", "8", "--global-batch", "8", "--memory-limit", "0"], "--memory-limit")],
)  # fmt: skip
def test_loom_plan_bad_input_names_the_option(argv, message, capsys) -> None:
    assert main(["plan", *argv]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("level", [0, 3])
def test_the_compute_bound_never_exceeds_the_simulated_step(level: int) -> None:
    cluster = PROFILES["h100-sxm"].with_size(16)
    for plan in (
        ParallelPlan(dp=2, tp=2, pp=4, interleave=2, global_batch=32, seq=2048, optimizer_level=level),
        ParallelPlan(dp=4, tp=2, pp=2, micro_batch=2, global_batch=32, seq=2048, recompute="full",
                     optimizer_level=level, stage_layers=(5, 3)),
    ):  # fmt: skip
        assert compute_bound(SMALL, plan, cluster) <= simulate(SMALL, plan, cluster).iteration_s


def test_the_top_plans_are_those_of_every_plan_simulated() -> None:
    # with one recompute policy and optimizer level no choice is pruned as dominated: the search's bound and
    # micro-batch cut-offs must then leave the same top 10 as simulating the whole space
    cluster = PROFILES["h100-sxm"].with_size(8)
    fixed = {"recompute": ("full",), "optimizer_levels": (0,), "sequence_parallel": (False,)}
    found = search_plans(SMALL, cluster, 8, 64, 2048, **fixed)
    every = []
    for mesh in meshes(SMALL, cluster, 8, 64, 2048)[0]:
        for micro in micro_batch_sizes(mesh, 64):
            for interleave, stages in stage_options(SMALL.layers, mesh.pp, 64 // (mesh.dp * micro)):
                plan = ParallelPlan(dp=mesh.dp, tp=mesh.tp, pp=mesh.pp, micro_batch=micro, interleave=interleave,
                                    stage_layers=stages, global_batch=64, seq=2048, recompute="full")  # fmt: skip
                result = simulate(SMALL, plan, cluster)
                every += [result.iteration_s] if result.fits else []
    assert len(every) > 10
    top = [c.result.iteration_s for c in found.candidates[:10]]
    assert top == pytest.approx(sorted(every)[:10])


def test_a_published_row_under_a_limit_below_its_data_parallel_memory() -> None:
    # Narayanan's 1.7B row runs as pure data parallelism; 70% of its memory forces another plan
    case = _case("narayanan2021", "1.7B")
    p, cluster = case.plan, case.cluster
    limit = simulate(case.model, p, cluster).memory_per_device_gib * 0.7
    found = search_plans(case.model, cluster, cluster.gpus, p.global_batch, p.seq, limit * GIB, **p.system(),
                         optimizer_levels=(0,))  # fmt: skip
    assert found.candidates and all(c.plan.dp < cluster.gpus for c in found.candidates)
    for candidate in found.candidates:
        assert simulate(case.model, candidate.plan, cluster).memory_per_device_gib <= limit


@pytest.mark.slow  # a search over a published row's cluster: make test-all
def test_a_search_holding_fsdps_gradient_path_fixed_plans_at_levels_2_and_3() -> None:
    """A PyTorch FSDP1 run's system (`grad_accumulation = "flat_copy"`, levels 2 and 3 only) is searched at
    those levels; asked for levels below 2 only, the search says so."""
    from loom.sim.validation import fsdp_cases

    case = min((c for c in fsdp_cases() if c.plan.grad_accumulation == "flat_copy"), key=lambda c: c.plan.dp)
    p = case.plan
    found = search_plans(
        case.model, case.cluster, case.cluster.gpus, p.global_batch, p.seq, **p.system(), keep=3
    )
    assert found.candidates
    assert {c.plan.optimizer_level for c in found.candidates} <= {2, 3}
    assert all(c.plan.grad_accumulation == "flat_copy" for c in found.candidates)
    with pytest.raises(ValueError, match="optimizer levels 2 and 3 only.*include 2 or 3"):
        search_plans(case.model, case.cluster, case.cluster.gpus, p.global_batch, p.seq, **p.system(),
                     optimizer_levels=(0, 1))  # fmt: skip


@pytest.mark.slow  # a search over a published row's cluster: make test-all
def test_a_search_holding_tp_overlap_fixed_overlaps_where_a_plan_can():
    """A Megatron-Bridge run's system overlaps tensor-parallel communication (`overlap_tp_comm`): the search
    gives it to every plan with sequence parallelism and tp > 1 inside a node, and to no other."""
    from loom.cost.layer import check_tp_overlap
    from loom.sim.validation.published import published_cases

    case = next(c for c in published_cases()[0] if c.plan.overlap_tp_comm)
    p = case.plan
    found = search_plans(
        case.model, case.cluster, case.cluster.gpus, p.global_batch, p.seq, **p.system(), keep=10
    )
    assert found.candidates
    for c in found.candidates:
        can = c.plan.sequence_parallel and 1 < c.plan.tp <= case.cluster.gpus_per_node
        assert c.plan.overlap_tp_comm == can, c.plan
        check_tp_overlap(c.plan, case.cluster)
    assert any(c.plan.overlap_tp_comm for c in found.candidates)


def test_the_search_holds_every_system_field_a_plan_gives_and_refuses_others() -> None:
    # how a system runs a plan reaches every candidate (here fp8 GEMMs under delayed scaling, FSDP2's copies);
    # a name that is not a system field is refused naming it
    cluster = PROFILES["h100-sxm"].with_size(8)
    system = {"fp8_matmuls": True, "fp8_scaling": "delayed", "grad_accumulation": "copy_in_out"}
    found = search_plans(SMALL, cluster, 8, 64, 2048, keep=3, **system)
    assert found.candidates
    for candidate in found.candidates:
        assert {key: getattr(candidate.plan, key) for key in system} == system
        assert candidate.plan.optimizer_level in (2, 3)
    # loom's runtime runs neither: no loom Plan comes of such a candidate
    with pytest.raises(
        ValueError, match=r"grad_accumulation = 'copy_in_out', fp8_matmuls = True\), which loom"
    ):
        to_plan(found.best)
    # master weights in the optimizer (Megatron-LM's) reach every candidate and are not loom's either
    megatron = search_plans(SMALL, cluster, 8, 64, 2048, keep=3, master_weights="optimizer")
    assert {c.plan.master_weights for c in megatron.candidates} == {"optimizer"}
    with pytest.raises(ValueError, match=r"master_weights = 'optimizer'\), which loom"):
        to_plan(megatron.best)
    assert to_plan(search_plans(SMALL, cluster, 8, 64, 2048, keep=1).best).dp >= 1  # loom's own: a Plan
    with pytest.raises(TypeError, match=r"\['fp8_scalin'\] are not fields of how a system runs a plan"):
        search_plans(SMALL, cluster, 8, 64, 2048, fp8_scalin="delayed")


def test_whole_layer_recompute_is_foreign_only_to_a_plan_that_recomputes_whole_layers() -> None:
    # Megatron-LM's whole-layer recomputation: a candidate with full recomputation is another system's run,
    # one with none or selective recomputation is loom's own
    cluster = PROFILES["h100-sxm"].with_size(8)
    for recompute, foreign in (("full", True), ("selective", False), ("none", False)):
        found = search_plans(
            SMALL, cluster, 8, 64, 2048, keep=1, recompute=(recompute,), recompute_early_stop=False
        )
        if foreign:
            with pytest.raises(ValueError, match=r"recompute_early_stop = False\), which loom"):
                to_plan(found.best)
        else:
            assert to_plan(found.best).recompute == recompute
