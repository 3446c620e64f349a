"""Communication volumes of fully sharded data parallelism (optimizer level 3: ZeRO-3, FSDP FULL_SHARD).

Every unit (one transformer layer; the embedding; the output layer) keeps 1/dp of its parameters on each
device. Before the unit's forward its parameters are all-gathered over the data-parallel group, again before
its backward (they were freed after forward), and after its backward its gradients are reduce-scattered.
Sizes are nccl-tests' (the gathered, full buffer), in the training dtype, of what one device of a
tensor-parallel group holds: a layer's attention and dense MLP split over tp, its norms replicated; its
experts split over etp and ep, gathered over the expert-data-parallel group (tp * dp / (etp * ep)) instead.
"""

from __future__ import annotations

from dataclasses import dataclass

from loom.cost.compute import DTYPE_BYTES
from loom.cost.plan import ParallelPlan
from loom.cost.transformer import TransformerConfig

__all__ = ["UnitBytes", "embedding_unit_bytes", "head_unit_bytes", "layer_unit_bytes"]


@dataclass(frozen=True, kw_only=True)
class UnitBytes:
    """Bytes of one unit's all-gather (and, the same buffer, its reduce-scatter) per device: `dense` over
    the data-parallel group, `expert` over the expert-data-parallel group."""

    dense: float
    expert: float = 0.0

    def scaled(self, factor: float) -> UnitBytes:
        """The same unit's buffers in another precision (`factor` = new bytes per element / old)."""
        return UnitBytes(dense=self.dense * factor, expert=self.expert * factor)


def layer_unit_bytes(model: TransformerConfig, plan: ParallelPlan) -> UnitBytes:
    """One transformer layer's gathered parameters on one device (see the module's docstring)."""
    e, t = DTYPE_BYTES[plan.dtype], plan.tp
    norms = 2 * model.norm_parameters()
    experts = model.experts * model.mlp_parameters() if model.is_moe else 0
    sharded = model.layer_parameters() - norms - experts  # attention, dense MLP, router: split over tp
    return UnitBytes(dense=e * (sharded / t + norms), expert=e * experts / (plan.etp * plan.ep))


def embedding_unit_bytes(model: TransformerConfig, plan: ParallelPlan) -> UnitBytes:
    """The (vocabulary-parallel) embedding's gathered parameters on one device."""
    return UnitBytes(dense=DTYPE_BYTES[plan.dtype] * model.embedding_parameters() / plan.tp)


def head_unit_bytes(model: TransformerConfig, plan: ParallelPlan) -> UnitBytes:
    """The final norm and, untied, the output projection, gathered on one device (a tied head on one
    pipeline stage shares the embedding's gathered weight and gathers only the norm)."""
    e, t = DTYPE_BYTES[plan.dtype], plan.tp
    projection = 0 if model.tied_embeddings else model.vocab * model.hidden / t
    if model.tied_embeddings and plan.pp > 1:
        projection = model.vocab * model.hidden / t  # the last stage's own copy of the tied embedding
    return UnitBytes(dense=e * (model.norm_parameters() + projection))
