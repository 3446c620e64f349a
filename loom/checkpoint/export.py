"""One checkpoint's model parameters as a single unsharded file that plain `torch.load` reads."""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

PREFIX = "model."


def read_model_tensors(checkpoint: str | Path) -> dict[str, torch.Tensor]:
    """Every model tensor of a checkpoint directory, whole (resharded from any mesh), on this process."""
    reader = FileSystemReader(Path(checkpoint) / "dcp")
    metadata = reader.read_metadata().state_dict_metadata
    tensors = {
        key.removeprefix(PREFIX): torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
        for key, meta in metadata.items()
        if key.startswith(PREFIX) and isinstance(meta, TensorStorageMetadata)
    }
    state = {"model": tensors}
    with warnings.catch_warnings():  # DCP's notice that it reads on one process: that is the intent here
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, storage_reader=reader, no_dist=True)
    return state["model"]


def export_model(checkpoint: str | Path, out: str | Path) -> int:
    """Write the model's parameters of `checkpoint` to `out` (a `torch.save` file: name -> tensor);
    returns the number of tensors. (safetensors export waits for safetensors in the dependencies.)"""
    tensors = read_model_tensors(checkpoint)
    torch.save(tensors, out)
    return len(tensors)
