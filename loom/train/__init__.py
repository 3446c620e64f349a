"""The training engine: `Trainer` (a model or pipeline stages), mixed precision, gradient arithmetic, learning-rate schedules."""

from loom.train.metrics import Callback, LossMonitor, MetricsCallback, MetricsLogger, StepMetrics
from loom.train.precision import DynamicLossScaler, autocast
from loom.train.schedules import lr_multiplier
from loom.train.trainer import Trainer

__all__ = [
    "Callback",
    "DynamicLossScaler",
    "LossMonitor",
    "MetricsCallback",
    "MetricsLogger",
    "StepMetrics",
    "Trainer",
    "autocast",
    "lr_multiplier",
]
