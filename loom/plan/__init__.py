"""The Plan: one plain-data, JSON description of how a model trains on many devices (never executes).

The name lists are defined once, in `loom.cost.plan` (the lowest layer that needs them, since `cost/` and
`sim/` sit below `plan/`), and re-exported here for the layers above.
"""

from loom.cost.plan import (
    ATTENTIONS,
    OPTIMIZER_LEVELS,
    PRECISIONS,
    RECOMPUTE,
    SCHEDULE_VIRTUAL,
    SCHEDULES,
    SIMULATED_SCHEDULES,
    FieldError,
    default_schedule,
)
from loom.plan.plan import Plan
from loom.plan.specs import MESH_AXES

__all__ = [
    "ATTENTIONS",
    "MESH_AXES",
    "OPTIMIZER_LEVELS",
    "PRECISIONS",
    "RECOMPUTE",
    "SCHEDULES",
    "SCHEDULE_VIRTUAL",
    "SIMULATED_SCHEDULES",
    "FieldError",
    "Plan",
    "default_schedule",
]
