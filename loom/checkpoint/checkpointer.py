"""Saving and resuming a `Trainer`: `save_checkpoint`, `load_checkpoint`, and `Checkpointer` (every N steps
or minutes, keep the last k), on `torch.distributed.checkpoint` with loom's manifest (see manifest.py).

Layout of `step_000100/`: `dcp/` (DCP's files: model parameters and optimizer states by parameter name, the
same at every optimizer level, all resharded at load time: a checkpoint loads at any level, on any mesh or
number of processes), `train_state.pt` (step, schedule, loss scaler, optimizer settings, data position),
`rank_00000.pt`... (each rank's generators, restored only on as many processes as saved them), `plan.json`
(config, mesh, layouts) and `manifest.json`, written last. The directory must be on storage every rank sees
(as DCP's own metadata requires).
"""

from __future__ import annotations

import json
import shutil
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.metadata import Metadata

from loom.checkpoint import manifest as mf
from loom.checkpoint import state as st
from loom.checkpoint.manifest import CheckpointError, CheckpointWarning
from loom.checkpoint.state import Trainable as Trainer
from loom.dist import env
from loom.parallel.zero import ZeroOptimizer

# Called on every rank as `hook(step, temp_dir)` once its files are written and before the checkpoint is
# published: where fault-injection tests stop a rank in the middle of a save (see loom/fault/inject.py).
WRITE_HOOKS: list[Callable[[int, Path], None]] = []


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _barrier() -> None:
    if _distributed():
        dist.barrier()


def _broadcast(value: Any) -> Any:
    """Rank 0's `value` on every rank."""
    if not _distributed():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _first_error(error: str | None) -> str | None:
    """Any rank's error (the lowest rank's), on every rank: all ranks then fail, or go on, together."""
    if not _distributed():
        return error
    errors: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    return next((e for e in errors if e is not None), None)


@contextmanager
def _full_parameters(model: nn.Module) -> Iterator[None]:
    state = getattr(model, "loom", None)
    if state is None:
        yield
        return
    with state.full_parameters():
        yield


def _level(optimizer: torch.optim.Optimizer) -> int:
    return optimizer.level if isinstance(optimizer, ZeroOptimizer) else 0


def _plan(trainer: Trainer, config: Any) -> dict[str, Any]:
    """What the run looked like: mesh, optimizer level, parameter layouts, config (JSON-ready)."""
    state = getattr(trainer.model, "loom", None)
    plan: dict[str, Any] = {"optimizer_level": _level(trainer.optimizer), "world_size": env.world_size()}
    if state is not None:
        names, shape = state.mesh.device_mesh.mesh_dim_names, state.mesh.canonical_shape
        plan["mesh"] = repr(state.mesh)
        plan["layouts"] = {n: layout.describe(names, shape) for n, layout in state.parameter_layouts.items()}
    if config is not None:
        plan["config"] = config.to_dict() if hasattr(config, "to_dict") else config
    return plan


def _shared_state(trainer: Trainer, data: Any) -> dict[str, Any]:
    return {
        "step": trainer.step,
        "hyper": st.hyper_parameters(trainer.optimizer),
        "lr_scheduler": trainer.lr_scheduler.state_dict() if trainer.lr_scheduler is not None else None,
        "scaler": trainer.scaler.state_dict() if trainer.scaler is not None else None,
        "data": data.state_dict() if data is not None else None,
    }


def _rank_state() -> dict[str, Any]:
    return {"rank": env.rank(), "rng": st.rng_state()}


def _write_files(temp: Path, trainer: Trainer, data: Any, config: Any) -> None:
    """Every rank's part of a save (collective: DCP coordinates the ranks; at optimizer levels 1-3 gathering
    the states is too)."""
    with _full_parameters(trainer.model):
        dcp.save(st.dcp_state(trainer.model, trainer.optimizer), checkpoint_id=temp / "dcp")
    torch.save(_rank_state(), temp / f"rank_{env.rank():05d}.pt")
    if env.rank() == 0:
        torch.save(_shared_state(trainer, data), temp / "train_state.pt")
        (temp / "plan.json").write_text(json.dumps(_plan(trainer, config), indent=1, default=str))


def save_checkpoint(
    root: str | Path, trainer: Trainer, *, data: Any = None, config: Any = None, keep_last: int | None = None
) -> Path:
    """Save the trainer (and `data`'s position) as `root/step_{trainer.step:06d}`; collective.

    Written into a temporary directory; once every rank has finished, rank 0 writes the manifest and
    renames the directory into place, then keeps only the newest `keep_last`. On any rank's failure every
    rank raises `CheckpointError`, and the earlier checkpoints are untouched.
    """
    root, step = Path(root), trainer.step
    temp, final = root / mf.temp_dir_name(step), root / mf.step_dir_name(step)
    if env.rank() == 0:
        shutil.rmtree(temp, ignore_errors=True)
        (temp / "dcp").mkdir(parents=True)
    _barrier()
    error = None
    try:
        _write_files(temp, trainer, data, config)
        for hook in WRITE_HOOKS:
            hook(step, temp)
    except Exception as exc:  # reported on every rank below, so that no rank waits forever
        error = f"rank {env.rank()}: {type(exc).__name__}: {exc}"
    error = _first_error(error)
    if error is None and env.rank() == 0:
        error = _publish(temp, final, trainer, config, keep_last)
    error = _broadcast(error)
    if error is not None:
        raise CheckpointError(
            f"saving step {step} to {final} failed ({error}); earlier checkpoints are intact"
        )
    return final


def _publish(temp: Path, final: Path, trainer: Trainer, config: Any, keep_last: int | None) -> str | None:
    """Rank 0: manifest last, rename into place, prune. Returns an error message, or None."""
    try:
        info = {"step": trainer.step, "saved_at": time.time(), **_plan(trainer, config)}
        info.pop("layouts", None)
        mf.write_manifest(temp, info)
        mf.publish(temp, final)
        if keep_last is not None:
            mf.prune(final.parent, keep_last)
    except Exception as exc:
        return f"rank 0: {type(exc).__name__}: {exc}"
    return None


def load_checkpoint(root: str | Path, trainer: Trainer, *, data: Any = None) -> int | None:
    """Resume from the newest intact checkpoint under `root`; returns its step (None: no checkpoint).

    Rank 0 verifies manifests and checksums newest first; an unusable checkpoint is skipped with a
    `CheckpointWarning` naming the file and the problem. `CheckpointError` when checkpoints exist but none
    is intact. Call it before the first training step.
    """
    choice = _broadcast(mf.latest_valid(root, warn=env.rank() == 0) if env.rank() == 0 else None)
    if choice.path is None:
        if choice.skipped:
            raise CheckpointError(f"no intact checkpoint under {root}: " + " | ".join(choice.skipped))
        return None
    load_from(choice.path, trainer, data=data)
    return choice.step


def load_from(path: str | Path, trainer: Trainer, *, data: Any = None) -> None:
    """Load one (verified) checkpoint directory into the trainer and `data`; collective. A weights-only
    checkpoint (`loom checkpoint import`) sets the parameters and the step count alone.

    Any optimizer level's checkpoint loads at any level, on any mesh: DCP reshards the per-parameter states,
    and at levels 1-3 they are cut into this run's chunks when the optimizer builds them (at the first step).
    """
    path = Path(path)
    manifest = mf.read_manifest(path)
    model, optimizer = trainer.model, trainer.optimizer
    st.require_unbuilt(optimizer)
    if manifest.get("kind") == "weights":  # `loom checkpoint import`: a model to start training from
        load_model_weights(path, model)
        trainer.step = int(manifest.get("step", 0))
        return
    metadata = dcp.FileSystemReader(path / "dcp").read_metadata()
    _refuse_rank_local_zero(path, manifest, metadata)
    state = st.load_template(model, optimizer, metadata)
    dcp.load(state, checkpoint_id=path / "dcp")
    model.load_state_dict(state["model"])
    if "optim" in state:
        st.load_optimizer_state(model, optimizer, state["optim"])
    shared = torch.load(path / "train_state.pt", weights_only=True)
    _load_shared(trainer, data, shared)
    _load_rank(path, manifest)


def _refuse_rank_local_zero(path: Path, manifest: dict[str, Any], metadata: Metadata) -> None:
    """Checkpoints of levels 1-3 written before optimizer states went into DCP kept them in the rank files;
    this version cannot read those (rather than resume silently with fresh states)."""
    if manifest.get("optimizer_level", 0) == 0 or st.saved_optimizer_states(metadata):
        return
    rank_file = torch.load(path / "rank_00000.pt", weights_only=True)
    if rank_file.get("zero") is not None:
        raise CheckpointError(
            f"{path} keeps its optimizer level {manifest['optimizer_level']} states per rank (written by an "
            "earlier loom); resume it with that version, or load only its weights (load_model_weights)"
        )


def _load_shared(trainer: Trainer, data: Any, shared: dict[str, Any]) -> None:
    trainer.step = int(shared["step"])
    st.load_hyper_parameters(trainer.optimizer, shared["hyper"])
    if trainer.lr_scheduler is not None and shared["lr_scheduler"] is not None:
        trainer.lr_scheduler.load_state_dict(shared["lr_scheduler"])
    if trainer.scaler is not None and shared["scaler"] is not None:
        trainer.scaler.load_state_dict(shared["scaler"])
    if data is not None and shared["data"] is not None:
        data.load_state_dict(shared["data"])


def _load_rank(path: Path, manifest: dict[str, Any]) -> None:
    """This rank's generators: only under the world size they were saved with (they are per process)."""
    if manifest.get("world_size") != env.world_size():
        if env.rank() == 0:
            warnings.warn(
                f"{path}: saved on {manifest.get('world_size')} ranks, resumed on {env.world_size()}: "
                "random number generator states are not restored",
                CheckpointWarning,
                stacklevel=3,
            )
        return
    rank_state = torch.load(path / f"rank_{env.rank():05d}.pt", weights_only=True)
    st.load_rng_state(rank_state["rng"])


def load_model_weights(path: str | Path, model: nn.Module) -> None:
    """Only the parameters of one checkpoint directory into `model` (any layout, or a plain model on one
    process): DCP reshards them to whatever `model` holds."""
    state = {"model": st.model_state(model)}
    with _full_parameters(model):
        with warnings.catch_warnings():  # DCP's notice when it reads on one process: intended
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state, checkpoint_id=Path(path) / "dcp", no_dist=not _distributed())
        model.load_state_dict(state["model"])
