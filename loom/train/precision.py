"""Mixed precision: autocast for the forward pass, fp32 master weights, dynamic loss scaling for fp16.

The parameters stay fp32 (the master weights); autocast runs matmuls in bf16/fp16. With fp16 the loss is
multiplied by a scale before backward so that small gradients survive; when any gradient on any rank is not
finite, every rank skips the update and the scale drops; after `growth_interval` good steps it grows again
(the all_finite / unscale / adjust flow of MindSpore's loss-scale cells and torch's GradScaler).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def autocast(precision: str, device_type: str = "cpu"):
    """The forward-pass context for `precision` ("fp32": none)."""
    if precision not in DTYPES:
        raise ValueError(f"precision {precision!r}; choose one of {sorted(DTYPES)}")
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device_type, dtype=DTYPES[precision])


@dataclass(kw_only=True)
class DynamicLossScaler:
    """Loss scale that halves on overflow and doubles after `growth_interval` finite steps."""

    scale: float = 2.0**16
    growth_interval: int = 2000
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    min_scale: float = 1.0
    good_steps: int = 0

    def __post_init__(self) -> None:
        if self.scale <= 0 or self.growth_interval < 1:
            raise ValueError(
                f"loss scale {self.scale} must be > 0 and growth_interval {self.growth_interval} >= 1"
            )

    def update(self, finite: bool) -> None:
        """After a step: back off on overflow, grow after enough good steps."""
        if not finite:
            self.scale = max(self.scale * self.backoff_factor, self.min_scale)
            self.good_steps = 0
            return
        self.good_steps += 1
        if self.good_steps >= self.growth_interval:
            self.scale *= self.growth_factor
            self.good_steps = 0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self.good_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale, self.good_steps = float(state["scale"]), int(state["good_steps"])
