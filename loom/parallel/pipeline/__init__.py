"""Pipeline parallelism: stages of any model with a sequence of blocks, as its recipe places them
(`loom.models.recipes`; loom's GPT among them), cut evenly, unevenly, by marks or balanced; named schedules
over torch.distributed.pipelining, per-rank timelines with the bubble fraction, and saved-activation memory
per stage."""

from loom.parallel.pipeline.blocks import (
    BlockStage,
    block_split,
    blocks_per_stage,
    model_pipeline,
    source_names,
    split_model,
    stage_parameters,
    tied_parameters,
    whole_model,
)
from loom.parallel.pipeline.gpt import (
    gpt_loss,
    gpt_pipeline,
    gpt_stage,
    gpt_stages,
    materialize_stages,
    rank_stages,
    split_gpt,
    whole_gpt,
)
from loom.parallel.pipeline.memory import SavedActivations
from loom.parallel.pipeline.reduction import stage_grad_sync
from loom.parallel.pipeline.schedule import (
    SCHEDULES,
    Pipeline,
    schedule_kind,
    stage_indices,
    validate_microbatches,
)
from loom.parallel.pipeline.stage import TimedStage
from loom.parallel.pipeline.stages import (
    assign_stages,
    balanced_partition,
    group_blocks,
    measured_costs,
    parameter_costs,
    pipeline_stage,
    stage_of_blocks,
)
from loom.parallel.pipeline.tied import Tied
from loom.parallel.pipeline.timeline import (
    Event,
    Recorder,
    bubble_fraction,
    plot_timeline,
    step_bubbles,
    theoretical_bubble,
)

__all__ = [
    "BlockStage",
    "block_split",
    "blocks_per_stage",
    "model_pipeline",
    "split_model",
    "tied_parameters",
    "whole_model",
    "stage_grad_sync",
    "SCHEDULES",
    "Event",
    "Pipeline",
    "Recorder",
    "SavedActivations",
    "Tied",
    "TimedStage",
    "assign_stages",
    "balanced_partition",
    "bubble_fraction",
    "gpt_loss",
    "gpt_pipeline",
    "gpt_stage",
    "gpt_stages",
    "group_blocks",
    "materialize_stages",
    "measured_costs",
    "parameter_costs",
    "pipeline_stage",
    "plot_timeline",
    "rank_stages",
    "schedule_kind",
    "source_names",
    "split_gpt",
    "stage_indices",
    "stage_of_blocks",
    "step_bubbles",
    "stage_parameters",
    "theoretical_bubble",
    "whole_gpt",
    "validate_microbatches",
]
