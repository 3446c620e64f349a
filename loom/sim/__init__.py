"""The whole-step simulator: play a plan's pipeline schedule and communication on a modelled cluster."""

from loom.sim.presets import PRESETS, get_model, load_model_config
from loom.sim.simulator import PlanError, SimResult, check_plan, simulate

__all__ = ["PRESETS", "PlanError", "SimResult", "check_plan", "get_model", "load_model_config", "simulate"]
