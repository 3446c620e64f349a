"""Whose fused attention kernels a run uses (`ParallelPlan.attention_kernel`): FlashAttention-2's, as torch's
scaled dot-product attention runs them (loom's runtime), or cuDNN's, Transformer Engine's FusedAttention on
Hopper (Megatron's and NeMo's runs), each at its own fraction of a GEMM's speed."""

from __future__ import annotations

import dataclasses
import json

import pytest

from loom.cli.main import main
from loom.cost.compute import fused_attention_time
from loom.cost.efficiency import ATTENTION_EFFICIENCY, CUDNN_ATTENTION_EFFICIENCY
from loom.cost.hardware import get_cluster
from loom.cost.plan import LOOM_SYSTEM, FieldError, ParallelPlan
from loom.sim.validation.published import published_cases

H100 = get_cluster("h100-sxm", gpus=8).device


def test_cudnn_kernels_run_at_their_own_fraction_on_hopper():
    shape = {"queries": 4096, "head_dim": 128, "keys": 4096, "batch": 32, "share": 0.5}
    flash, cudnn = fused_attention_time(H100, **shape), fused_attention_time(H100, **shape, kernel="cudnn")
    knee = H100.matmul_knee
    flops = 2 * 2.0 * 4096 * 128 * 4096 * 32 * 0.5
    fraction = H100.matmul_efficiency * (4096 / (4096 + knee)) ** 2
    assert flash == pytest.approx(
        flops / (H100.peak("bf16") * fraction * ATTENTION_EFFICIENCY["h100"]), rel=1e-12
    )
    assert cudnn == pytest.approx(
        flops / (H100.peak("bf16") * fraction * CUDNN_ATTENTION_EFFICIENCY["h100"]), rel=1e-12
    )
    # a device without a cuDNN fraction (the A100 profiles) runs both at its one attention fraction
    a100 = get_cluster("a100-80gb", gpus=8).device
    assert a100.cudnn_attention_efficiency is None
    assert fused_attention_time(a100, **shape, kernel="cudnn") == fused_attention_time(a100, **shape)


def test_the_plan_field_is_a_system_field_loom_runs_flash2():
    plan = ParallelPlan(global_batch=8, seq=2048, flash_attention=True)
    assert plan.attention_kernel == LOOM_SYSTEM["attention_kernel"] == "flash2"
    assert plan.replace(attention_kernel="cudnn").system()["attention_kernel"] == "cudnn"
    with pytest.raises(FieldError, match="attention_kernel"):
        plan.replace(attention_kernel="flash3")
    assert "attention_kernel" in {f.name for f in dataclasses.fields(ParallelPlan)}


def test_transformer_engine_runs_are_priced_with_cudnn_kernels():
    cases, _ = published_cases()
    cudnn = {c.source for c in cases if c.plan.attention_kernel == "cudnn"}
    assert cudnn == {
        "nvidia2024_nemo_perf_summary",
        "nvidia2026_megatron_bridge_perf_summary",
        "yan2025_moe_modelzoo_qwen3",
    }


ARGS = ["simulate", "--model", "llama3-8b", "--hardware", "h100-sxm", "--gpus", "8", "--global-batch", "8"]
ARGS += ["--seq", "8192", "--optimizer-level", "3"]


def test_the_cli_prices_cudnn_kernels_and_wants_flash_attention(capsys):
    def step(*extra: str) -> float:
        assert main([*ARGS, "--flash-attention", *extra, "--json"]) == 0
        return json.loads(capsys.readouterr().out)["iteration_s"]

    faster = CUDNN_ATTENTION_EFFICIENCY["h100"] > ATTENTION_EFFICIENCY["h100"]
    assert (step("--attention-kernel", "cudnn") < step()) == faster
    assert main([*ARGS, "--attention-kernel", "cudnn"]) != 0
    assert "--attention-kernel cudnn: it says whose fused attention kernels run" in capsys.readouterr().err
