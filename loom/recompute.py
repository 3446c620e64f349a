"""Activation recomputation: `loom.recompute(module, policy)` (MindSpore's `Cell.recompute()`).

- "full": the module keeps only its inputs; backward runs its forward again.
- "selective": keeps the outputs of matrix multiplications and recomputes the cheap element-wise work and
  the attention scores' softmax around them (Korthikanti et al.'s selective recomputation, by operator).
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from loom.plan import RECOMPUTE as POLICIES

_SAVED = {
    torch.ops.aten.mm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.matmul.default,
}


def _keep_matmuls(ctx, op, *args, **kwargs) -> CheckpointPolicy:  # noqa: ANN001
    return CheckpointPolicy.MUST_SAVE if op in _SAVED else CheckpointPolicy.PREFER_RECOMPUTE


def recompute(module: nn.Module, policy: str = "full") -> nn.Module:
    """Make `module` recompute its activations in backward (in place; returns it).

    The module's class is swapped for a subclass whose forward runs under activation checkpointing, so the
    module stays what it was for everything else (state dict, deep copies, isinstance).
    """
    if policy not in POLICIES:
        raise ValueError(f"recompute policy {policy!r}; choose one of {POLICIES}")
    if policy == "none":
        return module
    module.loom_recompute = policy
    if not getattr(type(module), "_loom_recomputes", False):
        module.__class__ = _recomputing(type(module))
    return module


@functools.cache
def _recomputing(cls: type[nn.Module]) -> type[nn.Module]:
    def forward(self, *args, **kwargs):
        extra = {}
        if self.loom_recompute == "selective":
            extra["context_fn"] = functools.partial(create_selective_checkpoint_contexts, _keep_matmuls)
        return checkpoint(super(subclass, self).forward, *args, use_reentrant=False, **kwargs, **extra)

    subclass = type(f"Recomputed{cls.__name__}", (cls,), {"forward": forward, "_loom_recomputes": True})
    return subclass
