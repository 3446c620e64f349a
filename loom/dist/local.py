"""The part of a tensor this rank holds."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

__all__ = ["local_tensor"]


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of `tensor` for a DTensor (`to_local`), else `tensor` itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor
