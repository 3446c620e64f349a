"""Activation recomputation: `loom.recompute(module, policy)` (MindSpore's `Cell.recompute()`).

- "full": the module keeps only its inputs; backward runs its forward again.
- "selective": keeps the outputs of matrix multiplications and recomputes the cheap element-wise work and
  the attention scores' softmax around them (Korthikanti et al.'s selective recomputation, by operator).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from contextlib import AbstractContextManager, nullcontext

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from loom.parallel.lift import LiftPlainTensors, lifting
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


def _contexts(selective: bool) -> tuple[AbstractContextManager, AbstractContextManager]:
    """The contexts of the forward and of its recomputation in backward (checkpoint's `context_fn`, called
    as the forward starts): the selective policy's, and the lifting of plain tensors inside a semi_auto
    model's forward (`loom.parallel.lift`), which backward must run under again."""
    forward, again = (
        create_selective_checkpoint_contexts(_keep_matmuls) if selective else (nullcontext(), nullcontext())
    )
    if not lifting():
        return forward, again
    return forward, _both(LiftPlainTensors(), again)


@contextlib.contextmanager
def _both(outer: AbstractContextManager, inner: AbstractContextManager) -> Iterator[None]:
    with outer, inner:
        yield


@functools.cache
def _recomputing(cls: type[nn.Module]) -> type[nn.Module]:
    def forward(self, *args, **kwargs):
        context_fn = functools.partial(_contexts, self.loom_recompute == "selective")
        return checkpoint(
            super(subclass, self).forward, *args, use_reentrant=False, context_fn=context_fn, **kwargs
        )

    subclass = type(f"Recomputed{cls.__name__}", (cls,), {"forward": forward, "_loom_recomputes": True})
    return subclass
