"""Running an unmodified model on DTensors: tensors it creates inside `forward` are lifted, and attention
runs on local shards.

A semi_auto model's inputs and parameters are DTensors, but the model's own code also makes plain tensors
(position ids from `torch.arange`, causal masks, rotary tables, constants). DTensor refuses an operator that
mixes the two ("got mixed torch.Tensor and DTensor"). `LiftPlainTensors`, a torch function mode active
during the model's forward, turns such a plain tensor into a replicated DTensor on the mesh of the DTensors
it meets, which is what it is: every rank creates the same tensor from the same global shapes. The first
forward's consistency check fingerprints each lifted tensor, so one that differs between ranks (drawn from
an unseeded generator, say) is named rather than silently averaged.

Some operators have no DTensor sharding rule on every device (CPU flash attention has none) or fail on a
cut batch (cross entropy's target checks), so they run as local regions: `F.scaled_dot_product_attention`
is computed on each rank's shards when the batch or the heads are cut, after any other cut (the sequence,
a pending sum) is gathered, and its output keeps the query's placements; `F.cross_entropy` sums each
rank's rows and reduces the sum (and the count of targets, for a mean) once; the fused losses whose DTensor
backward is wrong on a cut batch (`ELEMENTWISE_LOSSES`: mean squared error, smooth L1, Huber, soft margin,
binary cross entropy) run element by element and are reduced afterwards. Gradients flow through
`to_local`/`from_local`, which are differentiable.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from contextvars import ContextVar, Token
from typing import Any

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard
from torch.nn import _reduction as _Reduction
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map

from loom.dist import consistency, torch_compat
from loom.layout.placements import cuts_classes, pending_over_rows, row_placements
from loom.parallel.local_region import contiguous_strides

__all__ = [
    "ELEMENTWISE_LOSSES",
    "LiftPlainTensors",
    "attention_on_local_shards",
    "lifting",
    "local_attention",
    "local_cross_entropy",
    "reduced_after_elementwise",
]


def _is_plain(x: object) -> bool:
    return isinstance(x, torch.Tensor) and not isinstance(x, DTensor)


def _leaves(items: Any) -> list:
    """The leaves of a torch function's arguments: tensors, scalars and whatever else sits in their lists,
    tuples and dicts. The mode sees every torch call of a forward, and this walk costs a tenth of
    `tree_flatten`'s (torch functions take no other containers)."""
    found = []
    for item in items:
        if isinstance(item, list | tuple):  # namedtuples too (torch.Size holds ints only)
            found.extend(_leaves(item))
        elif isinstance(item, dict):
            found.extend(_leaves(item.values()))
        else:
            found.append(item)
    return found


def replicated(x: torch.Tensor, like: DTensor) -> DTensor:
    """`x`, the same on every rank, as a replicated DTensor on `like`'s mesh."""
    mesh = like.device_mesh
    return DTensor.from_local(x, mesh, [Replicate()] * mesh.ndim, run_check=False)


def local_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    *args: Any,
    **kwargs: Any,
) -> torch.Tensor:
    """`F.scaled_dot_product_attention` on DTensors (..., seq, dim), run on local shards.

    Per mesh dim the query keeps a cut of a leading dim (the batch, the heads: every dim but the last two),
    which attention computes independently; any other placement (a cut sequence or head dim, a pending sum)
    is gathered first. Key and value take the query's placements (with grouped-query attention, a cut of the heads
    keeps each query head with its key/value head when the cut divides the key/value heads). A mask is cut
    alike where it is not broadcast.
    """
    if len(args) > len(_SDPA_AFTER_MASK):
        raise TypeError(
            f"scaled_dot_product_attention takes at most {4 + len(_SDPA_AFTER_MASK)} positional arguments"
        )
    kwargs = {
        **dict(zip(_SDPA_AFTER_MASK, args, strict=False)),
        **kwargs,
    }  # sdpa's own names, as a positional call means them
    return attention_on_local_shards(
        F.scaled_dot_product_attention, query, key, value, attn_mask=attn_mask, **kwargs
    )


# `F.scaled_dot_product_attention`'s parameters after the mask, in order
_SDPA_AFTER_MASK = ("dropout_p", "is_causal", "scale", "enable_gqa")


def attention_on_local_shards(
    attend: Callable[..., torch.Tensor],
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *args: Any,
    attn_mask: torch.Tensor | None = None,
    **kwargs: Any,
) -> torch.Tensor:
    """`attend(query, key, value, *args, **kwargs)` (an attention over (..., seq, dim)) on DTensors' local
    shards, laid out as `local_attention` says; the output is a DTensor with the query's kept placements.

    `attend` may itself communicate (context-parallel attention over a process group of its own): each rank
    hands it the rows and heads it holds.
    """
    like = next(t for t in (query, key, value) if isinstance(t, DTensor))
    mesh = like.device_mesh
    placements = [_attention_placement(p, like.ndim) for p in like.placements]
    query, key, value = (_as_dtensor(t, like).redistribute(mesh, placements) for t in (query, key, value))
    _check_heads(query, key, placements)
    if isinstance(attn_mask, torch.Tensor):
        mask = _as_dtensor(attn_mask, like)
        kwargs["attn_mask"] = mask.redistribute(
            mesh, _mask_placements(placements, mask, query.ndim)
        ).to_local()
    out = attend(_LocalPiece.apply(query), _LocalPiece.apply(key), _LocalPiece.apply(value), *args, **kwargs)
    shape = (*query.shape[:-1], value.shape[-1])  # given: an uneven cut would misstate it
    return DTensor.from_local(
        out.contiguous(), mesh, placements, run_check=False, shape=shape, stride=contiguous_strides(shape)
    )


class _LocalPiece(torch.autograd.Function):
    """A DTensor's local piece, contiguous, whose gradient comes back as a DTensor with contiguous strides.

    `to_local` would hand back the gradient with the DTensor's own global strides (a transposed view's,
    for attention's (batch, heads, seq, dim) inputs) around a local gradient in another memory order (CPU
    attention's kernels produce (batch, seq, heads, dim) order); DTensor then derives views that do not fit
    the local tensors, and the backward of the model's reshapes fails."""

    @staticmethod
    def forward(ctx, x: DTensor) -> torch.Tensor:  # noqa: ANN001
        ctx.mesh, ctx.placements, ctx.shape = x.device_mesh, x.placements, x.shape
        return x.to_local().contiguous()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> DTensor:  # noqa: ANN001
        return DTensor.from_local(
            grad.contiguous(),
            ctx.mesh,
            ctx.placements,
            run_check=False,
            shape=ctx.shape,
            stride=contiguous_strides(ctx.shape),
        )


def _attention_placement(placement: Placement, ndim: int) -> Placement:
    """A cut of a leading dim (batch, heads) stays; a cut of the sequence or head dim, or a pending sum, is
    gathered (attention mixes the whole sequence)."""
    if isinstance(placement, Shard) and placement.dim < ndim - 2:
        return placement
    return Replicate()


def _as_dtensor(x: torch.Tensor, like: DTensor) -> DTensor:
    return x if isinstance(x, DTensor) else replicated(x, like)


def _check_heads(query: DTensor, key: DTensor, placements: list[Placement]) -> None:
    """With grouped-query attention each rank's query heads must meet their own key/value heads: the cut of
    the heads (dim -3 of 4-D inputs, over every mesh dim that cuts it) must divide the key/value heads."""
    if query.ndim < 4:
        return
    heads = query.ndim - 3
    size = math.prod(
        query.device_mesh.size(d) for d, p in enumerate(placements) if isinstance(p, Shard) and p.dim == heads
    )
    if key.shape[heads] % size:
        raise ValueError(
            f"scaled_dot_product_attention: the heads are cut {size} ways, but the key/value tensors have "
            f"{key.shape[heads]} heads, which {size} does not divide; cut the heads by a divisor of the "
            f"key/value heads (or leave the attention projections replicated)"
        )


def _mask_placements(placements: list[Placement], mask: DTensor, ndim: int) -> list[Placement]:
    """The query's cuts on the mask dims that are not broadcast (the mask's dims align to the right)."""
    offset = ndim - mask.ndim
    result: list[Placement] = []
    for placement in placements:
        dim = placement.dim - offset if isinstance(placement, Shard) else -1
        result.append(Shard(dim) if dim >= 0 and mask.shape[dim] > 1 else Replicate())
    return result


def local_cross_entropy(
    input: torch.Tensor,  # noqa: A002  (F.cross_entropy's own name)
    target: torch.Tensor,
    weight: torch.Tensor | None = None,
    size_average: bool | None = None,
    ignore_index: int = -100,
    reduce: bool | None = None,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
) -> torch.Tensor:
    """`F.cross_entropy` on DTensors. Logits (rows, classes) whose classes are cut (a vocabulary-parallel
    head) take `vocab_parallel_cross_entropy`. Otherwise it runs on each rank's rows: rows cut along mesh
    dims stay cut, any other cut is gathered. Each rank sums its rows' losses; `"sum"` is then a
    pending sum over the row-cutting mesh dims; for `"mean"` each rank first divides its sum by the global
    count of targets that are not `ignore_index` (weighted by `weight`, as torch does; one all-reduce)."""
    if size_average is not None or reduce is not None:
        reduction = torch.nn._reduction.legacy_get_string(size_average, reduce)
    if _cuts_classes(input) and weight is None and not label_smoothing:
        return vocab_parallel_cross_entropy(input, _as_dtensor(target, input), ignore_index, reduction)
    like = next(t for t in (input, target) if isinstance(t, DTensor))
    mesh = like.device_mesh
    placements = row_placements(like.placements)
    logits, labels = (_as_dtensor(t, like).redistribute(mesh, placements).to_local() for t in (input, target))
    weights = None if weight is None else _as_dtensor(weight, like).full_tensor()
    options = {"weight": weights, "ignore_index": ignore_index, "label_smoothing": label_smoothing}
    if reduction == "none":
        losses = F.cross_entropy(logits, labels, reduction="none", **options)
        shape = tuple(target.shape)
        return DTensor.from_local(
            losses, mesh, placements, run_check=False, shape=shape, stride=contiguous_strides(shape)
        )
    pending = pending_over_rows(placements)
    total = F.cross_entropy(logits, labels, reduction="sum", **options)
    if reduction == "mean":
        kept = (labels != ignore_index).to(torch.float32)  # counted in fp32: bf16 rounds counts above 256
        if weights is not None:
            kept = kept * weights[torch.where(labels == ignore_index, 0, labels)].float()
        total = total / DTensor.from_local(kept.sum(), mesh, pending).full_tensor()
    return DTensor.from_local(total, mesh, pending, run_check=False)


def _cuts_classes(logits: torch.Tensor) -> bool:
    """Logits (rows, classes) with the classes cut evenly (an uneven cut is gathered instead)."""
    if not isinstance(logits, DTensor) or logits.ndim != 2:
        return False
    return cuts_classes(logits.placements, logits.shape[1], logits.device_mesh.shape)


def vocab_parallel_cross_entropy(
    logits: DTensor, labels: DTensor, ignore_index: int = -100, reduction: str = "mean"
) -> DTensor:
    """Cross entropy of logits (rows, vocab) whose vocabulary is cut across ranks, without gathering them
    (Megatron's vocabulary-parallel cross entropy, in DTensor operations): each rank works on its slice of
    the vocabulary, and only per-row numbers are reduced (the max, the sum of exponentials, the target's
    logit). The target's logit is found by comparing the labels with the vocabulary ids, cut as the logits
    are, so no rank builds a (rows, vocab) tensor larger than its slice."""
    mesh = logits.device_mesh
    cuts = [Shard(0) if isinstance(p, Shard) and p.dim == 1 else Replicate() for p in logits.placements]
    vocab = DTensor.from_local(_vocab_ids(logits.shape[1], mesh, cuts), mesh, cuts, run_check=False)
    # Each per-row number is summed over the vocabulary cut right away (Megatron's all-reduces): left
    # pending, DTensor reduce-scatters it over the rows instead, and the rows stay cut along the vocabulary
    # axis through the whole backward pass (a reduce-scatter and an all-gather where one all-reduce does).
    rows = row_placements(logits.placements)
    valid = labels != ignore_index
    shift = logits.detach().amax(dim=1, keepdim=True).redistribute(mesh, rows)
    sum_exp = torch.exp(logits - shift).sum(dim=1).redistribute(mesh, rows)
    log_sum_exp = torch.log(sum_exp) + shift.squeeze(1)
    picked = (logits * (labels.unsqueeze(1) == vocab).to(logits.dtype)).sum(dim=1).redistribute(mesh, rows)
    losses = (log_sum_exp - picked) * valid.to(logits.dtype)
    if reduction == "none":
        return losses
    total = losses.sum()
    if reduction == "sum":
        return total
    # the count whole on every rank: a pending count would be summed again by the division's backward
    count = valid.to(torch.float32).sum().redistribute(mesh, [Replicate()] * mesh.ndim)
    return total / count


def _vocab_ids(size: int, mesh: Any, cuts: list[Placement]) -> torch.Tensor:
    """This rank's slice of `arange(size)` under `cuts` (one Shard(0) or Replicate per mesh dim)."""
    start, length = 0, size
    for mesh_dim, placement in enumerate(cuts):
        if isinstance(placement, Shard):
            parts = mesh.size(mesh_dim)
            length //= parts
            start += mesh.get_local_rank(mesh_dim) * length
    return torch.arange(start, start + length, device=mesh.device_type)


def reduced_after_elementwise(loss: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """`loss` (one of `ELEMENTWISE_LOSSES`) on DTensors computed element by element (reduction "none") and
    then reduced by DTensor's own mean or sum. DTensor's rules for these fused losses (torch 2.13) give the
    right value on rows cut over n ranks but n times the gradient: the backward of each rank's local mean is
    summed over the ranks. Reducing the elementwise losses afterwards gives one device's gradients."""
    signature = inspect.signature(loss)

    def run(*args: Any, **kwargs: Any) -> torch.Tensor:
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        given = bound.arguments
        if loss is F.mse_loss and given.get("weight") is not None:
            return loss(*args, **kwargs)  # weighted, it runs as plain operators, whose rules are right
        reduction = given["reduction"]
        if given.get("size_average") is not None or given.get("reduce") is not None:
            reduction = _Reduction.legacy_get_string(given["size_average"], given["reduce"])
            given["size_average"] = given["reduce"] = None
        how = _Reduction.get_enum(reduction)  # refuses an unknown reduction, as the loss itself does
        given["reduction"] = "none"
        each = loss(*bound.args, **bound.kwargs)
        return each if how == 0 else each.mean() if how == 1 else each.sum()

    return run


# fused losses whose DTensor backward is wrong on a cut batch (`reduced_after_elementwise`)
ELEMENTWISE_LOSSES = (F.mse_loss, F.smooth_l1_loss, F.huber_loss, F.soft_margin_loss, F.binary_cross_entropy)

# the local regions that take plain tensors as they come (the others meet them lifted, as any operator does)
TAKE_PLAIN_TENSORS = (F.scaled_dot_product_attention, F.cross_entropy)

LOCAL_REGIONS: dict[Callable[..., Any], Callable[..., Any]] = {
    F.scaled_dot_product_attention: local_attention,
    F.cross_entropy: local_cross_entropy,
    **{loss: reduced_after_elementwise(loss) for loss in ELEMENTWISE_LOSSES},
    **torch_compat.local_regions(),  # torch 2.11's F.pad rule (loom.dist.torch_compat)
}


_active: ContextVar[LiftPlainTensors | None] = ContextVar("loom_lift_plain_tensors", default=None)


def lifting() -> bool:
    """Whether plain tensors are being lifted here (inside a semi_auto model's forward). Recomputation
    checks this during forward, to lift again when backward runs the forward a second time."""
    return _active.get() is not None


class LiftPlainTensors(TorchFunctionMode):
    """Active during a semi_auto model's forward: a plain tensor passed to a torch function together with a
    DTensor becomes a replicated DTensor; operators in `LOCAL_REGIONS` run on local shards. With `scope`
    collecting (the first forward), every lifted tensor is fingerprinted for the ranks' agreement."""

    def __init__(self, scope: consistency.Scope | None = None) -> None:
        super().__init__()
        self.scope = scope
        self._tokens: list[Token] = []

    def __enter__(self) -> LiftPlainTensors:
        self._tokens.append(_active.set(self))
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        try:
            super().__exit__(*exc)
        finally:
            _active.reset(self._tokens.pop())

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        flat = _leaves((args, kwargs))
        like = next((x for x in flat if isinstance(x, DTensor)), None)
        if like is None:
            return func(*args, **kwargs)
        if func not in TAKE_PLAIN_TENSORS and any(_is_plain(x) and x.ndim for x in flat):
            args, kwargs = tree_map(lambda x: self._lift(x, like, func), (args, kwargs))
        return LOCAL_REGIONS.get(func, func)(*args, **kwargs)

    def _lift(self, x: Any, like: DTensor, func: Callable[..., Any]) -> Any:
        if not _is_plain(x) or not x.ndim:
            return x  # DTensor takes plain scalars (0-dim tensors) itself
        if self.scope is not None and self.scope.collect and consistency.checkable([x]):
            name = getattr(func, "__name__", str(func))
            self.scope.claims.append(
                consistency.tensor_claim(
                    f"a tensor the model created in forward, shape {tuple(x.shape)}, first used by {name}",
                    x,
                    consistency.REPLICATED_FIX,
                )
            )
        return replicated(x, like)
