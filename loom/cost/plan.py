"""`ParallelPlan`: the plain-data description of how a model is trained (what the cost model prices).

Rank order is Megatron's: tp innermost, then dp (with ep carved out of dp, innermost there), then pp. A
later planner (`loom/plan/`) produces these; nothing here executes anything.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

__all__ = ["RECOMPUTE", "SCHEDULES", "ParallelPlan"]

RECOMPUTE = ("none", "selective", "full")
SCHEDULES = ("1f1b", "interleaved", "gpipe")


@dataclass(frozen=True, kw_only=True)
class ParallelPlan:
    """Parallel degrees per axis, batch shape, memory policies and pipeline schedule of one training run.

    `interleave` is the number of model chunks (virtual stages) per pipeline stage; `schedule` defaults to
    "interleaved" when it is above 1 and "1f1b" otherwise. `optimizer_level` is 0-3 (MindSpore / ZeRO).
    """

    dp: int = 1
    tp: int = 1
    pp: int = 1
    interleave: int = 1
    ep: int = 1
    micro_batch: int = 1
    global_batch: int
    seq: int
    recompute: str = "none"
    sequence_parallel: bool = False
    optimizer_level: int = 0
    schedule: str | None = None
    overlap_grad_sync: bool = True
    flash_attention: bool = False  # fused attention: no s x s tensors stored or moved
    dtype: str = "bf16"

    def __post_init__(self) -> None:
        for name in ("dp", "tp", "pp", "interleave", "ep", "micro_batch", "global_batch", "seq"):
            if getattr(self, name) < 1:
                raise ValueError(f"ParallelPlan: {name} must be >= 1, got {getattr(self, name)}")
        if self.recompute not in RECOMPUTE:
            raise ValueError(f"ParallelPlan: recompute must be one of {RECOMPUTE}, got {self.recompute!r}")
        if self.optimizer_level not in (0, 1, 2, 3):
            raise ValueError(
                f"ParallelPlan: optimizer_level must be 0, 1, 2 or 3, got {self.optimizer_level}"
            )
        if self.schedule is None:
            object.__setattr__(self, "schedule", "interleaved" if self.interleave > 1 else "1f1b")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"ParallelPlan: schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        if self.interleave > 1 and self.schedule != "interleaved":
            raise ValueError(f"ParallelPlan: interleave={self.interleave} needs schedule='interleaved'")
        if self.global_batch % (self.dp * self.micro_batch):
            raise ValueError(
                f"ParallelPlan: global batch {self.global_batch} is not a multiple of dp*micro_batch "
                f"= {self.dp}*{self.micro_batch}; change --global-batch or --micro-batch"
            )
        if self.dp % self.ep:
            raise ValueError(
                f"ParallelPlan: ep={self.ep} must divide dp={self.dp} (experts shard the data-parallel axis)"
            )

    @property
    def devices(self) -> int:
        """Devices the plan uses: dp * tp * pp (ep lives inside dp)."""
        return self.dp * self.tp * self.pp

    @property
    def micro_batches(self) -> int:
        """Micro-batches per data-parallel replica per iteration."""
        return self.global_batch // (self.dp * self.micro_batch)

    @property
    def virtual_stages(self) -> int:
        """Pipeline stages times chunks per stage."""
        return self.pp * self.interleave

    def replace(self, **changes) -> ParallelPlan:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        """Plain data for JSON."""
        return dataclasses.asdict(self)
