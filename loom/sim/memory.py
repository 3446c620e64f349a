"""Peak memory of each pipeline stage's devices under a plan: model states plus in-flight activations.

With cp > 1 a rank keeps the activations of its seq / cp tokens of each sequence (and, for Ulysses without
fused attention, the scores of its heads / cp over whole sequences), and its optimizer states shard over
dp x cp from level 1 on: loom reduces and shards gradients over the cp ranks as over data parallelism."""

from __future__ import annotations

from loom.cost.compute import DTYPE_BYTES
from loom.cost.hardware import GIB, Cluster
from loom.cost.memory import (
    cast_weight_bytes,
    layer_activation_bytes,
    layer_parameters_per_device,
    model_state_bytes,
    state_bytes,
)
from loom.cost.plan import WHOLE_LAYER_RECOMPUTES, ParallelPlan
from loom.cost.traffic import shards_as_rows
from loom.cost.transformer import TransformerConfig

__all__ = ["chunk_parameters", "stage_memory", "stage_parameters"]


def chunk_parameters(model: TransformerConfig, plan: ParallelPlan, stage: int) -> tuple[float, float]:
    """(dense, expert) parameters one device holds of virtual stage `stage` (model order)."""
    t, layers = plan.tp, plan.chunk_layers(model.layers)[stage]
    split, norms, experts = layer_parameters_per_device(model, plan)
    dense = layers * (split + norms)
    expert = layers * experts
    if stage == 0:
        dense += model.embedding_parameters() / t
    if stage == plan.virtual_stages - 1:
        dense += model.output_parameters() - model.norm_parameters() * (1 - 1 / t)
        if model.tied_embeddings and plan.pp > 1:
            dense += model.vocab * model.hidden / t  # the last stage keeps its own copy of the tied embedding
    return dense, expert


def stage_parameters(model: TransformerConfig, plan: ParallelPlan, rank: int) -> tuple[float, float]:
    """(dense, expert) parameters held by one device of pipeline rank `rank` (its chunks v = rank, rank +
    pp, ...)."""
    chunks = [chunk_parameters(model, plan, v) for v in range(rank, plan.virtual_stages, plan.pp)]
    return sum(d for d, _ in chunks), sum(x for _, x in chunks)


def stage_memory(
    model: TransformerConfig, plan: ParallelPlan, cluster: Cluster, rank: int, in_flight: int
) -> dict[str, float]:
    """Bytes per device on pipeline rank `rank` by kind; `in_flight` is its peak count of live chunk forwards."""
    dense, expert = stage_parameters(model, plan, rank)
    rows = shards_as_rows(plan)  # the gradients' and optimizer states' group: dp x cp
    sizes = state_bytes(plan)
    if plan.grad_accumulation == "separate":  # the backward's own gradients beside the accumulation buffer
        sizes["grad_bytes"] += DTYPE_BYTES[plan.dtype]
    level = plan.optimizer_level
    states = model_state_bytes(dense, level, rows.dp, **sizes)
    states += model_state_bytes(expert, level, rows.edp, **sizes)
    s, b, t, e = plan.seq, plan.micro_batch, plan.tp, DTYPE_BYTES[plan.dtype]
    options = {
        "sequence_parallel": plan.sequence_parallel,
        "flash_attention": plan.flash_attention,
        "dtype_bytes": e,
        "cp": plan.cp,
        "attention": plan.attention,
    }
    per_layer = layer_activation_bytes(model, s, b, t, recompute=plan.recompute, **options)
    # a chunk in flight keeps its layers' activations: count this rank's largest chunk (uneven stages)
    layers_per_chunk = max(plan.chunk_layers(model.layers)[rank :: plan.pp])
    activations = in_flight * layers_per_chunk * per_layer
    if plan.recompute in (*WHOLE_LAYER_RECOMPUTES, "torchtitan_op"):  # backward rebuilds a layer at a time
        activations += layer_activation_bytes(model, s, b, t, recompute="none", **options)
    local = s * b / plan.cp  # the rank's tokens
    tokens = local / (t if plan.sequence_parallel else 1)
    if rank == 0 and model.dropout:
        activations += in_flight * tokens * model.hidden  # embedding dropout masks, one byte each
    if rank == plan.pp - 1:
        # final norm and output projection inputs, and the fp32 logits of the micro-batch in backward
        activations += 2 * e * tokens * model.hidden + 4 * local * model.vocab / t
    return {
        "model_states": states,
        "activations": activations,
        "weight_casts": _weight_casts(model, plan, rank),
        "reserved": cluster.device.reserved_gib * GIB,
    }


def _weight_casts(model: TransformerConfig, plan: ParallelPlan, rank: int) -> float:
    """Bytes of the 16-bit weight copies autocast makes (`cast_weight_bytes`) that pipeline rank `rank` holds
    at its peak: one copy of every weight it holds. Without a pipeline a micro-batch's forward is an autocast
    region whose cache holds them to its end, and its layers keep them for their backward (a recomputation
    casts again, one layer at a time); with one, the whole schedule is one region, whose cache holds them
    for the step and serves every micro-batch."""
    layer, head = cast_weight_bytes(model, plan)
    return layer * plan.rank_layers(model.layers, rank) + head * (rank == plan.pp - 1)
