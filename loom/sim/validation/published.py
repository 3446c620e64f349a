"""Every published run of `loom/sim/validation/` as a simulator case, or as a row left out with its reason.

`published_cases()` reads all ten tables: the two Megatron-LM papers and MosaicML's FSDP rows through the
loaders of `loom.sim.validation`, and the rest here. Each case carries its source's half of the fixed split
(`split_by_source.csv`: "fit" or "held-out") and its kind ("dp", "fsdp", "3d", "interleaved", "moe",
"long-context"). A row whose configuration the simulator cannot reproduce faithfully (a fact the source does
not give, a feature loom does not simulate, hardware without a profile) is returned as a `Skipped` with the
reason, never filled in by a guess.

Facts that a table does not restate but that are published elsewhere are named in `ARCHITECTURES` with their
origin. Rules applied to every row of a source, never per row:
- Megatron-LM / NeMo / Megatron-Bridge / Megatron-MoE: recomputation not stated means none (the flags are off
  by default); a plan whose layers do not split evenly over the virtual stages uses the "first and last stage
  one layer fewer" rule (`--account-for-embedding-in-pipeline-split` and `--account-for-loss-...`, and
  DeepSpeed's 'type:transformer|embedding' partition for BLOOM, where each embedding takes a layer's slot).
- Megatron-LM / NeMo / Megatron-Bridge / Megatron-MoE and BLOOM's Megatron-DeepSpeed re-run a checkpointed
  layer's whole forward (their own checkpoint functions: `recompute_early_stop = False`); MosaicML's
  llm-foundry (`activation_checkpointing_reentrant: false` in its benchmark script) and torchtitan checkpoint
  with torch's non-reentrant checkpoint, which stops once the backward's last needed tensor is rebuilt.
- Megatron-LM / NeMo / Megatron-Bridge / Megatron-MoE and BLOOM's DeepSpeed keep 16-bit parameters with the
  fp32 master weights in the optimizer (`master_weights = "optimizer"`: their model states and optimizer
  step's bytes); MosaicML's FSDP and torchtitan's FSDP2 keep fp32 parameters as the master weights.
- NeMo, Megatron-Bridge and Megatron-MoE run Transformer Engine's fused attention, which on Hopper is cuDNN's
  (`attention_kernel = "cudnn"`); MosaicML (FlashAttention-2 / Triton) and torchtitan (torch's SDPA) run
  FlashAttention-2's kernels.
- FP8 recipes run the layers' linear GEMMs in fp8, everything else in bf16 (`ParallelPlan.fp8_matmuls`; the
  casts around them are Transformer Engine's current scaling, the recipe of every Megatron-Bridge H100 run).
- Megatron-Bridge: what the tables do not print, from the perf configs of the release: Qwen3's experts whole
  (expert tp 1), Qwen3-235B without tp communication overlap, and Qwen3-30B-A3B's dispatcher (DeepEP, then
  Hybrid-EP, priced as DeepEP's: `_bridge_dispatcher`).
- Throughput rows are compared as tokens/s over all devices (tokens/s per GPU times the GPUs); rows that
  publish only a time per iteration are compared on it.
- BigScience BLOOM: the cluster its README describes (`jean_zay`: 4 Omni-Path links per node) and DeepSpeed's
  bf16 optimizer (fp32 gradients accumulated in a pass of their own and all-reduced whole).
- torchtitan: FSDP2 with bf16 parameters and fp32 gradient reduction (`grad_dtype`), its copy-in and
  copy-out (`grad_accumulation = "copy_in_out"`).
- Megatron-MoE ModelZoo: the experts' own tensor parallelism from the row's ETP column (`expert_tp`); the
  dispatcher from its `dispatcher` column (`moe_dispatcher`: DeepEP sends a token once per destination rank,
  across nodes once per node); the row published with expert communication overlapped across 1F1B
  micro-batches is left out.
"""

from __future__ import annotations

import csv
import dataclasses
from dataclasses import dataclass

from loom.cost.hardware import PROFILES, Cluster
from loom.cost.plan import ParallelPlan, light_ends
from loom.cost.transformer import TransformerConfig
from loom.sim.validation import HERE, Case, cases, fsdp_cases, gpt

__all__ = ["ARCHITECTURES", "KINDS", "Skipped", "case_kind", "jean_zay", "published_cases", "source_halves"]

KINDS = ("dp", "fsdp", "3d", "interleaved", "moe", "long-context")
LONG_CONTEXT = 32768  # sequences from this length count as long-context runs

# Architecture facts a table leaves out, from the model's own publication: field -> value
ARCHITECTURES: dict[str, dict[str, int]] = {
    # Qwen3 technical report / the models' config.json: vocabulary 151,936 (already a multiple of 128)
    "qwen3": {"vocab": 151936},
    # Touvron et al. 2023 (Llama 2), Table 1 and the released configs: vocabulary 32,000; MLP 11,008 (7B),
    # 13,824 (13B), 28,672 with 8 key/value heads (70B)
    "llama2-7b": {"vocab": 32000, "ffn_hidden": 11008},
    "llama2-13b": {"vocab": 32000, "ffn_hidden": 13824},
    "llama2-70b": {"vocab": 32000, "ffn_hidden": 28672, "kv_heads": 8},
    # Brown et al. 2020 (GPT-3), Sec. 2.1: "the same model and architecture as GPT-2 ... including the
    # reversible tokenization", i.e. GPT-2's byte-level BPE of 50,257 tokens (Radford et al. 2019, Sec. 2.2)
    "gpt3-175b": {"vocab": 50257},
    # BigScience tr11: the vocabulary padded to 250,880 (the run's plan; the benchmark tables say "250k")
    "bloom": {"vocab": 250880},
}


# a run's token dispatcher (the ModelZoo's `dispatcher` column, `_bridge_dispatcher`) -> `ParallelPlan.
# moe_dispatcher`: Megatron-Core's alltoall dispatcher sends a copy per routed expert, as loom's all-to-all;
# DeepEP (`--moe-token-dispatcher-type flex --moe-enable-deepep`) a copy per destination rank, across nodes one
# per node (`loom.cost.moe`); NVIDIA's Hybrid-EP, DeepEP's hierarchical backend (RDMA between nodes, NVLink
# inside them), dispatches to the experts' nodes and ranks alike, permuting the rows in its own kernels
DISPATCHERS = {"A2A": "all_to_all", "DeepEP": "deepep", "HybridEP": "hybridep"}


def jean_zay() -> Cluster:
    """BigScience's BLOOM cluster as its training README describes it ('Hardware'): nodes of 8 A100 80GB
    over NVLink, nodes linked by 4 Omni-Path links each (Omni-Path 100 series: 100 Gb/s a link), so 50 GB/s
    per node, 6.25 GB/s per GPU, a quarter of the DGX A100 profile's one 200 Gb/s HDR NIC per GPU."""
    dgx = PROFILES["a100-80gb"]
    inter = dataclasses.replace(dgx.inter, name="omni-path-100g-x4-per-node", bandwidth=4 * 100e9 / 8 / 8)
    return dataclasses.replace(dgx, inter=inter, notes="Jean Zay A100 80GB: 8 GPUs, NVLink, 4 x 100 Gb/s OPA")


@dataclass(frozen=True, kw_only=True)
class Skipped:
    """A published row the simulator does not reproduce, and why."""

    source: str
    label: str
    reason: str


def source_halves() -> dict[str, str]:
    """Each table's half of the fixed split by source: file stem -> "fit" or "held-out"."""
    with open(HERE / "split_by_source.csv", newline="") as handle:
        return {row["file"].removesuffix(".csv"): row["half"] for row in csv.DictReader(handle)}


def case_kind(model: TransformerConfig, plan: ParallelPlan) -> str:
    """The kind of run a case is, the most specific first: MoE, long context, fully/partly sharded data
    parallelism without model parallelism, interleaved pipeline, other tensor/pipeline plans, plain dp."""
    if model.is_moe:
        return "moe"
    if plan.seq >= LONG_CONTEXT:
        return "long-context"
    if plan.optimizer_level >= 2 and plan.pp == 1:
        return "fsdp"
    if plan.interleave > 1:
        return "interleaved"
    if plan.tp > 1 or plan.pp > 1:
        return "3d"
    return "dp"


def _rows(stem: str) -> list[dict[str, str]]:
    with open(HERE / f"{stem}.csv", newline="") as handle:
        return list(csv.DictReader(handle))


def _int(row: dict[str, str], key: str, default: int | None = None) -> int | None:
    return int(row[key]) if row.get(key) else default


def _llama(row: dict[str, str], facts: dict[str, int] | None = None) -> TransformerConfig:
    """A Llama- or Qwen3-style model (RMSNorm, SwiGLU, no biases, no dropout, untied head) from a row."""
    facts = facts or {}
    moe = _int(row, "experts", 1) > 1
    return TransformerConfig(
        name=row["model"], layers=int(row["layers"]), hidden=int(row["hidden"]), heads=int(row["heads"]),
        kv_heads=facts.get("kv_heads") or _int(row, "kv_heads"), head_size=_int(row, "head_dim"),
        vocab=facts.get("vocab") or int(row["vocab"]),
        ffn_hidden=int(row["moe_ffn_hidden"]) if moe else facts.get("ffn_hidden") or int(row["ffn_hidden"]),
        gated_mlp=True, experts=_int(row, "experts", 1), top_k=_int(row, "top_k", 1), norm="rmsnorm",
        biases=False, dropout=False, tied_embeddings=False,
    )  # fmt: skip


def _gpt3(row: dict[str, str], facts: dict[str, int]) -> TransformerConfig:
    """GPT-3 as NeMo trains it (learned positions, biases, LayerNorm, GeLU MLP of 4 h, tied embedding), the
    architecture from the row and `facts`. Without dropout: NeMo 2.0's `GPTConfig175B` sets hidden and
    attention dropout to 0 (NeMo-Framework-Launcher's gpt3/175b.yaml had 0.1; the 24.07 table states
    neither, and the two price NeMo's rows 0.2 points apart)."""
    return gpt(
        row["model"], int(row["layers"]), int(row["hidden"]), int(row["heads"]), seq=int(row["seq"]),
        vocab=facts.get("vocab") or int(row["vocab"]),
    ).replace(dropout=False)  # fmt: skip


def _missing(row: dict[str, str], keys: tuple[str, ...], facts: dict[str, int]) -> list[str]:
    return [k for k in keys if not row.get(k) and k not in facts]


def _stages(layers: int, plan: ParallelPlan) -> tuple[int, ...]:
    """Equal stages when they divide, else the first and last virtual stage one layer fewer."""
    return () if layers % plan.virtual_stages == 0 else light_ends(layers, plan.virtual_stages)


def _case(source: str, row: dict[str, str], label: str, model, plan, gpu: str, metric: str, value: float):
    plan = plan.replace(stage_layers=_stages(model.layers, plan))
    return Case(
        source=source, label=label, model=model, plan=plan, cluster=PROFILES[gpu].with_size(int(row["gpus"])),
        metric=metric, published=value,
    )  # fmt: skip


def _unsupported(row: dict[str, str]) -> str:
    """Why a row's parallel layout cannot be simulated (empty: it can)."""
    ep, dp, tp, etp = _int(row, "ep", 1), int(row["dp"]), int(row["tp"]), _int(row, "etp")
    if etp is None and dp % ep:
        return f"ep={ep} spans tensor- and data-parallel ranks (dp={dp}) and the row gives no expert tp"
    if etp is not None and (tp * dp) % (etp * ep):
        return f"expert tp * ep = {etp}*{ep} does not divide tp * dp = {tp * dp}"
    return ""


BRIDGE = "nvidia2026_megatron_bridge_perf_summary"


def _bridge_dispatcher(row: dict[str, str]) -> str:
    """The token dispatcher of a Megatron-Bridge H100 run, which its table does not print, from the perf
    configs of its release (scripts/performance/configs/qwen3/, qwen/ from v0.3.0): Megatron's all-to-all
    where they name no flex backend (v0.2.0, 25.11) or set `moe_token_dispatcher_type = "alltoall"`
    (Qwen3-235B-A22B through r0.5.0); Qwen3-30B-A3B's `moe_flex_dispatcher_backend` is "deepep" at v0.3.0
    (26.02) and "hybridep" with ep 16 from f29a269 (2026-02-23, "Update Qwen3 30B H100 Base Configs with
    HybridEP"), which r0.4.0 to r0.5.0 keep (26.02.01 to 26.06). A key of `DISPATCHERS`."""
    if not row["model"].startswith("qwen3_30b"):
        return "A2A"
    release = tuple(int(part) for part in row["release"].split("."))  # "26.02.01" -> (26, 2, 1)
    return "HybridEP" if release >= (26, 2, 1) else "DeepEP" if release >= (26, 2) else "A2A"


# Megatron-Core's --overlap-moe-expert-parallel-comm (Megatron-Bridge's `moe_a2a_overlap`, with
# `delay_wgrad_compute`): one micro-batch's dispatch and combine run beside another's compute in the 1F1B steady
# state and weight gradients are deferred; loom waits for each exchange where it is issued
A2A_OVERLAP = "expert-parallel communication overlapped across 1F1B micro-batches is not simulated"


def _bridge_a2a_overlap(row: dict[str, str]) -> bool:
    """Whether a Megatron-Bridge H100 run overlapped its expert exchanges across micro-batches, which its table
    does not print (scripts/performance/configs/qwen3/workload_base_configs.py at v0.2.0, qwen/qwen3_workload_
    base_configs.py from v0.3.0): Qwen3-235B-A22B's H100 FP8-CS configs set `moe_a2a_overlap=True` in every
    release (v0.2.0 to v0.5.0); Qwen3-30B-A3B's at v0.2.0 and v0.3.0 (25.11, 26.02), and no more once it runs
    HybridEP (v0.4.0 on: 26.02.01 to 26.06)."""
    if row["model"].startswith("qwen3_235b"):
        return True
    return row["model"].startswith("qwen3_30b") and row["release"] in ("25.11", "26.02")


def _bridge_sync(row: dict[str, str]) -> str:
    """Whether a Megatron-Bridge H100 MoE run's dispatch reads the per-expert counts on the host in every MoE
    layer: 25.09's "(tokendrop)" runs pad to capacity (`apply_moe_token_drop`, fixed shapes); the later perf
    configs are dropless, and their fp8 H100 configs capture no CUDA graphs (`QWEN3_30B_A3B_H100_FP8_CS_BASE_
    CONFIG`, `QWEN3_235B_A22B_H100_FP8_CS_BASE_CONFIG` at v0.2.0, the `*_H100_FP8_CS_V1` configs after)."""
    return "token_drop" if "(tokendrop)" in row["notes"] else "dropless"


def _megatron_perf(stem: str) -> tuple[list[Case], list[Skipped]]:
    """NeMo 24.07 and Megatron-Bridge performance summaries (DGX-H100, Megatron-Core)."""
    out, skipped = [], []
    for row in _rows(stem):
        label = f"{row['model']} {row.get('release', '')} {row['precision']}".strip()
        qwen3 = row["model"].startswith("qwen3")
        facts = ARCHITECTURES["qwen3"] if qwen3 else ARCHITECTURES.get(row["model"], {})
        if qwen3 and stem == BRIDGE:
            # the tables print no expert tp: Megatron-Bridge's Qwen3 perf configs run the experts whole
            # (`BASE_QWEN3_30B_A3B_CONFIG` and `BASE_QWEN3_235B_A22B_CONFIG` set expert_tensor_parallel_size=1,
            # scripts/performance/configs/qwen3/workload_base_configs.py at v0.2.0, qwen/ from v0.3.0)
            row = {**row, "etp": row.get("etp") or "1"}
        keys = (
            "layers",
            "hidden",
            "heads",
            "vocab",
            "ffn_hidden" if not row["experts"] else "moe_ffn_hidden",
        )
        reason = _unsupported(row)
        if missing := _missing(row, keys, facts):
            reason = f"architecture not recorded ({', '.join(missing)})"
        elif not row["precision"]:
            reason = "precision not stated"
        elif stem == BRIDGE and _bridge_a2a_overlap(row):
            reason = A2A_OVERLAP
        if reason:
            skipped.append(Skipped(source=stem, label=label, reason=reason))
            continue
        model = (_gpt3 if row["model"].startswith("gpt3") else _llama)(row, facts)
        fp8 = row["precision"].startswith("fp8")
        # NeMo 24.07 ran Transformer Engine 1.x, whose only fp8 recipe is delayed scaling (its configs' fp8_hybrid,
        # fp8_amax_history_len, fp8_amax_compute_algo); Megatron-Bridge's H100 configs run current scaling
        scaling = "delayed" if fp8 and stem != BRIDGE else "current"
        # the perf recipes turn on tensor-parallel communication overlap (Megatron-Bridge's
        # `CommOverlapConfig(tp_comm_overlap=True)`, NeMo's userbuffers configs), which is dropped at tp 1;
        # Qwen3-235B's H100 config turns it off (`qwen3_235b_a22b_h100_config`, v0.2.0 on:
        # `CommOverlapConfig(tp_comm_overlap=False)`)
        # context parallelism is Megatron-Core's default `--cp-comm-type p2p` (Transformer Engine's ring of
        # key/value exchanges over the head-tail cut, `attention="megatron_p2p"`); the CSVs derive dp as
        # gpus / (tp * pp * cp), the data-parallel degree without cp, as `ParallelPlan.dp` is
        tp = int(row["tp"])
        overlap_tp = tp > 1 and not (stem == BRIDGE and row["model"].startswith("qwen3_235b"))
        plan = ParallelPlan(
            dp=int(row["dp"]), tp=tp, pp=int(row["pp"]), interleave=_int(row, "interleave", 1),
            cp=_int(row, "cp", 1), attention="megatron_p2p", ep=_int(row, "ep", 1), expert_tp=_int(row, "etp", 0),
            micro_batch=int(row["micro_batch"]), global_batch=int(row["global_batch"]), seq=int(row["seq"]),
            optimizer_level=3 if row.get("fsdp", "0") not in ("", "0") else 1, sequence_parallel=tp > 1,
            flash_attention=True, dtype="bf16", fp8_matmuls=fp8, fp8_scaling=scaling,
            overlap_tp_comm=overlap_tp, moe_sync=_bridge_sync(row), moe_dispatcher=DISPATCHERS[_bridge_dispatcher(row)],
            recompute_early_stop=False, attention_kernel="cudnn", master_weights="optimizer",
        )  # fmt: skip
        gpus = int(row["gpus"])
        out.append(
            _case(stem, row, label, model, plan, "h100-sxm", "tokens_per_s",
                  float(row["tokens_per_s_per_gpu"]) * gpus)
        )  # fmt: skip
    return out, skipped


def _torchtitan_a100() -> tuple[list[Case], list[Skipped]]:
    """torchtitan's FSDP2 runs of Llama 2 and 3 on 64 A100 80GB (docs/performance.md, its A100 tables added
    on 2024-04-18 with torchtitan 395a526 on torch 2.4.0.dev20240412): `MixedPrecisionPolicy(param_dtype=
    bf16, reduce_dtype=fp32)` (`parallelize_llama.py`), so gradients are reduce-scattered in fp32, and
    FSDP2 copies every unit's parameters out of its all-gather buffer and its gradients, cast to fp32, into
    its reduce-scatter buffer (`grad_accumulation = "copy_in_out"`)."""
    stem, out, skipped = "torchtitan2024_a100_performance", [], []
    # "selective op": torchtitan's op-level selective checkpointing (`--activation_checkpoint.mode selective
    # --activation_checkpoint.selective_ac_option op`), priced as it ran (`TransformerConfig.op_sac_matmuls`);
    # "selective layer": its layer-level one at the default `selective_ac_option = "2"`, every second block
    # checkpointed whole (`_apply_ac_to_transformer_block`'s `use_layer_sac`)
    recompute = {
        "none": "none",
        "full": "full",
        "selective op": "torchtitan_op",
        "selective layer": "torchtitan_layer",
    }
    for row in _rows(stem):
        label = f"{row['model']} {row['recompute']} {row['precision']}"
        reason = "no hardware profile for the H100 94GB HBM2e (lower clocks; peak not published)"
        if row["gpu"] == "a100-80gb":
            reason = "" if row["recompute"] in recompute else f"recompute {row['recompute']!r} is not priced"
        if reason:
            skipped.append(Skipped(source=stem, label=label, reason=reason))
            continue
        model = _llama(row, ARCHITECTURES.get(row["model"]))
        plan = ParallelPlan(
            dp=int(row["dp"]), tp=int(row["tp"]), micro_batch=int(row["micro_batch"]),
            global_batch=int(row["global_batch"]), seq=int(row["seq"]), recompute=recompute[row["recompute"]],
            optimizer_level=int(row["zero_stage"]), flash_attention=True, dtype="bf16", grad_dtype="fp32",
            grad_accumulation="copy_in_out",
        )  # fmt: skip
        gpus = int(row["gpus"])
        out.append(
            _case(stem, row, label, model, plan, "a100-80gb", "tokens_per_s",
                  float(row["tokens_per_s_per_gpu"]) * gpus)
        )  # fmt: skip
    return out, skipped


def _bloom() -> tuple[list[Case], list[Skipped]]:
    """BigScience BLOOM-176B shapes on 384 A100 80GB of Jean Zay (`jean_zay`), Megatron-DeepSpeed (1F1B, full
    recompute). Its bf16 optimizer (the prequel's 'Rebalancing layers': "BF16 optimizer that was just written
    to accumulate gradients in fp32"; the README: it "doesn't shard the static fp32 buffer") adds each
    micro-batch's bf16 gradients into an fp32 buffer after its backward, all-reduces the whole fp32 buffer
    over dp, updates its ZeRO-1 shard and all-gathers the bf16 parameters (DeepSpeed's pipeline engine:
    `update_hp_grads` after every backward, `buffered_allreduce_fallback` of the fp32 gradients)."""
    stem, out = "bigscience2022_bloom176b", []
    for row in _rows(stem):
        model = TransformerConfig(
            name=row["model"],
            layers=int(row["layers"]),
            hidden=int(row["hidden"]),
            heads=int(row["heads"]),
            vocab=_int(row, "vocab") or ARCHITECTURES["bloom"]["vocab"],
            dropout=False,
        )  # ALiBi: no position table; GeLU MLP 4h with biases; LayerNorm; tied embedding
        plan = ParallelPlan(
            dp=int(row["dp"]), tp=int(row["tp"]), pp=int(row["pp"]), micro_batch=int(row["micro_batch"]),
            global_batch=int(row["global_batch"]), seq=int(row["seq"]), recompute="full", optimizer_level=1,
            dtype="bf16", overlap_grad_sync=False, grad_dtype="fp32", grad_reduce="all_reduce",
            grad_accumulation="separate", overlap_p2p=False, recompute_early_stop=False, master_weights="optimizer",
        )  # fmt: skip
        label = f"{row['model']} h{row['heads']} tp{row['tp']} pp{row['pp']} mb{row['micro_batch']}"
        case = _case(stem, row, label, model, plan, "a100-80gb", "iteration_s", float(row["iteration_s"]))
        out.append(dataclasses.replace(case, cluster=jean_zay().with_size(int(row["gpus"]))))
    return out, []


def _moe_modelzoo() -> tuple[list[Case], list[Skipped]]:
    """Megatron-MoE ModelZoo's Qwen3 runs on H100 (iteration times)."""
    stem, out, skipped = "yan2025_moe_modelzoo_qwen3", [], []
    for row in _rows(stem):
        label = (
            f"{row['model']} tp{row['tp']} pp{row['pp']} ep{row['ep']} seq{row['seq']} {row['moe_routing']}"
        )
        reason = _unsupported(row)
        if not row["layers"]:
            reason = "architecture not recorded"
        elif not row["micro_batch"] or not row["iteration_s"]:
            reason = "micro-batch size and time per iteration not recorded"
        elif (virtual := int(row["pp"]) * _int(row, "interleave", 1)) > int(row["layers"]) + 2:
            # the ends may hold the embedding or the output layer alone (`light_ends`), no stage between
            reason = (
                f"{virtual} virtual stages for {row['layers']} layers leave a middle stage without layers"
            )
        elif "+1f1b overlap" in row["notes"]:
            reason = A2A_OVERLAP
        if reason:
            skipped.append(Skipped(source=stem, label=label, reason=reason))
            continue
        model = _llama(row, ARCHITECTURES["qwen3"])
        recompute = "full" if row["recompute"] == "full" else "selective" if row["recompute"] else "none"
        # Megatron-LM's --bf16 turns on --accumulate-allreduce-grads-in-fp32 unless --grad-reduce-in-bf16 is
        # given (megatron/training/arguments.py; the ModelZoo yaml gives neither): fp32 gradient buffers,
        # reduce-scattered in fp32 by the distributed optimizer and by Megatron FSDP alike
        plan = ParallelPlan(
            dp=int(row["dp"]), tp=int(row["tp"]), pp=int(row["pp"]), interleave=_int(row, "interleave", 1),
            ep=int(row["ep"]), expert_tp=_int(row, "etp", 0), micro_batch=int(row["micro_batch"]),
            global_batch=int(row["global_batch"]), seq=int(row["seq"]), recompute=recompute,
            optimizer_level=int(row["zero_stage"]), sequence_parallel=int(row["tp"]) > 1, flash_attention=True,
            dtype="bf16", grad_dtype="fp32", moe_dispatcher=DISPATCHERS[row["dispatcher"]],
            moe_sync="dropless",  # no capacity factor in the command; its CUDA-graph variant came later
            recompute_early_stop=False, attention_kernel="cudnn", master_weights="optimizer",
        )  # fmt: skip
        out.append(_case(stem, row, label, model, plan, "h100-sxm", "iteration_s", float(row["iteration_s"])))
    return out, skipped


def _not_simulated(stem: str, reason: str) -> list[Skipped]:
    return [Skipped(source=stem, label=row["model"], reason=reason) for row in _rows(stem)]


def published_cases() -> tuple[list[Case], list[Skipped]]:
    """Every published row: the cases (each with its `half` and `kind`) and the rows left out, with why."""
    loaded, skipped = list(cases()) + fsdp_cases(), []
    for loader in (
        lambda: _megatron_perf("nvidia2024_nemo_perf_summary"),
        lambda: _megatron_perf(BRIDGE),
        _torchtitan_a100, _bloom, _moe_modelzoo,
    ):  # fmt: skip
        more, left = loader()
        loaded += more
        skipped += left
    skipped += _not_simulated(
        "torchtitan2024_h100_benchmarks",
        "no hardware profile for Grand Teton's 500 W H100 96GB HBM2e (peak between SXM and NVL, not published)",
    )
    skipped += _not_simulated(
        "dubey2024_table4",
        "interleaving (V) and micro-batch size not stated (and context parallelism at 128K)",
    )
    halves = source_halves()

    def half(source: str) -> str:  # the older loaders name a source by the start of its file's name
        return next(h for stem, h in halves.items() if stem.startswith(source))

    loaded = [dataclasses.replace(c, half=half(c.source), kind=case_kind(c.model, c.plan)) for c in loaded]
    return loaded, skipped
