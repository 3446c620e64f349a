"""Where and how a run computes: its device (`[train] device`), the optimizer's kernels, compiled blocks.

`device_setting` is the device a run of `loom train` asks for, after the rules of the parts that run on the
CPU only so far (pipelines, replicas that step alone); `loom.dist.env.resolve_device` turns it into this
rank's device and `loom.dist.env.backend_for` into the process group's backend, so that the launcher and
the job agree. On a GPU the optimizer runs torch's fused kernels (one kernel for every parameter, and the
Trainer's non-finite skip on the device, with no host synchronisation); on a CPU the foreach ones.
`compile_blocks` compiles each transformer block in place (parameter names unchanged: checkpoints load
either way).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from loom.models.recipes import find_blocks

__all__ = ["compile_blocks", "device_setting", "model_device", "optimizer_kernels"]


def device_setting(config: Any) -> str:
    """`train.device` as a run of `config` (a `TrainConfig`) may use it: pipelines (`parallel.pp > 1`) and
    replicas that step alone or come and go build their parts on the CPU so far, so "auto" means "cpu" for
    them and "cuda" is refused, naming the keys."""
    setting, par = config.train.device, config.parallel
    cpu_only = [
        name
        for name, applies in (
            (f"parallel.pp = {par.pp}", par.pp > 1),
            (f"parallel.sync = {par.sync!r}", par.replicas_step_alone),
            ("fault.elastic_replicas = true", config.fault.elastic_replicas),
        )
        if applies
    ]
    if not cpu_only:
        return setting
    if setting == "cuda":
        raise ValueError(
            f"train.device = 'cuda' with {', '.join(cpu_only)}: that part of loom runs on the CPU only so far; "
            "set train.device = 'cpu' (or 'auto'), or leave it out"
        )
    return "cpu"


def model_device(model: nn.Module) -> torch.device:
    """Where `model` computes: the device of its parameters (a DTensor's: its local shard's), the CPU when
    it has none."""
    return next((param.device for param in model.parameters()), torch.device("cpu"))


def optimizer_kernels(device: torch.device) -> dict[str, bool]:
    """The torch optimizer option for `device`'s kernels: fused on a GPU, foreach on a CPU."""
    return {"fused": True} if device.type == "cuda" else {"foreach": True}


def compile_blocks(model: nn.Module, blocks: list[nn.Module] | None = None) -> int:
    """Compile each of `model`'s transformer blocks with `torch.compile`, in place (`nn.Module.compile`:
    the module and its parameter names stay, so hooks, recomputation wrappers and checkpoints see the same
    model). `blocks`: the modules to compile (default: the model's block list, `find_blocks`). Returns how
    many were compiled."""
    if blocks is None:
        blocks = list(find_blocks(model)[1])
    for block in blocks:
        block.compile()
    return len(blocks)
