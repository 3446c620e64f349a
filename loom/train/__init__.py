"""The training engine: `Trainer`, mixed precision, gradient arithmetic, learning-rate schedules."""

from loom.train.precision import DynamicLossScaler, autocast
from loom.train.schedules import lr_multiplier
from loom.train.trainer import StepResult, Trainer

__all__ = ["DynamicLossScaler", "StepResult", "Trainer", "autocast", "lr_multiplier"]
