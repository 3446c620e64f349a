"""Full recomputation as torch's non-reentrant checkpoint runs it: it stops once the last tensor the backward
needs is rebuilt, so a layer's MLP output projection and residual add are not re-run
(`ParallelPlan.recompute_early_stop`); Megatron-LM's and DeepSpeed's checkpoint functions re-run it all."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import set_checkpoint_early_stop

from loom.cli.main import main
from loom.cost.collectives import collective_time, group_span
from loom.cost.compute import matmul_time, memory_time
from loom.cost.hardware import get_cluster
from loom.cost.layer import piece_costs, skips_mlp_out
from loom.cost.plan import LOOM_SYSTEM, ParallelPlan
from loom.cost.transformer import TransformerConfig
from loom.models.gpt import GPT, GPTConfig
from loom.recompute import recompute
from loom.sim.simulator import simulate
from loom.sim.validation.published import published_cases

# a small dense layer: 4 heads of 16, a GELU MLP of 256, no biases, no dropout
TINY = TransformerConfig(layers=2, hidden=64, heads=4, ffn_hidden=256, vocab=100, biases=False, dropout=False)
PLAN = ParallelPlan(micro_batch=2, global_batch=2, seq=8, recompute="full")
CLUSTER = get_cluster("a100-80gb", gpus=2)


class _CountOps(TorchDispatchMode):
    """Counts the aten ops dispatched, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        name = func.overloadpacket.__name__
        self.counts[name] = self.counts.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def _backward_ops(mlp: str, early_stop: bool) -> dict[str, int]:
    """The ops of one backward of loom's GPT (2 blocks, each recomputed "full")."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, max_seq_len=16, mlp=mlp))
    for block in model.blocks:
        recompute(block, "full")
    ids = torch.randint(0, 64, (2, 16))
    with set_checkpoint_early_stop(early_stop):  # read when the checkpointed forward runs
        loss = model(ids, ids)
    with _CountOps() as counted:
        loss.backward()
    return counted.counts


@pytest.mark.parametrize("mlp", ["gelu", "swiglu"])
def test_loom_recompute_skips_each_blocks_output_projection_and_residual_add(mlp):
    # the fact the cost model prices: per block, one matmul (the MLP's down projection) and one add fewer
    early, whole = _backward_ops(mlp, True), _backward_ops(mlp, False)
    skipped = {
        "mm": 2,
        "_unsafe_view": 2,
        "add": 2,
    }  # the matmul (a 2-D mm and its view back to 3-D), the add
    assert {k: whole[k] - early.get(k, 0) for k in whole if whole[k] != early.get(k, 0)} == skipped


def test_the_recomputed_layer_is_its_forward_less_the_output_projection_and_add():
    dev, pieces = CLUSTER.device, piece_costs(TINY, PLAN, CLUSTER)
    stopped, forward = pieces.layer_recompute, pieces.layer_fwd
    # 16 tokens: w2 is a (16 x 256) @ (256 x 64) GEMM; the residual add reads two and writes one bf16 stream
    assert stopped["matmul"] == pytest.approx(forward["matmul"] - matmul_time(dev, 16, 256, 64), rel=1e-12)
    add = memory_time(dev, 3 * 2 * 16 * 64, kernels=1)
    assert stopped["elementwise"] == pytest.approx(forward["elementwise"] - add, rel=1e-12)
    whole = piece_costs(TINY, PLAN.replace(recompute_early_stop=False), CLUSTER).layer_recompute
    assert whole == forward


@pytest.mark.parametrize(("sp", "kind"), [(False, "all_reduce"), (True, "reduce_scatter")])
def test_the_tensor_parallel_sum_after_the_projection_is_not_rerun(sp, kind):
    plan = PLAN.replace(tp=2, sequence_parallel=sp)
    pieces = piece_costs(TINY, plan, CLUSTER)
    one = collective_time(kind, 2 * 16 * 64, group_span(2, 1, CLUSTER.gpus_per_node), CLUSTER)
    assert pieces.layer_recompute["tp_comm"] == pytest.approx(pieces.layer_fwd["tp_comm"] - one, rel=1e-12)
    # w2 cut along its input features on 2 ranks
    gemm = matmul_time(CLUSTER.device, 16, 128, 64)
    assert pieces.layer_recompute["matmul"] == pytest.approx(pieces.layer_fwd["matmul"] - gemm, rel=1e-12)


@pytest.mark.parametrize(
    ("model_change", "plan_change"),
    [
        ({"dropout": True}, {}),
        ({"experts": 4, "top_k": 2}, {}),
        ({}, {"fp8_matmuls": True}),
        ({}, {"tp": 2, "sequence_parallel": True, "overlap_tp_comm": True}),
    ],
)
def test_what_saves_after_the_projection_reruns_it(model_change, plan_change):
    # a dropout's mask is rebuilt from the projection's output; a mixture's combine saves each expert's output;
    # fp8 linears and Transformer Engine's userbuffers are autograd functions that save after their GEMM
    model, plan = TINY.replace(**model_change), PLAN.replace(**plan_change)
    assert skips_mlp_out(TINY, PLAN) and not skips_mlp_out(model, plan)
    pieces = piece_costs(model, plan, get_cluster("h100-sxm", gpus=2))  # fp8 needs an fp8 peak
    assert pieces.layer_recompute == pieces.layer_fwd


def test_hardware_flops_leave_out_the_projection():
    # 2 FLOPs per multiply-add of w2 (256 x 64) per token; 2 layers, 2 x 8 tokens
    whole = TINY.recompute_flops(2, 8, "full")
    assert whole - TINY.recompute_flops(2, 8, "full", skip_mlp_out=True) == 2 * 256 * 64 * 2 * 16
    run = simulate(TINY, PLAN, CLUSTER.with_size(1))
    whole_run = simulate(TINY, PLAN.replace(recompute_early_stop=False), CLUSTER.with_size(1))
    assert whole_run.hfu / whole_run.mfu - run.hfu / run.mfu == pytest.approx(
        2 * 256 * 64 * 2 * 16 / TINY.model_flops(2, 8), rel=1e-9
    )


def test_it_is_loom_s_way_and_the_published_megatron_runs_are_priced_whole():
    assert (
        ParallelPlan(global_batch=1, seq=8).recompute_early_stop
        is LOOM_SYSTEM["recompute_early_stop"]
        is True
    )
    cases, _ = published_cases()
    whole = {c.source for c in cases if not c.plan.recompute_early_stop}
    stopped = {c.source for c in cases if c.plan.recompute_early_stop}
    assert whole == {
        "narayanan2021", "korthikanti2022", "nvidia2024_nemo_perf_summary",
        "nvidia2026_megatron_bridge_perf_summary", "bigscience2022_bloom176b", "yan2025_moe_modelzoo_qwen3",
    }  # fmt: skip
    assert stopped == {"mosaicml2024", "torchtitan2024_a100_performance"}


ARGS = ["simulate", "--model", "llama3-8b", "--gpus", "8", "--global-batch", "8", "--seq", "1024"]
ARGS += ["--optimizer-level", "3"]


def test_the_cli_prices_the_whole_layer_on_request(capsys):
    def step(*extra: str) -> float:
        assert main([*ARGS, *extra, "--json"]) == 0
        return json.loads(capsys.readouterr().out)["iteration_s"]

    early, whole = step("--recompute", "full"), step("--recompute", "full", "--whole-layer-recompute")
    assert whole > early > step()


def test_the_cli_refuses_it_without_full_recomputation(capsys):
    assert main([*ARGS, "--whole-layer-recompute"]) != 0
    assert "--whole-layer-recompute: it says how full recomputation runs" in capsys.readouterr().err


def test_the_plan_field_is_a_system_field():
    assert "recompute_early_stop" in {f.name for f in dataclasses.fields(ParallelPlan)}
    assert PLAN.system()["recompute_early_stop"] is True


def test_a_hugging_face_llama_recomputed_by_loom_skips_its_down_projection():
    # the same fact on an unedited Hugging Face model: each decoder layer's down_proj and residual add are not
    # re-run (its linears run aten.mm on 2-D views, each with the view back)
    from transformers import LlamaConfig, LlamaForCausalLM

    def backward_ops(early_stop: bool) -> dict[str, int]:
        torch.manual_seed(0)
        config = LlamaConfig(
            vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=32,
        )  # fmt: skip
        model = LlamaForCausalLM(config)
        for layer in model.model.layers:
            recompute(layer, "full")
        ids = torch.randint(0, 64, (2, 16))
        with set_checkpoint_early_stop(early_stop):
            loss = model(input_ids=ids, labels=ids).loss
        with _CountOps() as counted:
            loss.backward()
        return counted.counts

    early, whole = backward_ops(True), backward_ops(False)
    skipped = {k: whole[k] - early.get(k, 0) for k in whole if whole[k] != early.get(k, 0)}
    assert skipped == {"mm": 2, "_unsafe_view": 2, "add": 2}
