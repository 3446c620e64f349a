"""Communication volumes of fully sharded data parallelism (optimizer level 3: ZeRO-3, FSDP FULL_SHARD).

Every unit (one transformer layer; the embedding; the output layer) keeps 1/dp of its parameters on each
device. Before the unit's forward its parameters are all-gathered over the data-parallel group, again before
its backward (they were freed after forward), and after its backward its gradients are reduce-scattered.
Sizes are nccl-tests' (the gathered, full buffer), in the dtype parameters travel in (`ParallelPlan.
param_precision`: the training dtype, fp32 for loom's runtime), of what one device of a
tensor-parallel group holds: a layer's attention and dense MLP split over tp, its norms replicated; its
experts split over etp and ep, gathered over the expert-data-parallel group (tp * dp / (etp * ep)) instead.
"""

from __future__ import annotations

from dataclasses import dataclass

from loom.cost.compute import DTYPE_BYTES
from loom.cost.plan import ParallelPlan
from loom.cost.transformer import TransformerConfig

__all__ = [
    "UnitBytes",
    "UnitCopyBytes",
    "copy_in_out_bytes",
    "embedding_unit_bytes",
    "flat_copy_bytes",
    "gradient_predivide_factor",
    "head_unit_bytes",
    "layer_unit_bytes",
    "unit_copy_bytes",
]


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
    e, t = DTYPE_BYTES[plan.param_precision], plan.tp
    norms = 2 * model.norm_parameters()
    experts = model.experts * model.mlp_parameters() if model.is_moe else 0
    sharded = model.layer_parameters() - norms - experts  # attention, dense MLP, router: split over tp
    return UnitBytes(dense=e * (sharded / t + norms), expert=e * experts / (plan.etp * plan.ep))


def embedding_unit_bytes(model: TransformerConfig, plan: ParallelPlan) -> UnitBytes:
    """The (vocabulary-parallel) embedding's gathered parameters on one device."""
    return UnitBytes(dense=DTYPE_BYTES[plan.param_precision] * model.embedding_parameters() / plan.tp)


def head_unit_bytes(model: TransformerConfig, plan: ParallelPlan) -> UnitBytes:
    """The final norm and, untied, the output projection, gathered on one device (a tied head on one
    pipeline stage shares the embedding's gathered weight and gathers only the norm)."""
    e, t = DTYPE_BYTES[plan.param_precision], plan.tp
    projection = 0 if model.tied_embeddings else model.vocab * model.hidden / t
    if model.tied_embeddings and plan.pp > 1:
        projection = model.vocab * model.hidden / t  # the last stage's own copy of the tied embedding
    return UnitBytes(dense=e * (model.norm_parameters() + projection))


@dataclass(frozen=True, kw_only=True)
class UnitCopyBytes:
    """Memory traffic (reads plus writes) of one unit's tensors per micro-batch through PyTorch FSDP beyond
    its GEMMs and collectives (`ParallelPlan.grad_accumulation`): `gather` on the compute stream after each
    of the unit's all-gathers, `compute` on the compute stream (or on a stream it waits for) after the
    unit's backward, `reduce` on the stream the unit's reduce-scatter waits for."""

    compute: float
    reduce: float
    reduce_kernels: int  # the reduce stream's kernels (cast, divides, accumulation)
    gather: float = 0.0


def gradient_predivide_factor(world: int) -> int:
    """FSDP's gradient pre-divide factor for a reduce-scatter over `world` ranks: the gradients are divided
    by it before the collective and by `world / factor` after it, so that neither the sum nor the
    pieces overflow in low precision (torch's `DefaultState._get_gradient_predivide_factor`)."""
    factor = 1
    while world % factor == 0 and world / factor > factor:
        factor *= 2
    return factor


def flat_copy_bytes(params: float, world: int, plan: ParallelPlan) -> UnitCopyBytes:
    """Bytes PyTorch FSDP1 (torch 2.1, `use_orig_params`) moves per micro-batch for the gradients of a unit
    of `params` parameters (unsharded, on one device) reduce-scattered over `world` ranks, beyond the
    weight-gradient GEMMs and the collective (`torch/distributed/fsdp/_runtime_utils.py`,
    `_post_backward_hook` and `_reduce_grad`):

    - compute stream: the original parameters are views (`torch.split`) of the unit's flat parameter, so
      autograd's split backward concatenates their `dtype` gradients into a new flat gradient (read, write);
    - post-backward stream, before the reduce-scatter: the flat gradient cast to the reduce dtype
      (`grad_dtype`; read `dtype`, write `grad_dtype`) when it differs, and divided in place by the
      pre-divide factor when that is above 1;
    - after it, on the `1/world` shard: the post-divide (when `world / factor` is above 1) and the sum into
      the shard accumulated over the step's micro-batches (read both, write one; the first micro-batch
      only keeps its shard), averaged over the micro-batches. Charged before the reduce-scatter too: the
      post-backward stream runs one unit's work after another, so it delays the next unit's."""
    e, g = DTYPE_BYTES[plan.dtype], DTYPE_BYTES[plan.grad_precision]
    factor, shard, n = gradient_predivide_factor(world), params / world, plan.micro_batches
    passes = (  # (bytes, whether the pass runs) in the order the post-backward stream runs them
        ((e + g) * params, plan.grad_precision != plan.dtype),
        (2 * g * params, factor > 1),
        (2 * g * shard, world / factor > 1),
        (3 * g * shard * (n - 1) / n, n > 1),
    )
    return UnitCopyBytes(
        compute=2 * e * params,
        reduce=sum(nbytes for nbytes, runs in passes if runs),
        reduce_kernels=sum(runs for _, runs in passes),
    )


def copy_in_out_bytes(params: float, world: int, plan: ParallelPlan) -> UnitCopyBytes:
    """Bytes PyTorch FSDP2 (`fully_shard`, torch 2.4: torchtitan's runs) moves per micro-batch for a unit of
    `params` parameters (unsharded, on one device) sharded over `world` ranks, beyond the GEMMs and the
    collectives (`torch/distributed/_composable/fsdp/_fsdp_collectives.py`):

    - gather, on the compute stream after each all-gather (`foreach_all_gather_copy_out`): every parameter
      is a tensor of its own, sharded on dim 0, so `split_with_sizes_copy` copies the `dtype` all-gather
      output into the unsharded parameters (read, write);
    - compute, after the unit's backward (`foreach_reduce_scatter_copy_in`): the `dtype` gradients are
      copied into the reduce-scatter input, cast to the reduce dtype (`grad_dtype`) by the same kernel
      (read `dtype`, write `grad_dtype`), and pre-divided there only in fp16 (fp32 and bf16 divide inside
      NCCL's `ReduceOp.AVG`); until June 2024 (pytorch#129721) this ran on the reduce-scatter stream, but
      the compute stream waits for it (`current_stream.wait_event(copy_in_event)`), so it is charged there;
    - reduce, on the `1/world` shard after the collective: the post-divide (fp16), the cast to the fp32
      sharded parameter's dtype when the reduce dtype differs, and the sum into the gradient accumulated
      over the step's micro-batches (read both, write one; the first micro-batch only keeps its shard),
      averaged over the micro-batches; charged before the reduce-scatter, as `flat_copy_bytes` does, since
      the reduce-scatter stream runs one unit's work after another."""
    e, g, master = DTYPE_BYTES[plan.dtype], DTYPE_BYTES[plan.grad_precision], DTYPE_BYTES["fp32"]
    divides = plan.grad_precision == "fp16"
    factor, shard, n = gradient_predivide_factor(world), params / world, plan.micro_batches
    passes = (  # on the shard, in the order the reduce-scatter stream runs them
        (2 * g * shard, divides and world / factor > 1),
        ((g + master) * shard, plan.grad_precision != "fp32"),
        (3 * master * shard * (n - 1) / n, n > 1),
    )
    predivide = 2 * g * params if divides and factor > 1 else 0.0
    return UnitCopyBytes(
        gather=2 * e * params,
        compute=(e + g) * params + predivide,
        reduce=sum(nbytes for nbytes, runs in passes if runs),
        reduce_kernels=sum(runs for _, runs in passes),
    )


def unit_copy_bytes(params: float, world: int, plan: ParallelPlan) -> UnitCopyBytes:
    """The per-unit copies of `plan.grad_accumulation`'s system: FSDP1's flat gradient ("flat_copy",
    `flat_copy_bytes`), FSDP2's copy-in and copy-out ("copy_in_out", `copy_in_out_bytes`); none otherwise."""
    if plan.grad_accumulation == "flat_copy":
        return flat_copy_bytes(params, world, plan)
    if plan.grad_accumulation == "copy_in_out":
        return copy_in_out_bytes(params, world, plan)
    return UnitCopyBytes(compute=0.0, reduce=0.0, reduce_kernels=0)
