"""Saving and resuming a `Trainer`: `save_checkpoint`, `load_checkpoint`, and `Checkpointer` (every N steps
or minutes, keep the last k), on `torch.distributed.checkpoint` with loom's manifest (see manifest.py).

Layout of `step_000100/`: `dcp/` (DCP's files: model parameters and optimizer states by parameter name, the
same at every optimizer level, all resharded at load time: a checkpoint loads at any level, on any mesh or
number of processes), `train_state.pt` (step, schedule, loss scaler, optimizer settings, data position),
`rank_00000.pt`... (each rank's generators, restored on as many processes as saved them; elsewhere a
trainer with a seed derives them at each step, see `loom.dist.rng`), `plan.json`
(config, mesh, layouts) and `manifest.json`, written last. The directory must be on storage every rank sees
(as DCP's own metadata requires).

`start_save` saves in the background (`Checkpointer(async_save=True)`): it copies the state of the step to
the CPU and writes the side files, then DCP's `async_save` writes the copy from a thread, over a gloo group
of its own, followed on rank 0 by the manifest; `PendingSave.finish` publishes the directory once every
rank's write has succeeded. The same guarantees as `save_checkpoint`: visible only when complete, any
rank's failure a `CheckpointError` on every rank, earlier checkpoints untouched.
"""

from __future__ import annotations

import copy
import json
import shutil
import time
import warnings
from collections.abc import Callable, Iterator
from concurrent import futures
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.tensor import DTensor

from loom.checkpoint import manifest as mf
from loom.checkpoint import state as st
from loom.checkpoint.manifest import CheckpointError, CheckpointWarning
from loom.checkpoint.state import Trainable as Trainer
from loom.dist import env
from loom.dist._torch_private import dtensor_like
from loom.parallel.zero import ZeroOptimizer

# Called on every rank as `hook(step, temp_dir)` once its files are written and before the checkpoint is
# published: where fault-injection tests stop a rank in the middle of a save (see loom/fault/inject.py).
# With a background save: in the training thread, once this rank's DCP write has completed.
WRITE_HOOKS: list[Callable[[int, Path], None]] = []

# What a failing save raises: DCP reports its ranks' write failures as a `CheckpointException`, which is a
# BaseException (on every rank: it gathers the results of the writes).
_SAVE_ERRORS = (Exception, CheckpointException)

# The gloo group of background writes, with the default group it was made from (see _checkpoint_group).
_io_group: tuple[dist.ProcessGroup, dist.ProcessGroup] | None = None
# This process's newest background write: the next save waits for it first (see _settle_upload).
_upload: Future | None = None


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
    # a parallelised model's ParallelState, or a pipeline rank's StageParameters, knows how to gather them
    state = getattr(model, "loom", None)
    full = getattr(model, "full_parameters", None) or (state.full_parameters if state is not None else None)
    if full is None:
        yield
        return
    with full():
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


def _write_files(temp: Path, trainer: Trainer, data: Any, plan: dict[str, Any]) -> None:
    """Every rank's part of a synchronous save (collective: DCP coordinates the ranks; at optimizer levels
    1-3 gathering the states is too)."""
    with _full_parameters(trainer.model):
        dcp.save(st.dcp_state(trainer.model, trainer.optimizer), checkpoint_id=temp / "dcp")
    _write_side_files(temp, trainer, data, plan)


def _write_side_files(temp: Path, trainer: Trainer, data: Any, plan: dict[str, Any]) -> None:
    """Everything but DCP's files: this rank's generators; on rank 0 the train state and the plan."""
    torch.save(_rank_state(), temp / f"rank_{env.rank():05d}.pt")
    if env.rank() == 0:
        torch.save(_shared_state(trainer, data), temp / "train_state.pt")
        (temp / "plan.json").write_text(json.dumps(plan, indent=1, default=str))


def _manifest_info(step: int, plan: dict[str, Any]) -> dict[str, Any]:
    """What the manifest says besides the file table (taken when the save starts: with a background save
    the trainer has moved on by the time it is published)."""
    info = {"step": step, **plan}
    info.pop("layouts", None)
    return info


def _run_hooks(step: int, temp: Path) -> None:
    for hook in WRITE_HOOKS:
        hook(step, temp)


def _describe(exc: BaseException) -> str:
    """One line per failure: DCP's exception names the ranks whose writes failed (the checkpoint group
    spans every rank: its ranks are the global ones) and carries their tracebacks, left out here."""
    if isinstance(exc, CheckpointException):
        return "; ".join(f"rank {r}: {type(e).__name__}: {e}" for r, (e, _) in sorted(exc.failures.items()))
    return f"rank {env.rank()}: {type(exc).__name__}: {exc}"


def _failure(step: int, final: Path, error: str) -> CheckpointError:
    return CheckpointError(f"saving step {step} to {final} failed ({error}); earlier checkpoints are intact")


def _prepare(root: Path, step: int) -> tuple[Path, Path]:
    """The temporary and final directories of step `step`, the temporary one made empty (collective)."""
    _settle_upload()  # an abandoned background write may still be writing into this temporary directory
    temp, final = root / mf.temp_dir_name(step), root / mf.step_dir_name(step)
    if env.rank() == 0:
        shutil.rmtree(temp, ignore_errors=True)
        (temp / "dcp").mkdir(parents=True)
    _barrier()
    return temp, final


def _conclude(
    temp: Path, final: Path, step: int, keep_last: int | None, error: str | None, info: dict[str, Any] | None
) -> Path:
    """The end of every save (collective): any rank's `error` is every rank's `CheckpointError`; without
    one, rank 0 writes the manifest of `info` last (None: written already, in the background) and renames
    the directory into place."""
    error = _first_error(error)
    if error is None and env.rank() == 0:
        error = _publish(temp, final, info, keep_last)
    error = _broadcast(error)
    if error is not None:
        raise _failure(step, final, error)
    return final


def save_checkpoint(
    root: str | Path, trainer: Trainer, *, data: Any = None, config: Any = None, keep_last: int | None = None
) -> Path:
    """Save the trainer (and `data`'s position) as `root/step_{trainer.step:06d}`; collective.

    Written into a temporary directory; once every rank has finished, rank 0 writes the manifest and
    renames the directory into place, then keeps only the newest `keep_last`. On any rank's failure every
    rank raises `CheckpointError`, and the earlier checkpoints are untouched.
    """
    step = trainer.step
    temp, final = _prepare(Path(root), step)
    error, info = None, None
    try:
        plan = _plan(trainer, config)
        info = _manifest_info(step, plan)
        _write_files(temp, trainer, data, plan)
        _run_hooks(step, temp)
    except _SAVE_ERRORS as exc:  # reported on every rank by _conclude, so that no rank waits forever
        error = _describe(exc)
    return _conclude(temp, final, step, keep_last, error, info)


def _publish(temp: Path, final: Path, info: dict[str, Any] | None, keep_last: int | None) -> str | None:
    """Rank 0: manifest last (none to write when `info` is None), rename into place, prune. Returns an
    error message, or None."""
    try:
        if info is not None:
            _write_manifest(temp, info)
        mf.publish(temp, final)
        if keep_last is not None:
            mf.prune(final.parent, keep_last)
    except Exception as exc:
        return f"rank 0: {type(exc).__name__}: {exc}"
    return None


def _write_manifest(temp: Path, info: dict[str, Any]) -> None:
    mf.write_manifest(temp, {**info, "saved_at": time.time()})


# ---- saving in the background ------------------------------------------------------------------------------


@dataclass
class PendingSave:
    """A checkpoint whose DCP files are being written in the background (`start_save`'s). Every rank holds
    one; `written` and `finish` are collective, so all ranks call them at the same points."""

    step: int
    temp: Path
    final: Path
    keep_last: int | None
    upload: Future

    def written(self) -> bool:
        """Whether every rank's background write has finished (one tiny all-reduce: all ranks agree)."""
        return _all_ranks(self.upload.done())

    def finish(self) -> Path:
        """Wait for this rank's write, run the write hooks, publish as `save_checkpoint` does (collective):
        the checkpoint appears only once every rank's files are complete; on any rank's failure every rank
        raises `CheckpointError` and the earlier checkpoints are untouched."""
        error = None
        try:
            self.upload.result()
            _run_hooks(self.step, self.temp)
        except _SAVE_ERRORS as exc:
            error = _describe(exc)
        return _conclude(self.temp, self.final, self.step, self.keep_last, error, None)  # manifest written


def start_save(
    root: str | Path, trainer: Trainer, *, data: Any = None, config: Any = None, keep_last: int | None = None
) -> PendingSave:
    """Begin saving the trainer as `save_checkpoint` does, with DCP's files written in the background
    (`torch.distributed.checkpoint.async_save`); collective. Returns once the state of this step is copied:
    training may go on and update parameters and optimizer states in place meanwhile. The checkpoint appears
    when `PendingSave.finish` publishes it. A failure before the background write starts raises
    `CheckpointError` on every rank at once."""
    step = trainer.step
    temp, final = _prepare(Path(root), step)
    error, staged, info = None, None, {}  # staged and info are set whenever error stays None
    try:
        staged = _staged_state(trainer)  # first: at levels 1-3 it is collective, the rest is not
        plan = _plan(trainer, config)
        info = _manifest_info(step, plan)
        _write_side_files(temp, trainer, data, plan)
    except _SAVE_ERRORS as exc:
        error = _describe(exc)
    # Agreed before any background collective starts: a rank that did not launch its write would leave
    # the others' writes waiting on the checkpoint group for ever.
    error = _first_error(error)
    if error is not None:
        raise _failure(step, final, error)
    return PendingSave(step, temp, final, keep_last, _launch(staged, temp, info))


def _staged_state(trainer: Trainer) -> dict[str, Any]:
    """A private CPU copy of what DCP saves, taken now: training may then update parameters and optimizer
    states in place while the copy is written. Taken inside `full_parameters`, where level 3's parameters
    exist whole; the optimizer states of levels 1-3 are temporary gathered tensors, copied as well."""
    with torch.no_grad(), _full_parameters(trainer.model):
        return _cpu_copy(st.dcp_state(trainer.model, trainer.optimizer), {})


def _cpu_copy(value: Any, memo: dict[int, torch.Tensor]) -> Any:
    """`value` with every tensor copied to the CPU, through nested dicts, lists and tuples (a tensor met
    twice is copied once). Not DCP's `DefaultStager` (torch 2.13): it takes a DTensor whose local tensor
    starts inside its storage (the views of gathered states at levels 1-3) for a plain tensor and fails."""
    if torch.is_tensor(value):
        if id(value) not in memo:
            memo[id(value)] = _tensor_copy(value)
        return memo[id(value)]
    if isinstance(value, dict):
        return {key: _cpu_copy(item, memo) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_cpu_copy(item, memo) for item in value)
    return copy.deepcopy(value)


def _tensor_copy(tensor: torch.Tensor) -> torch.Tensor:
    if isinstance(tensor, DTensor):
        # the same layout over a CPU copy of the local shard (`DTensor.from_local` would move the copy
        # back to the mesh's device)
        return dtensor_like(_tensor_copy(tensor.to_local()), tensor)
    return tensor.detach().to("cpu", copy=True)


class _AlreadyStaged(AsyncStager):
    """Hands `async_save` the copy `_staged_state` took (staging it again would copy it twice)."""

    _synchronize_after_execute = False

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        return state_dict


def _launch(staged: dict[str, Any], temp: Path, info: dict[str, Any]) -> Future:
    """Start DCP's background write of `staged` into `temp` (collective, on the checkpoint group); on rank 0
    followed by the manifest. Returns the future of this rank's part."""
    global _upload
    group = _checkpoint_group()
    response = dcp.async_save(
        staged,
        checkpoint_id=temp / "dcp",
        process_group=group,
        async_stager=_AlreadyStaged(),
        no_dist=group is None,
    )
    _upload = getattr(response, "upload_completion", response)  # an AsyncSaveResponse with async staging
    if env.rank() == 0:
        _upload = _then_manifest(_upload, temp, info)
    return _upload


def _then_manifest(upload: Future, temp: Path, info: dict[str, Any]) -> Future:
    """Rank 0: the manifest (every file's checksum: the costly part of publishing) written in the
    background as well, once the DCP files are complete. DCP's write ends on rank 0 only after every
    rank's writes have (it gathers their results first), and the other files were written before the
    write started, so the manifest still comes last. The checkpoint becomes visible only when `finish`
    renames the directory, after every rank has reported success."""
    done: Future = Future()

    def write(_: Future) -> None:  # in DCP's thread, once its write has ended
        try:
            upload.result()
            _write_manifest(temp, info)
        except BaseException as exc:  # CheckpointException included: it is no Exception
            done.set_exception(exc)
        else:
            done.set_result(None)

    upload.add_done_callback(write)
    return done


def _settle_upload() -> None:
    """Wait (locally, ignoring its outcome) for this process's last background write: two writes never
    share the checkpoint group or a directory, even when an exception left one unfinished."""
    if _upload is not None:
        futures.wait([_upload])


def _checkpoint_group() -> dist.ProcessGroup | None:
    """The gloo group of background checkpoint writes, made once per default group (collective the first
    time: every rank starts its first background save together). DCP's collectives run in a background
    thread; on a group of their own they never interleave with training's on the default group."""
    global _io_group
    if not _distributed():
        return None
    world = dist.group.WORLD
    if _io_group is None or _io_group[0] is not world:
        _io_group = (world, dist.new_group(backend="gloo", timeout=env.collective_timeout()))
    return _io_group[1]


def _all_ranks(flag: bool) -> bool:
    """Whether `flag` holds on every rank (collective, on the default group, in the training thread)."""
    if not _distributed():
        return flag
    value = torch.tensor([int(flag)], device=env.device_type())  # NCCL reduces device tensors only
    dist.all_reduce(value, op=dist.ReduceOp.MIN)
    return bool(value.item())


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
    if manifest.get("kind") == mf.WEIGHTS:  # `loom checkpoint import`: a model to start training from
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
    _load_rank(path, manifest, seeded=getattr(trainer, "rng", None) is not None)


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


def _load_rank(path: Path, manifest: dict[str, Any], seeded: bool = False) -> None:
    """This rank's generators, under the world size they were saved with (they are per process). On another
    world size a `seeded` trainer (`Trainer(seed=...)`) derives them at each step, as a fresh run on this
    mesh does (see `loom.dist.rng`); without a seed they are not restored."""
    if manifest.get("world_size") != env.world_size():
        if env.rank() == 0 and not seeded:
            warnings.warn(
                f"{path}: saved on {manifest.get('world_size')} ranks, resumed on {env.world_size()}: "
                "random number generator states are not restored (give the Trainer a seed to derive "
                "them per step and rank on any mesh)",
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
