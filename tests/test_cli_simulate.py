"""Tier 3: `loom simulate` and `loom bench` end to end through `loom.cli.main.main`."""

from __future__ import annotations

import builtins
import json

import pytest

from loom.cli.main import main

GPT3 = [
    "--model",
    "gpt3-175b",
    "--gpus",
    "64",
    "--tp",
    "8",
    "--pp",
    "8",
    "--interleave",
    "3",
    "--global-batch",
    "64",
]
GPT3 += ["--recompute", "selective", "--sequence-parallel"]
KEYS = (
    "iteration_s",
    "tokens_per_s",
    "tflops_per_device",
    "mfu",
    "hfu",
    "bubble_fraction",
    "memory_per_device_gib",
    "fits",
)


def test_console_table(capsys):
    assert main(["simulate", *GPT3]) == 0
    out = capsys.readouterr().out
    for text in ("iteration", "tokens/s", "MFU / HFU", "pipeline bubble", "memory per device", "tp_comm"):
        assert text in out


def test_json_has_the_documented_keys(capsys):
    assert main(["simulate", *GPT3, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert all(data[key] is not None for key in KEYS)
    assert data["fits"] is True and 10 < data["iteration_s"] < 20


def test_shape_flags_build_a_model(capsys):
    args = [
        "simulate",
        "--layers",
        "8",
        "--hidden",
        "1024",
        "--heads",
        "16",
        "--kv-heads",
        "4",
        "--vocab",
        "32000",
    ]
    assert main([*args, "--swiglu", "--ffn-hidden", "2816", "--gpus", "8", "--tp", "2", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["plan"]["dp"] == 4 and data["fits"]


@pytest.mark.parametrize(
    ("flags", "reason"),
    [
        (["--gpus", "100", "--tp", "8", "--pp", "7"], "not a multiple of tp*pp"),
        (["--gpus", "64", "--dp", "2", "--tp", "8", "--pp", "8"], "devices"),
        (["--gpus", "64", "--tp", "8", "--pp", "8", "--interleave", "5"], "layers do not split"),
        (["--gpus", "8", "--tp", "8"], "does not fit"),
    ],
)
def test_impossible_plans_print_the_reason_not_a_number(flags, reason, capsys):
    assert main(["simulate", "--model", "gpt3-175b", *flags]) == 1
    captured = capsys.readouterr()
    assert reason in captured.err and "iteration" not in captured.out


def test_impossible_plan_in_json_has_no_numbers(capsys):
    assert main(["simulate", "--model", "gpt3-175b", "--gpus", "8", "--tp", "8", "--json"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert data["fits"] is False and data["iteration_s"] is None and "GiB" in data["reasons"][0]


def test_usage_errors_exit_2(capsys):
    assert main(["simulate", "--tp", "2"]) == 2
    assert "give --model" in capsys.readouterr().err
    assert main(["simulate", "--model", "gpt3-175b", "--hardware", "abacus"]) == 2


def test_timeline_without_matplotlib_says_so(monkeypatch, tmp_path, capsys):
    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.startswith("matplotlib"):
            raise ImportError("no matplotlib here")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    assert main(["simulate", *GPT3, "--timeline", str(tmp_path / "t.png")]) == 2
    assert "needs matplotlib" in capsys.readouterr().err


def test_timeline_draws_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "t.png"
    assert main(["simulate", *GPT3, "--timeline", str(path)]) == 0
    assert path.stat().st_size > 1000


def test_bench_writes_a_profile_that_simulate_loads(tmp_path, capsys):
    profile = tmp_path / "me.json"
    assert main(["bench", "--sizes", "4096", "65536", "--repeats", "2", "--out", str(profile)]) == 0
    assert "busbw" in capsys.readouterr().out
    shape = [
        "--layers",
        "2",
        "--hidden",
        "256",
        "--heads",
        "4",
        "--vocab",
        "1024",
        "--seq",
        "128",
        "--dtype",
        "fp32",
    ]
    assert (
        main(["simulate", "--hardware", str(profile), *shape, "--gpus", "2", "--micro-batch", "8", "--json"])
        == 0
    )
    data = json.loads(capsys.readouterr().out)
    assert data["fits"] and data["iteration_s"] > 0


@pytest.mark.parametrize(
    "flag", ["--gpus", "--gpus-per-node", "--tp", "--pp", "--dp", "--interleave", "--ep", "--micro-batch",
             "--global-batch", "--seq", "--layers"],
)  # fmt: skip
@pytest.mark.parametrize("value", ["0", "-8"])
def test_counts_below_one_are_refused_not_taken_for_the_default(capsys, flag, value):
    assert main(["simulate", "--model", "llama3-8b", flag, value]) == 2
    err = capsys.readouterr().err
    assert f"argument {flag}: expected a whole number >= 1, got {value}" in err


def test_another_systems_gradients_and_fp8_are_priced_as_the_plan_fields_say(capsys):
    """The flags of another training system's ways set the `ParallelPlan` fields the simulator prices: fp32
    gradient buffers take memory, fp8 GEMMs take less time, blocking pipeline sends show as pp_comm; a value
    the plan cannot take names the field."""

    def priced(*flags: str) -> dict:
        assert main(["simulate", *GPT3, *flags, "--json"]) == 0
        return json.loads(capsys.readouterr().out)

    megatron = ("--master-weights", "optimizer")
    plain = priced(*megatron)
    fp32 = priced(*megatron, "--grad-dtype", "fp32", "--grad-accumulation", "separate")
    assert (fp32["plan"]["grad_dtype"], fp32["plan"]["grad_accumulation"]) == ("fp32", "separate")
    assert plain["plan"]["master_weights"] == "optimizer"
    assert fp32["iteration_s"] > plain["iteration_s"]
    # master weights in the optimizer, per parameter: 16-bit gradients and the step's fp32 copy of them
    # (2 + 4), an fp32 buffer beside the backward's 16-bit gradients (4 + 2), an fp32 buffer alone (4);
    # loom's fp32 parameters are the master weights: 4 + 4 + 8, less than any of them
    memory = [
        run["memory_per_device_gib"] for run in (plain, fp32, priced(*megatron, "--grad-dtype", "fp32"))
    ]
    assert memory[0] == pytest.approx(memory[1]) and memory[2] < memory[1]
    assert priced()["memory_per_device_gib"] < memory[2]
    # DeepSpeed's separate accumulation pass keeps 16-bit parameters: the flag says so
    assert main(["simulate", *GPT3, "--grad-accumulation", "separate"]) == 1
    assert "set --master-weights to 'optimizer'" in capsys.readouterr().err
    h100 = ("--hardware", "h100-sxm")
    current = priced(*h100, "--fp8-matmuls")
    assert current["iteration_s"] < priced(*h100)["iteration_s"]
    delayed = priced(*h100, "--fp8-matmuls", "--fp8-scaling", "delayed")  # no amax passes before the casts
    assert delayed["plan"]["fp8_scaling"] == "delayed"
    assert 0 < delayed["breakdown"]["fp8_cast"] < current["breakdown"]["fp8_cast"]
    assert main(["simulate", *GPT3, *h100, "--fp8-scaling", "delayed"]) == 1
    assert "--fp8-scaling delayed: it scales fp8 GEMMs: set --fp8-matmuls too" in capsys.readouterr().err
    assert main(["simulate", *GPT3, "--fp8-matmuls"]) == 1
    message = capsys.readouterr().err
    assert "--fp8-matmuls: a100-80gb has no fp8 peak" in message and "h100-sxm" in message, message
    sends = priced("--blocking-p2p", "--scatter-gather-p2p")
    assert (sends["plan"]["overlap_p2p"], sends["plan"]["scatter_gather_p2p"]) == (False, True)
    assert sends["breakdown"]["pp_comm"] > 0 == plain["breakdown"].get("pp_comm", 0)
    assert main(["simulate", *GPT3, "--grad-reduce", "reduce_scatter"]) == 1
    message = capsys.readouterr().err
    assert "--grad-reduce reduce_scatter: optimizer level 0 keeps whole gradients" in message, message
    assert "optimizer level 1 or more" in message
    assert main(["simulate", *GPT3, "--expert-tp", "3"]) == 1
    assert "--expert-tp 3: use a divisor of tp=8" in capsys.readouterr().err
    assert main(["simulate", *GPT3, "--grad-accumulation", "flat_copy"]) == 1
    message = capsys.readouterr().err
    assert (
        "--grad-accumulation flat_copy: it prices FSDP's per-unit reduce-scatters of optimizer level 3"
        in message
    )


def test_another_systems_ways_apply_to_a_saved_plan(tmp_path, capsys):
    """A saved Plan priced as another system runs it: the flags set the same fields as with plan flags."""
    from loom.plan import Plan

    Plan(dp=1, tp=8, pp=8, virtual_stages=3, schedule="interleaved", micro_batches=8, recompute="selective",
         sequence_parallel=True, precision="bf16").save(tmp_path / "plan.json")  # fmt: skip
    saved = ["simulate", "--plan", str(tmp_path / "plan.json"), "--model", "gpt3-175b", "--global-batch", "8"]
    assert main([*saved, "--blocking-p2p", "--grad-dtype", "fp32", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert (data["plan"]["overlap_p2p"], data["plan"]["grad_dtype"]) == (False, "fp32")
    assert data["breakdown"]["pp_comm"] > 0


def test_torchtitan_op_recompute_is_priced_not_planned(capsys):
    flags = ["simulate", "--model", "llama3-8b", "--gpus", "8", "--global-batch", "8", "--seq", "4096"]
    flags += ["--optimizer-level", "3", "--recompute", "torchtitan_op"]
    assert main([*flags, "--flash-attention", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["fits"] is True
    assert main(flags) == 1  # torchtitan's policy saves the fused attention kernel's outputs
    assert "--recompute torchtitan_op: " in capsys.readouterr().err


def test_tp_comm_overlap_hides_tensor_parallel_collectives_and_needs_sequence_parallelism(capsys):
    """--tp-comm-overlap sets `overlap_tp_comm`: less tp_comm exposed; refused, naming the flag, where
    sequence parallelism is off."""

    def priced(*flags: str) -> dict:
        assert main(["simulate", *flags, "--json"]) == 0
        return json.loads(capsys.readouterr().out)

    plain, overlapped = priced(*GPT3), priced(*GPT3, "--tp-comm-overlap")
    assert overlapped["plan"]["overlap_tp_comm"] and not plain["plan"]["overlap_tp_comm"]
    assert 0 < overlapped["breakdown"]["tp_comm"] < plain["breakdown"]["tp_comm"]
    assert overlapped["iteration_s"] < plain["iteration_s"]
    without_sp = [flag for flag in GPT3 if flag != "--sequence-parallel"]
    assert main(["simulate", *without_sp, "--recompute", "full", "--tp-comm-overlap"]) == 1
    message = capsys.readouterr().err
    assert "--tp-comm-overlap: it overlaps sequence parallelism's all-gathers" in message, message
    assert main(["simulate", *GPT3, "--tp-comm-overlap", "--gpus-per-node", "4"]) == 1
    message = capsys.readouterr().err
    assert "overlap_tp_comm: Transformer Engine's userbuffers exchange over NVLink" in message


def test_another_systems_flags_are_refused_in_flags_where_they_would_say_nothing(capsys):
    """A refusal of a system flag names flags, not the plan's fields, and a flag that would change nothing is
    refused rather than ignored."""
    small = ["simulate", "--layers", "2", "--hidden", "1024", "--heads", "16", "--vocab", "32000"]
    cases = {
        ("--fp8-scaling", "current"): "--fp8-scaling current: it scales fp8 GEMMs: give --fp8-matmuls too",
        ("--fp8-scaling", "delayed"): "--fp8-scaling delayed: it scales fp8 GEMMs: set --fp8-matmuls too",
        (
            "--cp",
            "2",
            "--attention",
            "megatron_p2p",
        ): "fused attention kernels per block: set --flash-attention,",
        ("--experts", "8", "--top-k", "2", "--moe-dispatcher", "deepep"): "give --ep above 1",
    }
    for flags, message in cases.items():
        assert main([*small, "--hardware", "h100-sxm", "--gpus", "8", *flags]) == 1
        assert message in capsys.readouterr().err, flags
    stages = ["--model", "llama3-8b", "--hardware", "h100-sxm", "--gpus", "8", "--pp", "4"]
    assert main(["simulate", *stages, "--stage-layers", "8,0,16,8"]) == 1
    assert (
        "--stage-layers[1] = 0: use a whole number >= 1: only the first virtual stage"
        in capsys.readouterr().err
    )
