"""`Tied`: a parameter whose copies sit on several pipeline ranks."""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch import nn


@dataclass(frozen=True, kw_only=True)
class Tied:
    """A parameter that several pipeline ranks hold a copy of (a GPT's tied embedding: the lookup table on
    the first stage, the output head on the last). The copies start equal and stay equal, because their
    gradients are summed over the ranks that hold one (and averaged over their data-parallel replicas) by
    one collective on `group`, those ranks' process group. `param` is None on a pipeline rank without a copy
    (then `group` is None too); `holders` is how many pipeline ranks hold one."""

    param: nn.Parameter | None
    holders: int
    group: dist.ProcessGroup | None = None

    def __post_init__(self) -> None:
        if (self.param is None) != (self.group is None):
            raise ValueError(
                "a Tied parameter's holders have a group (the ranks holding a copy); others none"
            )
