"""Distributed checkpoints: save and resume training exactly, verified, resharded.

    ckpt = Checkpointer("runs/ckpt", every_steps=100, keep_last=3, data=batches, config=config)
    ckpt.resume(trainer)             # the newest intact checkpoint, if any (before the first step)
    ... trainer.train_step(...); ckpt.maybe_save(trainer)
    ckpt.wait()                      # async_save=True writes in the background: finish the last save

Every rank writes what it holds (at optimizer levels 1-3 its own chunks) and checksums it as it writes;
loading shares the checks among the ranks and reads straight into place (see docs/checkpoints.md).

Model parameters and optimizer states reshard on load: a checkpoint of any optimizer level (0-3) loads at
any level, on any mesh or on one process (random generators are restored as saved on as many processes as
saved them; on any other mesh a `Trainer(seed=...)` derives them per step and rank, see `loom.dist.rng`).
`export_model` writes one checkpoint's model as a single safetensors (or torch.save) file; `import_model`
turns such a file into a weights-only checkpoint. `export_hf` writes the run of a Hugging Face model as a
directory that `from_pretrained` loads.
"""

from loom.checkpoint.checkpointer import load_checkpoint, load_from, load_model_weights, save_checkpoint
from loom.checkpoint.export import (
    config_path,
    export_hf,
    export_model,
    import_model,
    read_model_tensors,
    save_safetensors,
)
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
    "config_path",
    "export_hf",
    "export_model",
    "import_model",
    "latest_valid",
    "list_step_dirs",
    "load_checkpoint",
    "load_from",
    "load_model_weights",
    "read_manifest",
    "read_model_tensors",
    "save_checkpoint",
    "save_safetensors",
    "verify",
]
