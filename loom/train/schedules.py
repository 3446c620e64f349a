"""Learning-rate schedules as multipliers of the base rate (for `torch.optim.lr_scheduler.LambdaLR`)."""

from __future__ import annotations

import math
from collections.abc import Callable

KINDS = ("cosine", "linear", "constant")


def lr_multiplier(kind: str, warmup: int, total: int, min_ratio: float = 0.0) -> Callable[[int], float]:
    """Linear warm-up over `warmup` steps, then `kind` decay to `min_ratio` of the base rate at `total`."""
    if kind not in KINDS:
        raise ValueError(f"train.schedule = {kind!r}; choose one of {KINDS}")
    if warmup < 0 or total < 1 or not 0 <= min_ratio <= 1:
        raise ValueError(f"warmup {warmup} >= 0, total {total} >= 1 and min_ratio {min_ratio} in [0, 1]")

    def multiplier(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if kind == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        shape = 0.5 * (1 + math.cos(math.pi * progress)) if kind == "cosine" else 1 - progress
        return min_ratio + (1 - min_ratio) * shape

    return multiplier
