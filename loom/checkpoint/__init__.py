"""Distributed checkpoints: save and resume training exactly, verified, resharded where supported.

    ckpt = Checkpointer("runs/ckpt", every_steps=100, keep_last=3, data=batches, config=config)
    ckpt.resume(trainer)             # the newest intact checkpoint, if any (before the first step)
    ... trainer.train_step(...); ckpt.maybe_save(trainer)

Model parameters and level-0 optimizer states reshard on load (any mesh, or one process); optimizer
states of levels 1-3 load only on the mesh they were saved on.
"""

from loom.checkpoint.checkpointer import load_checkpoint, load_from, load_model_weights, save_checkpoint
from loom.checkpoint.export import export_model, read_model_tensors
from loom.checkpoint.manifest import (
    CheckpointError,
    CheckpointWarning,
    latest_valid,
    list_step_dirs,
    read_manifest,
    verify,
)
from loom.checkpoint.periodic import Checkpointer

__all__ = [
    "CheckpointError",
    "CheckpointWarning",
    "Checkpointer",
    "export_model",
    "latest_valid",
    "list_step_dirs",
    "load_checkpoint",
    "load_from",
    "load_model_weights",
    "read_manifest",
    "read_model_tensors",
    "save_checkpoint",
    "verify",
]
