"""`[parallel] mode = "auto"`: the planner chooses the plan `loom train` runs.

The choice is the outer search's, the one `loom plan CONFIG.toml` makes (`loom.plan.outer.search_plans`):
mesh shape (dp, tp, pp; ep for experts), pipeline stages and schedule, micro-batches, optimizer level,
recompute policy and sequence parallelism for the config's model (`ModelConfig.transformer_config`, loom's
GPT or a Hugging Face model's shape) on the run's world size, each plan priced by loom's simulator on
`parallel.hardware` (a profile name or a `loom bench --out` file; default `AUTO_HARDWARE`) under
`parallel.memory_limit` bytes per device (default the profile's memory), in `train.precision`. The search
sees one accumulation step, `train.global_batch / train.grad_accum` sequences of `data.seq_len` tokens.

The run takes the fastest plan that loom train can run: candidates are tried best first against the
config's own rules (`TrainConfig.check_rules`: tensor-parallel cuts of the vocabulary, a Hugging Face
model's limits, the batch split), and the first that passes is adopted into `[parallel]`
(`ParallelConfig.adopt`); the faster ones skipped are kept with the reason. The choice depends only on the
config and the world size, so every rank of a torchrun job makes the same one.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

from loom.cost.hardware import get_cluster
from loom.cost.transformer import TransformerConfig
from loom.plan import Plan
from loom.plan.outer import Candidate, SearchResult, search_plans, to_plan
from loom.train.config import AUTO_HARDWARE, TrainConfig

__all__ = ["AutoPlan", "choose"]


@dataclass(frozen=True)
class AutoPlan:
    """The planner's choice for one run: the `plan` adopted, the `candidate` it came from, the whole
    `search` (as `loom plan` prints it), the `model` priced, and the faster candidates `skipped` because
    loom train cannot run them, each with the reason."""

    plan: Plan
    candidate: Candidate
    search: SearchResult
    model: TransformerConfig
    hardware: str
    skipped: list[tuple[Candidate, str]] = field(default_factory=list)


def choose(config: TrainConfig, world_size: int) -> AutoPlan:
    """The fastest plan of the outer search for `config` on `world_size` devices that the config's rules
    accept; a ValueError naming the keys when none does (nothing fits the memory limit, or every fitting
    plan breaks a rule of loom train)."""
    par, train = config.parallel, config.train
    if train.global_batch % train.grad_accum:
        raise ValueError(
            f"parallel.mode = 'auto' plans one accumulation step of train.global_batch / train.grad_accum "
            f"sequences: {train.global_batch} is not divisible by {train.grad_accum}; change one of them"
        )
    hardware = par.hardware or AUTO_HARDWARE
    try:
        cluster = get_cluster(hardware, gpus=world_size)
    except ValueError as error:
        raise ValueError(f"parallel.hardware = {hardware!r}: {error}") from None
    model = config.model.transformer_config()
    found = search_plans(
        model, cluster, world_size, train.global_batch // train.grad_accum, config.data.seq_len,
        memory_limit=par.memory_limit_bytes(), dtype=train.precision,
        context_pipelines=not config.model.is_hf,  # loom train cuts no HF model's sequences in pipelines
    )  # fmt: skip
    skipped = []
    for candidate in found.candidates:
        plan = to_plan(candidate)
        trial = copy.deepcopy(config)
        try:
            trial.parallel.adopt(plan, "the planner", replace=True)
            trial.check_rules(world_size)
        except ValueError as error:
            skipped.append((candidate, str(error)))
            continue
        return AutoPlan(plan, candidate, found, model, hardware, skipped)
    raise ValueError(_nothing_runs(found, skipped, world_size, hardware, par.memory_limit))


def _nothing_runs(
    found: SearchResult,
    skipped: list[tuple[Candidate, str]],
    world_size: int,
    hardware: str,
    limit: str | None,
) -> str:
    where = f"{world_size} x {hardware}" + (f" under parallel.memory_limit = {limit!r}" if limit else "")
    if not found.candidates:
        reasons = "; ".join(f"{i.region}: {i.reason}" for i in found.infeasible[:4])
        return (
            f"parallel.mode = 'auto': no plan of the model fits {where} ({reasons}); raise "
            "parallel.memory_limit, train.grad_accum or train.workers, or lower train.global_batch"
        )
    return (
        f"parallel.mode = 'auto': none of the {len(skipped)} plans that fit {where} runs in loom train "
        f"(the fastest: {skipped[0][1]}); set the [parallel] sizes by hand (parallel.mode = 'manual')"
    )
