"""Published runs (Korthikanti et al. 2022 Table 5, Narayanan et al. 2021 Table 1) as simulator cases; all
the other tables are read by `loom.sim.validation.published`.

Both papers train GPT models (sequence 2048, vocabulary 51200, fp16) with Megatron-LM on DGX A100 80GB
nodes, so every case runs on the built-in "a100-80gb" profile with no per-row change. Megatron-LM of that
time reduced gradients after backward, so gradient synchronisation is not overlapped; and it moved
activations between pipeline stages in 1/tp shares gathered over NVLink (--scatter-gather-tensors-in-
pipeline, Narayanan et al. Section 4.1), waiting on every send before the next micro-batch's work
(`MEGATRON_2021_P2P`).

Narayanan's Table 1 does not give micro-batch size or chunks per stage; one fixed rule is applied to every
row: micro-batch 1; with pp > 1, the interleaved schedule with the smallest number of chunks above 1 that
divides the layers of a stage (2 for most rows, 3 for the 105-layer model); data parallelism fills the rest,
dp = gpus / (tp * pp). Its metric is TFLOP/s per GPU with recomputation counted (its Eq. 3).
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path

from loom.cost.hardware import PROFILES, Cluster
from loom.cost.plan import ParallelPlan
from loom.cost.transformer import TransformerConfig

__all__ = ["MEGATRON_2021_P2P", "Case", "cases", "fsdp_cases", "gpt", "narayanan_interleave", "read_rows"]

HERE = Path(__file__).parent
TABLES = {
    "korthikanti2022": "korthikanti2022_table5.csv",
    "narayanan2021": "narayanan2021_table1.csv",
    "mosaicml2024": "mosaicml2024_llmfoundry_benchmarks.csv",
}
# how Megatron-LM of 2021-22 sent activations between stages: its `_communicate` waited on the batched
# sends and receives and synchronised the device, and each tensor-parallel rank sent 1/tp of the stream
MEGATRON_2021_P2P = {"overlap_p2p": False, "scatter_gather_p2p": True}
# the GPUs the MosaicML rows name, as loom's hardware profiles
_PROFILE_OF = {"a100-40gb": "a100-40gb", "a100-80gb": "a100-80gb", "h100-80gb": "h100-sxm"}


@dataclass(frozen=True, kw_only=True)
class Case:
    """One published run: what to simulate and the value to compare (`metric`: "iteration_s",
    "tflops_per_device" or "tokens_per_s")."""

    source: str
    label: str
    model: TransformerConfig
    plan: ParallelPlan
    cluster: Cluster
    metric: str
    published: float
    half: str = ""  # "fit" or "held-out": the source's half of the fixed split (split_by_source.csv)
    kind: str = ""  # "dp", "fsdp", "3d", "interleaved", "moe" or "long-context"


def read_rows(table: str) -> list[dict[str, str]]:
    """The rows of one table (a key of `TABLES`) as dicts of strings."""
    with open(HERE / TABLES[table], newline="") as handle:
        return list(csv.DictReader(handle))


def gpt(
    name: str, layers: int, hidden: int, heads: int, seq: int = 2048, vocab: int = 51200
) -> TransformerConfig:
    """A GPT-3-style model as both papers train it (learned positions, biases, LayerNorm, dropout, tied)."""
    return TransformerConfig(
        name=name, layers=layers, hidden=hidden, heads=heads, vocab=vocab, learned_positions=seq
    )


def narayanan_interleave(layers_per_stage: int) -> int:
    """Chunks per stage for a Narayanan row: the smallest divisor above 1 of the stage's layers."""
    return next(v for v in range(2, layers_per_stage + 1) if layers_per_stage % v == 0)


def _korthikanti() -> list[Case]:
    out = []
    for row in read_rows("korthikanti2022"):
        gpus, selective = int(row["gpus"]), row["recompute"] == "selective_sp"
        plan = ParallelPlan(
            dp=int(row["dp"]), tp=int(row["tp"]), pp=int(row["pp"]), interleave=int(row["interleave"]),
            micro_batch=int(row["micro_batch"]), global_batch=int(row["global_batch"]), seq=int(row["seq"]),
            recompute="selective" if selective else "full", sequence_parallel=selective, dtype="fp16",
            overlap_grad_sync=False, recompute_early_stop=False, master_weights="optimizer", **MEGATRON_2021_P2P,
        )  # fmt: skip
        model = gpt(
            row["model"],
            int(row["layers"]),
            int(row["hidden"]),
            int(row["heads"]),
            plan.seq,
            int(row["vocab"]),
        )
        out.append(
            Case(
                source="korthikanti2022",
                label=f"{row['model']} {row['recompute']}",
                model=model,
                plan=plan,
                cluster=PROFILES["a100-80gb"].with_size(gpus),
                metric="iteration_s",
                published=float(row["iteration_s"]),
            )  # fmt: skip
        )
    return out


def _narayanan() -> list[Case]:
    out = []
    for row in read_rows("narayanan2021"):
        tp, pp, gpus, layers = int(row["tp"]), int(row["pp"]), int(row["gpus"]), int(row["layers"])
        plan = ParallelPlan(
            dp=gpus // (tp * pp), tp=tp, pp=pp, interleave=narayanan_interleave(layers // pp) if pp > 1 else 1,
            micro_batch=1, global_batch=int(row["global_batch"]), seq=2048, recompute="full", dtype="fp16",
            overlap_grad_sync=False, recompute_early_stop=False, master_weights="optimizer", **MEGATRON_2021_P2P,
        )  # fmt: skip
        model = gpt(f"{row['params_b']}B", layers, int(row["hidden"]), int(row["heads"]))
        out.append(
            Case(
                source="narayanan2021",
                label=f"{row['params_b']}B",
                model=model,
                plan=plan,
                cluster=PROFILES["a100-80gb"].with_size(gpus),
                metric="tflops_per_device",
                published=float(row["tflops_per_gpu"]),
            )  # fmt: skip
        )
    return out


def cases() -> list[Case]:
    """Every row of both tables as a simulator case (Korthikanti first)."""
    return _korthikanti() + _narayanan()


def fsdp_cases() -> list[Case]:
    """MosaicML llm-foundry's published throughput of MPT models (125M to 70B) trained by PyTorch FSDP on 8
    to 512 A100s and H100s: every row with full sharding (ZeRO-3: optimizer level 3) or gradient and
    optimizer sharding (level 2), bf16, no CPU offload. They belong to the fit half of the split by source
    (`split_by_source.csv`). MPT as llm-foundry's `MPTConfig` defaults left it for these runs (the benchmark
    yamls set neither `no_bias` nor `alibi`): biases in every projection and LayerNorm, learned positions, no
    dropout, a tied head, which gives every row's published NumParams exactly; the runs use fused attention. Gradients are reduce-scattered in fp32: the benchmark script
    (`scripts/train/benchmarking/submit_benchmarks.py`) leaves FSDP's `mixed_precision` at its 'DEFAULT',
    which Composer of the time maps to bf16 parameters and an fp32 `reduce_dtype`
    (`composer/trainer/mosaic_fsdp_utils.py`, `get_mixed_precision`). The runs used torch 2.1's FSDP1
    (`sweep.sh`'s image, llm-foundry's `torch>=2.1,<2.1.1`) with Composer 0.17's `use_orig_params`, whose
    rows copy, cast and pre-divide every unit's gradients in each micro-batch before its reduce-scatter
    (`grad_accumulation = "flat_copy"`; Composer syncs every micro-batch under FSDP, no `no_sync`). Its
    SHARD_GRAD_OP rows (level 2) run unit by unit too (`ParallelPlan.unit_sharded`): FSDP1 gathers each
    unit before its forward and keeps it for its backward (`_should_free_in_backward` frees it only in
    the post-backward while gradients are synced), whose post-backward hook reduce-scatters the unit's
    gradients as under FULL_SHARD; nothing is left for the step's end. Compared on tokens/s over all
    devices (tokens/s per GPU as published, times the GPUs), a number free of any FLOP-counting convention."""
    out = []
    for row in read_rows("mosaicml2024"):
        if row["activation_cpu_offload"] == "True" or row["zero_stage"] not in ("2", "3"):
            continue
        gpus = int(row["gpus"])
        plan = ParallelPlan(
            dp=gpus, micro_batch=int(row["micro_batch"]), global_batch=int(row["global_batch"]),
            seq=int(row["seq"]), recompute="full" if row["recompute"] == "full" else "none",
            optimizer_level=int(row["zero_stage"]), dtype="bf16", grad_dtype="fp32", flash_attention=True,
            grad_accumulation="flat_copy",
        )  # fmt: skip
        model = TransformerConfig(
            name=row["model"], layers=int(row["layers"]), hidden=int(row["hidden"]), heads=int(row["heads"]),
            vocab=int(row["vocab"]), ffn_hidden=int(row["ffn_hidden"]), dropout=False, learned_positions=int(row["seq"]),
        )  # fmt: skip
        out.append(
            Case(
                source="mosaicml2024",
                label=f"{row['model']} {row['gpu']} x{gpus}",
                model=model,
                plan=plan,
                cluster=PROFILES[_PROFILE_OF[row["gpu"]]].with_size(gpus),
                metric="tokens_per_s",
                published=float(row["tokens_per_s_per_gpu"]) * gpus,
            )  # fmt: skip
        )
    return out
