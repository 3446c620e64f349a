"""The cost model: hardware, collectives, compute and memory, in pure Python (dataclasses in, numbers out).

The planner ranks plans with it, the simulator (`loom.sim`) reports with it, `loom bench` calibrates it.
"""

from loom.cost.collectives import GroupSpan, bus_factor, collective_time, group_span
from loom.cost.compute import matmul_efficiency, matmul_time, memory_time
from loom.cost.hardware import PROFILES, Cluster, Device, Link, get_cluster, save_cluster
from loom.cost.memory import (
    korthikanti_activation_bytes,
    layer_activation_bytes,
    model_state_bytes,
    state_bytes,
)
from loom.cost.plan import ParallelPlan
from loom.cost.traffic import StepCollective, step_collectives
from loom.cost.transformer import TransformerConfig, hf_transformer_config

__all__ = [
    "PROFILES",
    "StepCollective",
    "Cluster",
    "Device",
    "GroupSpan",
    "Link",
    "ParallelPlan",
    "TransformerConfig",
    "bus_factor",
    "collective_time",
    "get_cluster",
    "group_span",
    "hf_transformer_config",
    "korthikanti_activation_bytes",
    "layer_activation_bytes",
    "matmul_efficiency",
    "matmul_time",
    "memory_time",
    "model_state_bytes",
    "state_bytes",
    "save_cluster",
    "step_collectives",
]
