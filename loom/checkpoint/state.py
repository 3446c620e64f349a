"""What a checkpoint holds, taken from and given back to a `Trainer` (and its data loader).

- the model's parameters as DTensor state (saved with `torch.distributed.checkpoint`, resharded on load);
  at optimizer level 3, once parameters live in the optimizer's chunks, each rank saves its chunks' pieces;
- the optimizer's state by parameter name, as `get_optimizer_state_dict` gives it for a plain torch optimizer
  ("state" -> {name: {"exp_avg": ..., "step": ...}}, "param_groups"), each state a tensor shaped like its
  parameter. At level 0 that is torch's own, laid out like the parameters. At levels 1-3 `ZeroOptimizer`'s
  inner states live on this rank's bucket chunks, and each rank saves exactly those: every parameter's
  elements in a chunk are boxes of the per-parameter tensor (see chunks.py), written by the rank that holds
  them, with no collective. DCP reshards at load: level 0 reads per-parameter tensors laid out like its
  parameters; levels 1-3 read their own chunks' boxes straight into the chunks, once the optimizer builds
  them (at the first step, when the gradient buckets are known). So a checkpoint of any level loads at any
  level, on any mesh or number of processes;
- with replicas that step alone (`loom.parallel.local_sgd`: `[parallel] sync = "local_sgd" | "diloco"`),
  each rank's own entry instead of the optimizer's states: its parameters, inner and outer states and global
  weights (`replica_state`; at optimizer levels 1-3 inside a replica its chunks' states, and at level 3 the
  model entry from the chunks as `chunked_parameters` gives it), restored on the same mesh;
- shared scalars (step, learning-rate schedule, loss scaler, optimizer hyper-parameters, data position);
- per-rank random number generator states.

Levels 1-3 convert elementwise optimizer states only (Adam, AdamW, SGD's momentum, ...: each state is shaped
like its parameter, or a scalar such as `step`).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch
from torch import nn
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
from torch.distributed.tensor import DTensor

from loom.checkpoint.chunks import Pieces, pieces_of
from loom.checkpoint.manifest import CheckpointError
from loom.checkpoint.memory import Arena
from loom.dist import env
from loom.dist.local import local_tensor
from loom.parallel.local_sgd import Replicated, stepping_optimizer
from loom.parallel.zero import BucketShard, ZeroOptimizer

# One parameter's optimizer state: {"exp_avg": tensor, "step": tensor, ...}.
ParamState = dict[str, Any]
# Reads a template state dict (nested; DTensors, tensors, `Pieces`) from the checkpoint being loaded, in place.
Reader = Callable[[dict[str, Any]], None]


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
    """The optimizer state by parameter name, for DCP: torch's own at level 0; at levels 1-3 the same
    structure with this rank's chunks of the states as `Pieces` (no collective); None at levels 1-3 before
    the first step (nothing built yet: a resumed run starts from fresh states, as this one would)."""
    if isinstance(optimizer, ZeroOptimizer):
        return zero_optimizer_state(model, optimizer)
    if isinstance(optimizer, Replicated):
        return replica_state(optimizer)
    return get_optimizer_state_dict(model, optimizer)


def dcp_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The state saved by DCP: model and optimizer, each rank's part as it holds it (no collective: at level
    3 the parameters that live in the optimizer's chunks are saved from them, as `Pieces`)."""
    model_part = model_state(model)
    chunked = chunked_parameters(model, optimizer)
    if chunked is not None:  # level 3: the bucketed parameters hold no memory; each rank saves its pieces
        model_part = {**{k: v for k, v in model_part.items() if k not in chunked.keys}, **chunked.pieces}
    state: dict[str, Any] = {"model": model_part}
    optim = optimizer_state(model, optimizer)
    if optim is not None:
        state["optim"] = optim
    return state


@dataclass(frozen=True)
class ChunkedParameters:
    """Level 3's parameters as saved from the optimizer's chunks: the state-dict keys of every bucketed
    parameter, and this rank's pieces of those it holds a part of (a parameter may lie wholly in another
    rank's chunk: that rank saves it)."""

    keys: frozenset[str]
    pieces: dict[str, Pieces]


def chunked_parameters(model: nn.Module, optimizer: torch.optim.Optimizer) -> ChunkedParameters | None:
    """Level 3 once the optimizer holds the parameters (after its first step), where the bucketed
    parameters hold no memory between uses: their pieces from the chunks this rank updates. None otherwise
    (the parameters themselves are current)."""
    optimizer = stepping_optimizer(
        optimizer
    )  # replicas stepping alone: their inner optimizer holds the chunks
    sharding = optimizer.sharding if isinstance(optimizer, ZeroOptimizer) else None
    if sharding is None or not sharding.active:
        return None
    keys: dict[nn.Parameter, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):  # every key of a shared parameter
        keys.setdefault(param, []).append(name)
    bucketed = frozenset(key for shard in optimizer.shards for p in shard.bucket.params for key in keys[p])
    pieces: dict[str, Pieces] = {}
    for shard in optimizer.shards:
        for param, lo, hi, at in shard.pieces:
            held = pieces_of(param, shard.master[at : at + hi - lo], lo, hi, local_tensor(param).dtype)
            pieces.update((key, held) for key in keys[param])
    return ChunkedParameters(bucketed, pieces)


def load_template(model: nn.Module, optimizer: torch.optim.Optimizer, metadata: Metadata) -> dict[str, Any]:
    """What DCP fills in at load (`metadata`: the checkpoint's): the model and, at level 0, the optimizer's
    states where the checkpoint has them, laid out as this run holds them (levels 1-3 read theirs into their
    chunks when they build them: `load_optimizer_state`)."""
    state: dict[str, Any] = {"model": model_state(model)}
    if isinstance(optimizer, Replicated):
        return {**state, **replica_load_template(metadata)}
    # none saved at levels 1-3 before the first step, or in a weights-only checkpoint: start fresh
    if isinstance(optimizer, ZeroOptimizer) or not _has_optimizer_state(metadata):
        return state
    state["optim"] = plain_load_template(model, optimizer, saved_optimizer_states(metadata))
    return state


def load_optimizer_state(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    state: dict[str, Any],
    metadata: Metadata,
    read: Reader,
) -> None:
    """Put back the optimizer state: at level 0 the one DCP filled into `load_template`'s state; at levels
    1-3 `read` (collective) reads the states into the chunks when the optimizer builds them (the first step)."""
    if isinstance(optimizer, ZeroOptimizer):
        defer_zero_load(model, optimizer, saved_optimizer_states(metadata), read)
    elif isinstance(optimizer, Replicated):
        load_replica_state(optimizer, state)
    elif "optim" in state:
        load_plain_state(model, optimizer, state["optim"])


def _has_optimizer_state(metadata: Metadata) -> bool:
    return any(path[0] == "optim" for path in _saved_paths(metadata).values())


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


# ---- optimizer level 0: a plain torch optimizer ------------------------------------------------------------


def plain_load_template(
    model: nn.Module, optimizer: torch.optim.Optimizer, saved: dict[str, dict[str, Any]]
) -> dict[str, Any]:
    """Empty places for DCP to fill, in `get_optimizer_state_dict`'s structure: the states the checkpoint has
    for this optimizer's trainable parameters, each laid out like its parameter (a scalar such as `step`:
    whole), and this optimizer's parameter groups (DCP overwrites their settings with the saved ones).

    Built from the checkpoint's metadata rather than by `get_optimizer_state_dict`, which on an optimizer
    without states first builds every one of them (a step on zero gradients) only for DCP to overwrite them:
    most of a load's time. States the metadata does not place (not elementwise) take that path still."""
    names = _names(model)
    params = _trainable(optimizer)
    if not all(_elementwise(param, saved.get(names[param], {})) for param in params):
        return get_optimizer_state_dict(model, optimizer)
    placed = [param for param in params if names[param] in saved]
    arena = Arena(
        _state_arena_bytes((param, meta) for param in placed for meta in saved[names[param]].values())
    )
    template: dict[str, ParamState] = {}
    for param in placed:
        name = names[param]
        template[name] = {
            key: _empty_state(name, key, param, meta, arena) for key, meta in saved[name].items()
        }
    return {"state": template, "param_groups": _named_groups(optimizer, names)}


def load_plain_state(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """Put `plain_load_template`'s state, filled in by DCP, into the optimizer, replacing what it holds:
    trainable parameters without saved states are left without (fresh ones are built at the next step).

    What `set_optimizer_state_dict` does, without its first step on zero gradients (it takes one on an
    optimizer without states, to build states that `load_state_dict` then replaces): the states go in by
    parameter name, in the optimizer's parameter order; group i takes the settings DCP read into group i."""
    names = _names(model)
    saved = state["state"]
    states = {names[p]: saved[names[p]] for p in _trainable(optimizer) if names[p] in saved}
    groups = [
        {**_settings(loaded), "params": named["params"]}
        for named, loaded in zip(_named_groups(optimizer, names), state["param_groups"], strict=True)
    ]
    # `load_state_dict` pairs the groups' parameter names with the parameters by position, keys the states
    # by them and casts the states as it does torch's own state dicts (`step` stays on the CPU, ...)
    optimizer.load_state_dict({"state": states, "param_groups": groups})


def _trainable(optimizer: torch.optim.Optimizer) -> list[nn.Parameter]:
    """The parameters that have optimizer states (those that take gradients), in the optimizer's order."""
    return [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]


def _elementwise(param: nn.Parameter, saved: dict[str, Any]) -> bool:
    """Whether the metadata tells how to lay out each of a parameter's saved states: shaped like it (laid out
    like it), a scalar (whole) or a Python value. Not for a 0-dimensional DTensor parameter, whose states
    (DTensors) and `step` (a plain tensor) the metadata describes alike."""
    if isinstance(param, DTensor) and param.dim() == 0:
        return not saved
    return all(
        not isinstance(meta, TensorStorageMetadata)
        or len(meta.size) == 0
        or tuple(meta.size) == tuple(param.shape)
        for meta in saved.values()
    )


def _named_groups(optimizer: torch.optim.Optimizer, names: dict[nn.Parameter, str]) -> list[dict[str, Any]]:
    """The parameter groups as `get_optimizer_state_dict` gives them: settings, and parameters by name."""
    return [
        {**_settings(group), "params": [names[p] for p in group["params"]]}
        for group in optimizer.param_groups
    ]


def _settings(group: dict[str, Any]) -> dict[str, Any]:
    """A parameter group without its parameters."""
    return {k: v for k, v in group.items() if k != "params"}


# ---- replicas that meet on their own schedule (local SGD, DiLoCo: loom.parallel.local_sgd) -----------------


def _replica_key() -> str:
    return f"rank_{env.rank():05d}"


def replica_state(optimizer: Replicated) -> dict[str, Any]:
    """Each rank's own entry (`Replicated.rank_state`: its parameters, inner and outer optimizer states,
    global weights): between two syncs every replica holds other values, so none can be saved once for all
    as the model's entry is. One Python value per rank, inside a tuple, which DCP saves whole (it walks
    into dicts and lists only) and reads back with the weights-only unpickler."""
    return {"replicas": {_replica_key(): (optimizer.rank_state(),)}}


def replica_load_template(metadata: Metadata) -> dict[str, Any]:
    """The place of this rank's entry (empty when the checkpoint holds no optimizer state: a fresh start
    from its weights); a `CheckpointError` when the checkpoint has optimizer states but none for this rank,
    or entries of another number of ranks (each rank resumes its own replica: none may be left out)."""
    key = _replica_key()
    saved = {
        path[2] for path in map(tuple, _saved_paths(metadata).values()) if path[:2] == ("optim", "replicas")
    }
    if saved and len(saved) != env.world_size():
        raise CheckpointError(
            f"the checkpoint holds the local SGD / DiLoCo states of {len(saved)} ranks; this run has "
            f"{env.world_size()}: each rank resumes its own replica, so resume on the mesh (world size) the "
            "checkpoint was saved with"
        )
    if key in saved:
        return {"optim": {"replicas": {key: None}}}
    if not _has_optimizer_state(metadata):
        return {}
    raise CheckpointError(
        f"the checkpoint holds no local SGD / DiLoCo state of rank {env.rank()}: it was saved by synchronous "
        "training (parallel.sync = 'every_step') or on fewer ranks; resume with the sync and mesh it was "
        "saved with"
    )


def load_replica_state(optimizer: Replicated, state: dict[str, Any]) -> None:
    """Give this rank its entry back (read by DCP into `replica_load_template`'s place), parameters
    included; nothing without one. A `CheckpointError` naming the `[parallel]` key when the entry was saved
    under another sync or other sync settings, or by another number of ranks or replicas."""
    if "optim" in state:
        (entry,) = state["optim"]["replicas"][_replica_key()]
        mismatch = optimizer.resume_mismatch(entry, prefix="parallel.")
        if mismatch is not None:
            raise CheckpointError(f"rank {env.rank()}'s local SGD / DiLoCo state: {mismatch}")
        optimizer.load_rank_state(entry)


# ---- optimizer levels 1-3: chunk states <-> per-parameter states -------------------------------------------


def zero_optimizer_state(model: nn.Module, optimizer: ZeroOptimizer) -> dict[str, Any] | None:
    """`ZeroOptimizer`'s states in the structure a plain optimizer over the same parameters gives, each
    state shaped like its parameter: per bucket chunk, this rank's pieces of it (views of the chunk's
    states, see chunks.py); the parameters updated whole, their states as they are. No collective: each
    rank contributes what it holds. None before the first step."""
    if not optimizer.inner:
        return None
    names = _names(model)
    chunks, whole = _inner_optimizers(optimizer)
    states: dict[str, ParamState] = {}
    for shard in optimizer.shards:
        states.update(_chunk_pieces(shard, chunks.state.get(shard.master, {}), names))
    for param in optimizer.whole:  # updated whole by the second optimizer: states are per parameter already
        if whole is not None and whole.state.get(param):
            states[names[param]] = dict(whole.state[param])
    params = optimizer.param_groups[0]["params"]
    ordered = {names[p]: states[names[p]] for p in params if states.get(names[p])}  # level 0's order
    return {"state": ordered, "param_groups": [_param_group(optimizer, names)]}


def saved_optimizer_states(metadata: Metadata) -> dict[str, dict[str, Any]]:
    """The optimizer states a checkpoint holds: {parameter name: {state name: DCP's storage metadata}}."""
    saved: dict[str, dict[str, Any]] = {}
    for key, path in _saved_paths(metadata).items():
        if len(path) == 4 and path[:2] == ("optim", "state"):
            saved.setdefault(path[2], {})[path[3]] = metadata.state_dict_metadata[key]
    return saved


def require_unbuilt(optimizer: torch.optim.Optimizer) -> None:
    """Levels 1-3 load before the first step only: the chunks are cut from the parameters and states then,
    and at level 3 the parameters are sharded at rest afterwards."""
    if isinstance(optimizer, ZeroOptimizer) and optimizer.inner:
        raise CheckpointError(
            "load optimizer level 1-3 checkpoints before the first step (the optimizer has already built "
            "its sharded states)"
        )


def defer_zero_load(
    model: nn.Module, optimizer: ZeroOptimizer, saved: dict[str, dict[str, Any]], read: Reader
) -> None:
    """Give the inner optimizers the checkpoint's states (`saved`: their metadata by parameter name) when
    they are built, at the first step, once the gradient buckets are known: `read` (collective: every rank
    builds at the same step) fills each chunk's states straight from the checkpoint, as the boxes of the
    chunk's pieces of each parameter, and the states of the parameters updated whole, laid out like them.
    The chunks themselves are rebuilt from the restored parameters."""
    require_unbuilt(optimizer)
    if not saved:
        return
    names = _names(model)

    def load() -> None:
        chunks, whole = _inner_optimizers(optimizer)
        whole_params = [p for p in optimizer.whole if names[p] in saved]
        arena = Arena(
            sum(_chunk_bytes(shard, saved, names) for shard in optimizer.shards)
            + _state_arena_bytes((p, meta) for p in whole_params for meta in saved[names[p]].values())
        )
        template: dict[str, ParamState] = {}
        chunk_states = [
            (shard, _chunk_template(shard, saved, names, template, arena)) for shard in optimizer.shards
        ]
        for param in whole_params:
            name = names[param]
            template[name] = {
                key: _empty_state(name, key, param, meta, arena) for key, meta in saved[name].items()
            }
        read({"optim": {"state": template}})
        for shard, (state, scalars_of) in chunk_states:
            if state:
                scalars = [key for key, value in state.items() if value is None]
                state.update((key, _scalar(template[scalars_of][key])) for key in scalars)
                chunks.state[shard.master] = state
        for param in whole_params:
            if whole is not None:
                whole.state[param] = template[names[param]]

    optimizer.on_build(load)


def _saved_paths(metadata: Metadata) -> dict[str, tuple]:
    """Each saved key's path in the nested state dict (DCP's default planner flattens and records them)."""
    return metadata.planner_data or {}


def _names(model: nn.Module) -> dict[nn.Parameter, str]:
    """Parameter -> name (a parameter shared by several modules: its first name, as torch's optimizer state
    dicts name it)."""
    return {param: name for name, param in model.named_parameters()}


def _inner_optimizers(
    optimizer: ZeroOptimizer,
) -> tuple[torch.optim.Optimizer | None, torch.optim.Optimizer | None]:
    """The inner optimizer of the bucket chunks and the one of the parameters updated whole (None: none)."""
    chunks = optimizer.inner[0] if optimizer.shards else None
    whole = optimizer.inner[-1] if optimizer.whole else None
    return chunks, whole


def _param_group(optimizer: ZeroOptimizer, names: dict[nn.Parameter, str]) -> dict[str, Any]:
    """The parameter group a plain optimizer would hold: the inner optimizer's settings (all of its class's
    defaults) with the outer group's (schedules change those), and the parameters by name."""
    group = {k: v for k, v in optimizer.inner[0].param_groups[0].items() if k != "params"}
    group.update((k, v) for k, v in optimizer.param_groups[0].items() if k != "params")
    group["params"] = [names[p] for p in optimizer.param_groups[0]["params"]]
    return group


def _chunk_pieces(
    shard: BucketShard, chunk_state: ParamState, names: dict[nn.Parameter, str]
) -> dict[str, ParamState]:
    """One bucket chunk's states as this rank's pieces of each parameter's states (views of the chunk)."""
    states: dict[str, ParamState] = {names[param]: {} for param, *_ in shard.pieces}
    for key, value in chunk_state.items():
        if torch.is_tensor(value) and value.dim() > 0:
            if value.shape != shard.master.shape:
                raise CheckpointError(
                    f"optimizer state {key!r} of shape {tuple(value.shape)} is not elementwise; levels 1-3 "
                    "checkpoint elementwise optimizer states only (Adam, AdamW, SGD, ...)"
                )
            for param, lo, hi, at in shard.pieces:
                states[names[param]][key] = pieces_of(param, value[at : at + hi - lo], lo, hi, value.dtype)
        else:  # a scalar (`step`): every rank of the group stepped its chunk alike (saved once, by DCP)
            for param, *_ in shard.pieces:
                states[names[param]][key] = value
    return states


def _chunk_template(
    shard: BucketShard,
    saved: dict[str, dict[str, Any]],
    names: dict[nn.Parameter, str],
    template: dict,
    arena: Arena,
) -> tuple[ParamState, str | None]:
    """One chunk's states to fill at load (on the CPU: from `arena`, sized by `_chunk_bytes`), whose pieces
    go into `template` under each parameter's name (the padding, and the elements of parameters without
    saved states, are zero as in a fresh state); the keys of scalars (`step`: every parameter of a chunk
    stepped alike) map to None, to be read from the bucket's first parameter that has states, whose name is
    returned with the chunk's states."""
    present = [p for p in shard.bucket.params if names[p] in saved]
    if not present:
        return {}, None
    first = names[present[0]]
    state: ParamState = {}
    for key, meta in saved[first].items():
        if _chunk_state(meta):
            dtype = _chunk_dtype(shard, meta)
            if shard.master.device.type == "cpu":
                values = state[key] = arena.empty(shard.bucket.chunk, dtype)
            else:
                values = state[key] = torch.empty(shard.bucket.chunk, dtype=dtype, device=shard.master.device)
            end = 0  # the elements before it are either zeroed or read
            for param, lo, hi, at in shard.pieces:  # in the chunk's order
                name = names[param]
                if key in saved.get(name, {}):
                    _require_elementwise(name, key, param, saved[name][key])
                    template.setdefault(name, {})[key] = pieces_of(
                        param, values[at : at + hi - lo], lo, hi, dtype
                    )
                    values[end:at].zero_()
                    end = at + hi - lo
            values[end:].zero_()
        else:
            state[key] = None
            template.setdefault(first, {})[key] = _empty_state(first, key, present[0], meta)
    return state, first


def _chunk_bytes(shard: BucketShard, saved: dict[str, dict[str, Any]], names: dict[nn.Parameter, str]) -> int:
    """The arena bytes `_chunk_template` takes for one chunk's states."""
    present = [p for p in shard.bucket.params if names[p] in saved]
    if not present or shard.master.device.type != "cpu":
        return 0
    return sum(
        Arena.size(shard.bucket.chunk, _chunk_dtype(shard, meta))
        for meta in saved[names[present[0]]].values()
        if _chunk_state(meta)
    )


def _chunk_state(meta: Any) -> bool:
    """Whether a saved state (DCP's metadata of it) is one a chunk holds elementwise (not a scalar)."""
    return isinstance(meta, TensorStorageMetadata) and len(meta.size) > 0


def _chunk_dtype(shard: BucketShard, meta: TensorStorageMetadata) -> torch.dtype:
    """A chunk's state's dtype: floating-point states follow the chunk's fp32 parameters."""
    return shard.master.dtype if meta.properties.dtype.is_floating_point else meta.properties.dtype


def _scalar(value: Any) -> Any:
    return value.clone() if torch.is_tensor(value) else value


def _laid_out_like(flat: torch.Tensor, param: nn.Parameter) -> torch.Tensor:
    """`flat` (a parameter's local elements) shaped and placed like the parameter."""
    if not isinstance(param, DTensor):
        return flat.view(param.shape)
    local = flat.view(param.to_local().shape)
    return DTensor.from_local(
        local, param.device_mesh, param.placements, shape=param.shape, stride=param.stride(), run_check=False
    )


def _empty_state(name: str, key: str, param: nn.Parameter, meta: Any, arena: Arena | None = None) -> Any:
    """Where DCP loads one saved state: laid out like `param` when shaped like it (on the CPU: from `arena`,
    sized by `_state_arena_bytes`, when given), whole when a scalar."""
    if isinstance(meta, BytesStorageMetadata):
        return None  # a Python value: DCP puts it in place
    assert isinstance(meta, TensorStorageMetadata)
    dtype = meta.properties.dtype
    if len(meta.size) == 0:
        return torch.empty((), dtype=dtype)
    _require_elementwise(name, key, param, meta)
    local = local_tensor(param)
    if arena is not None and _in_arena(param, meta):
        return _laid_out_like(arena.empty(local.numel(), dtype), param)
    return _laid_out_like(torch.empty(local.numel(), dtype=dtype, device=local.device), param)


def _state_arena_bytes(states: Iterable[tuple[nn.Parameter, Any]]) -> int:
    """The arena bytes of the states among `states` ((parameter, DCP's metadata of one of its saved states))
    that `_empty_state` lays out like their parameters on the CPU: their memory is written whole by the
    read, and an arena's pages are made present at once rather than one fault each (see memory.py)."""
    return sum(
        Arena.size(local_tensor(param).numel(), meta.properties.dtype)
        for param, meta in states
        if _in_arena(param, meta)
    )


def _in_arena(param: nn.Parameter, meta: Any) -> bool:
    return (
        isinstance(meta, TensorStorageMetadata)
        and len(meta.size) > 0
        and tuple(meta.size) == tuple(param.shape)
        and local_tensor(param).device.type == "cpu"
    )


def _require_elementwise(name: str, key: str, param: nn.Parameter, meta: TensorStorageMetadata) -> None:
    if tuple(meta.size) != tuple(param.shape):
        raise CheckpointError(
            f"the checkpoint's optimizer state {key!r} of {name} has shape {tuple(meta.size)}, the parameter "
            f"{tuple(param.shape)}: levels 1-3 load elementwise optimizer states only (Adam, AdamW, SGD, ...)"
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
