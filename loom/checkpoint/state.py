"""What a checkpoint holds, taken from and given back to a `Trainer` (and its data loader).

- the model's parameters as DTensor state (saved with `torch.distributed.checkpoint`, resharded on load);
- at optimizer level 0, the torch optimizer's state keyed by parameter name (DTensors: resharded too);
- at levels 1-3, `ZeroOptimizer`'s inner optimizers, whose states live on this rank's bucket chunks: saved
  per rank with the bucket plan, and loaded only under the same plan (same mesh and model); resharding them
  is not supported yet (`CheckpointError` says so);
- shared scalars (step, learning-rate schedule, loss scaler, optimizer hyper-parameters, data position);
- per-rank random number generator states.
"""

from __future__ import annotations

import random
from typing import Any, Protocol

import numpy as np
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
from torch.distributed.tensor import DTensor

from loom.checkpoint.manifest import CheckpointError
from loom.parallel.zero import ZeroOptimizer


class Trainable(Protocol):
    """What a checkpoint reads from and writes to (a `loom.train.Trainer` is one; `train/` sits above
    `checkpoint/`, so this layer names only the attributes it uses)."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    lr_scheduler: Any
    scaler: Any
    step: int


def model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The parameters and persistent buffers (DTensors where the model is laid out on a mesh); at optimizer
    level 3 read it inside `model.loom.full_parameters()`."""
    return model.state_dict()


def optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any] | None:
    """Level 0: the optimizer state by parameter name, for DCP (None at levels 1-3: see `zero_state`)."""
    if isinstance(optimizer, ZeroOptimizer):
        return None
    return get_optimizer_state_dict(model, optimizer)


def load_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """Level 0: put back a state that `optimizer_state` gave (after DCP filled it in)."""
    set_optimizer_state_dict(model, optimizer, state)


def dcp_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The state saved (and loaded in place) by DCP: model, and the optimizer at level 0."""
    state: dict[str, Any] = {"model": model_state(model)}
    optim = optimizer_state(model, optimizer)
    if optim is not None:
        state["optim"] = optim
    return state


def hyper_parameters(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Each parameter group's settings (lr, betas, ...) without the parameters."""
    return [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]


def load_hyper_parameters(optimizer: torch.optim.Optimizer, groups: list[dict[str, Any]]) -> None:
    """Put back the settings of `hyper_parameters` (a schedule's current learning rate among them)."""
    if len(groups) != len(optimizer.param_groups):
        raise CheckpointError(
            f"the checkpoint has {len(groups)} parameter groups, this optimizer {len(optimizer.param_groups)}"
        )
    for group, saved in zip(optimizer.param_groups, groups, strict=True):
        group.update(saved)


# ---- optimizer levels 1-3: rank-local inner states --------------------------------------------------------


def bucket_plan(model: nn.Module, optimizer: ZeroOptimizer) -> list[dict[str, Any]]:
    """How the optimizer's chunks are cut: per bucket, its parameters (by name), offsets and group place."""
    names = {id(p): name for name, p in model.named_parameters()}
    return [
        {
            "params": [names[id(p)] for p in shard.bucket.params],
            "offsets": list(shard.bucket.offsets),
            "group_size": shard.bucket.group_size,
            "group_rank": shard.bucket.group_rank,
        }
        for shard in optimizer.shards
    ]


def zero_state(model: nn.Module, optimizer: ZeroOptimizer) -> dict[str, Any]:
    """This rank's inner optimizer states (plain tensors) and the bucket plan they belong to."""
    inner = [_localized(opt.state_dict()) for opt in optimizer.inner]
    return {"level": optimizer.level, "plan": bucket_plan(model, optimizer), "inner": inner}


def defer_zero_load(model: nn.Module, optimizer: ZeroOptimizer, saved: dict[str, Any]) -> None:
    """Load `saved` inner states when the optimizer builds them (at its first step, once the gradient
    buckets are known); the chunks themselves are rebuilt from the restored parameters, which equal them."""
    if optimizer.inner:
        raise CheckpointError(
            "load optimizer level 1-3 checkpoints before the first step (the optimizer has already built "
            "its sharded states)"
        )
    if saved["level"] != optimizer.level:
        raise CheckpointError(
            f"the checkpoint was saved at optimizer level {saved['level']}, this run uses {optimizer.level}; "
            "optimizer states of levels 1-3 cannot be converted yet"
        )

    def load() -> None:
        plan = bucket_plan(model, optimizer)
        if plan != saved["plan"] or len(saved["inner"]) != len(optimizer.inner):
            raise CheckpointError(
                "the optimizer's bucket chunks differ from the checkpoint's (another mesh, model or bucket "
                "size): resharding optimizer states of levels 1-3 is not supported yet; resume on the same "
                "mesh, or at optimizer level 0"
            )
        for inner, state in zip(optimizer.inner, saved["inner"], strict=True):
            inner.load_state_dict(state)
            _relocalize(inner)

    optimizer.on_build(load)


def _localized(value: Any) -> Any:
    """A state dict with DTensors replaced by their local tensors (picklable, rank-local)."""
    if isinstance(value, DTensor):
        return value.to_local()
    if isinstance(value, dict):
        return {k: _localized(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_localized(v) for v in value]
    return value


def _relocalize(optimizer: torch.optim.Optimizer) -> None:
    """States of DTensor parameters loaded as local tensors become DTensors laid out like the parameter."""
    for param, state in optimizer.state.items():
        if not isinstance(param, DTensor):
            continue
        for key, value in state.items():
            if (
                torch.is_tensor(value)
                and not isinstance(value, DTensor)
                and value.shape == param.to_local().shape
            ):
                state[key] = DTensor.from_local(
                    value, param.device_mesh, param.placements, shape=param.shape, stride=param.stride()
                )


# ---- random number generators ------------------------------------------------------------------------------


def rng_state() -> dict[str, Any]:
    """This process's generators: torch (CPU and every CUDA device), Python's `random`, NumPy's legacy one."""
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "python": [version, list(internal), gauss],
        "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached)],
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def load_rng_state(state: dict[str, Any]) -> None:
    """Put back what `rng_state` took."""
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
