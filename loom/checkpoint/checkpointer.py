"""Saving and resuming a `Trainer`: `save_checkpoint`, `load_checkpoint` (and `Checkpointer`, every N steps or
minutes, keep the last k, in periodic.py), on `torch.distributed.checkpoint` with loom's manifest (see
manifest.py).

Layout of `step_000100/`: `dcp/` (DCP's files: model parameters and optimizer states by parameter name, the
same at every optimizer level, all resharded at load time: a checkpoint loads at any level, on any mesh or
number of processes), `train_state.pt` (step, schedule, loss scaler, optimizer settings, data position),
`rank_00000.pt`... (each rank's generators, restored on as many processes as saved them; elsewhere a
trainer with a seed derives them at each step, see `loom.dist.rng`), `plan.json`
(config, mesh, layouts) and `manifest.json`, written last. The directory must be on storage every rank sees
(as DCP's own metadata requires).

Every rank writes what it holds and nothing more (at optimizer levels 1-3 its own chunks of the optimizer
states, and at level 3 of the parameters: no collective gathers them first) and hashes its files as it
writes them; one agreement at the end (every rank's error and file table, gathered) lets rank 0 write the
manifest and publish, and pruning old checkpoints happens in the background. Loading shares the checksum
verification among the ranks, each checking the files one saving rank wrote.

`start_save` (background.py) saves in the background with the same guarantees.
"""

from __future__ import annotations

import io
import json
import shutil
import threading
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
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.tensor import DTensor

from loom.checkpoint import manifest as mf
from loom.checkpoint import state as st
from loom.checkpoint import worker
from loom.checkpoint.chunks import PiecesLoadPlanner, PiecesSavePlanner
from loom.checkpoint.manifest import CheckpointError, CheckpointWarning
from loom.checkpoint.safe import METADATA, SafeLoadPlanner, SafeReader, load_torch_file, read_metadata
from loom.checkpoint.state import Trainable as Trainer
from loom.checkpoint.storage import DirectReader, HashingWriter, Written, archives_without_crc, write_hashed
from loom.dist import env
from loom.parallel.local_sgd import stepping_optimizer
from loom.parallel.zero import ZeroOptimizer
from loom.plan import Plan

# Called on every rank as `hook(step, temp_dir)` once its files are written and before the checkpoint is
# published: where fault-injection tests stop a rank in the middle of a save (see loom/fault/inject.py).
# With a background save: in the background thread, once this rank's DCP write has completed.
WRITE_HOOKS: list[Callable[[int, Path], None]] = []

# What a failing save raises: DCP reports its ranks' write failures as a `CheckpointException`, which is a
# BaseException (on every rank: it gathers the results of the writes).
SAVE_ERRORS = (Exception, CheckpointException)

# The files one rank wrote into a checkpoint: {path relative to the checkpoint: (size, checksum)}.
Files = dict[str, Written]


def distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _barrier() -> None:
    if distributed():
        dist.barrier()


def _broadcast(value: Any, group: dist.ProcessGroup | None = None) -> Any:
    """Rank 0's `value` on every rank (of `group`, whose ranks are the global ones)."""
    if not distributed():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def agree(
    error: str | None, files: Files, group: dist.ProcessGroup | None = None
) -> tuple[str | None, dict[str, dict[str, Any]]]:
    """The one agreement of a save (collective over `group`, whose ranks are the global ones): any rank's
    error (the lowest rank's) and every rank's files as the manifest's table, on every rank."""
    reports = [(env.rank(), error, files)]
    if distributed():
        reports = [None] * dist.get_world_size(group)
        dist.all_gather_object(reports, (env.rank(), error, files), group=group)
    first = next((e for _, e, _ in reports if e is not None), None)
    table = {
        name: mf.file_entry(size, checksum, rank)
        for rank, _, written in reports
        for name, (size, checksum) in written.items()
    }
    return first, table


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
    """The optimizer level of `optimizer`, or of the inner optimizer of replicas stepping alone."""
    optimizer = stepping_optimizer(optimizer)  # replicas stepping alone: their inner optimizer's level
    return optimizer.level if isinstance(optimizer, ZeroOptimizer) else 0


def plan_of(trainer: Trainer, config: Any) -> dict[str, Any]:
    """What the run looked like, as plan.json holds it (JSON-ready): the run's `loom.plan.Plan` under
    "plan" (load it with `Plan.from_dict`), the config under "config", and for reading at a glance the
    optimizer level, the world size, the mesh and each parameter's layout."""
    state = getattr(trainer.model, "loom", None)
    level, world_size = _level(trainer.optimizer), env.world_size()
    plan: dict[str, Any] = {"optimizer_level": level, "world_size": world_size}
    if state is not None:
        names, shape = state.mesh.device_mesh.mesh_dim_names, state.mesh.canonical_shape
        plan["mesh"] = repr(state.mesh)
        plan["layouts"] = {n: layout.describe(names, shape) for n, layout in state.parameter_layouts.items()}
    if config is not None:
        plan["config"] = config.to_dict() if hasattr(config, "to_dict") else config
    plan["plan"] = _run_plan(config, state, level, world_size).to_dict()
    return plan


def _run_plan(config: Any, state: Any, level: int, world_size: int) -> Plan:
    """The run's Plan: the one its TrainConfig compiles to, else what its mesh and optimizer show."""
    if hasattr(config, "plan"):
        try:
            return config.plan(world_size)
        except ValueError:  # a config that did not set up this run (e.g. another mesh): describe the run
            pass
    if state is None:
        return Plan(dp=world_size, optimizer_level=level)
    return Plan(dp=state.mesh.dp_size, tp=state.mesh.axis_size("tp"), optimizer_level=level)


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


def write_dcp(
    state: dict[str, Any],
    temp: Path,
    group: dist.ProcessGroup | None = None,
    stop: threading.Event | None = None,
) -> Files:
    """DCP's part of a save (collective over `group`): every rank writes the pieces it holds, hashing them as
    it goes; the files this rank wrote. `stop`, once set, aborts the write."""
    writer = HashingWriter(temp / "dcp", stop)
    with warnings.catch_warnings():  # DCP's notice when it writes on one process: intended
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(
            state,
            storage_writer=writer,
            planner=PiecesSavePlanner(),
            process_group=group,
            no_dist=not distributed(),
        )
    return writer.written(temp)


def write_side_files(temp: Path, trainer: Trainer, data: Any, plan: dict[str, Any]) -> Files:
    """Everything but DCP's files: this rank's generators; on rank 0 the train state and the plan. Returns
    the files this rank wrote."""
    files = _save_hashed(temp, f"rank_{env.rank():05d}.pt", _rank_state())
    if env.rank() == 0:
        files.update(_save_hashed(temp, "train_state.pt", _shared_state(trainer, data)))
        files["plan.json"] = write_hashed(
            temp / "plan.json", json.dumps(plan, indent=1, default=str).encode()
        )
    return files


def _save_hashed(temp: Path, name: str, obj: Any) -> Files:
    """`torch.save(obj)` as `temp / name`, hashed on the way."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return {name: write_hashed(temp / name, buffer.getbuffer())}


def manifest_info(step: int, plan: dict[str, Any]) -> dict[str, Any]:
    """What the manifest says besides the file table (taken when the save starts: with a background save
    the trainer has moved on by the time it is published)."""
    info = {"step": step, **plan}
    info.pop("layouts", None)
    info.pop("plan", None)  # plan.json has it
    return info


def run_hooks(step: int, temp: Path) -> None:
    for hook in WRITE_HOOKS:
        hook(step, temp)


def describe(exc: BaseException) -> str:
    """One line per failure: DCP's exception names the ranks whose writes failed (the checkpoint group
    spans every rank: its ranks are the global ones) and carries their tracebacks, left out here."""
    if isinstance(exc, CheckpointException):
        return "; ".join(f"rank {r}: {type(e).__name__}: {e}" for r, (e, _) in sorted(exc.failures.items()))
    return f"rank {env.rank()}: {type(exc).__name__}: {exc}"


LOW_DISK_BYTES = 256 * 2**20  # below this (or 1% of the file system) free, a failed save names the full disk


def failure(step: int, final: Path, error: str) -> CheckpointError:
    return CheckpointError(
        f"saving step {step} to {final} failed ({error}){full_disk_note(final.parent)}; earlier checkpoints "
        "are intact"
    )


def full_disk_note(root: Path) -> str:
    """A note when the file system holding `root` is (nearly) full after a failed save, else "". Writes that
    run out of space do not always say so: torch's archive writer reports "unexpected pos" instead."""
    try:
        usage = shutil.disk_usage(root)
    except OSError:
        return ""
    if usage.free >= min(LOW_DISK_BYTES, usage.total // 100):
        return ""
    return (
        f"; the file system holding {root} is full ({usage.free / 2**20:.0f} MiB free of "
        f"{usage.total / 2**30:.1f} GiB): free space there, keep fewer checkpoints (keep_last), or save "
        "elsewhere (checkpoint.dir)"
    )


def prepare(root: Path, step: int) -> tuple[Path, Path]:
    """The temporary and final directories of step `step`, the temporary one made empty (collective)."""
    worker.settle()  # an earlier background write (or prune) may still be using the directory
    temp, final = root / mf.temp_dir_name(step), root / mf.step_dir_name(step)
    if env.rank() == 0:
        shutil.rmtree(temp, ignore_errors=True)
        (temp / "dcp").mkdir(parents=True)
    _barrier()
    return temp, final


def conclude(
    save: tuple[int, Path, Path],
    error: str | None,
    files: Files,
    info: dict[str, Any] | None,
    group: dist.ProcessGroup | None = None,
) -> None:
    """The end of every save of `save` = (step, temp, final) (collective over `group`): the agreement on any
    rank's `error` and every rank's files; without an error, rank 0 writes the manifest of `info` and the
    files last and renames the directory into place. Any error is every rank's `CheckpointError`."""
    step, temp, final = save
    error, table = agree(error, files, group)
    if error is None and env.rank() == 0:
        error = _publish(temp, final, info, table)
    error = _broadcast(error, group)
    if error is not None:
        raise failure(step, final, error)


def _publish(temp: Path, final: Path, info: dict[str, Any] | None, files: dict[str, Any]) -> str | None:
    """Rank 0: manifest last, rename into place. Returns an error message, or None."""
    try:
        mf.write_manifest(temp, {**(info or {}), "saved_at": time.time()}, files)
        mf.publish(temp, final)
    except Exception as exc:
        return f"rank 0: {type(exc).__name__}: {exc}"
    return None


def prune(root: Path, keep_last: int | None) -> None:
    """Rank 0: keep only the newest `keep_last` checkpoints (None: all). Runs off the training thread: a
    failure is a warning, the checkpoints it could not remove stay."""
    if keep_last is None or env.rank() != 0:
        return
    try:
        mf.prune(root, keep_last)
    except Exception as exc:  # a published checkpoint is not undone by a prune that failed
        warnings.warn(f"pruning {root} failed: {type(exc).__name__}: {exc}", CheckpointWarning, stacklevel=2)


def save_checkpoint(
    root: str | Path, trainer: Trainer, *, data: Any = None, config: Any = None, keep_last: int | None = None
) -> Path:
    """Save the trainer (and `data`'s position) as `root/step_{trainer.step:06d}`; collective.

    Every rank writes the state it holds into a temporary directory, hashing it as it goes; once every rank
    has finished, rank 0 writes the manifest and renames the directory into place, then keeps only the newest
    `keep_last` (in the background). On any rank's failure every rank raises `CheckpointError`, and the
    earlier checkpoints are untouched.
    """
    step = trainer.step
    temp, final = prepare(Path(root), step)
    error, files, info = None, {}, None
    try:
        plan = plan_of(trainer, config)
        info = manifest_info(step, plan)
        with archives_without_crc():
            files = write_dcp(st.dcp_state(trainer.model, trainer.optimizer), temp)
        files.update(write_side_files(temp, trainer, data, plan))
        run_hooks(step, temp)
    except SAVE_ERRORS as exc:  # reported on every rank by conclude, so that no rank waits forever
        error = describe(exc)
    conclude((step, temp, final), error, files, info)
    if env.rank() == 0 and keep_last is not None:
        worker.submit(prune, Path(root), keep_last)
    return final


# ---- loading -----------------------------------------------------------------------------------------------


def load_checkpoint(root: str | Path, trainer: Trainer, *, data: Any = None) -> int | None:
    """Resume from the newest intact checkpoint under `root`; returns its step (None: no checkpoint).

    The ranks verify manifests and checksums newest first, each the files of its share of the saving ranks;
    an unusable checkpoint is skipped with a `CheckpointWarning` (on rank 0) naming the file and the problem.
    `CheckpointError` when checkpoints exist but none is intact, or when `root` is a file or one checkpoint
    (`load_from` loads one). Call it before the first training step. Nothing read runs code (see safe.py).
    """
    worker.settle()
    root = mf.require_root(root)
    choice = latest_valid_everywhere(root)
    if choice.path is None:
        if choice.skipped:
            raise CheckpointError(f"no intact checkpoint under {root}: " + " | ".join(choice.skipped))
        return None
    load_from(choice.path, trainer, data=data)
    return choice.step


def latest_valid_everywhere(root: Path) -> mf.Choice:
    """`manifest.latest_valid` with the verification shared by every rank (collective): each checks the
    files written by its share of the saving ranks, and all learn every problem."""
    candidates = _broadcast(mf.list_step_dirs(root) if env.rank() == 0 else None)
    return mf.latest_valid(root, warn=env.rank() == 0, check=_verify_shared, candidates=candidates)


def _verify_shared(path: Path) -> list[str]:
    problems = mf.verify(path, share=(env.rank(), env.world_size()))
    if not distributed():
        return problems
    everyone: list[list[str] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, problems)
    return list(dict.fromkeys(problem for found in everyone for problem in found or []))


def load_from(path: str | Path, trainer: Trainer, *, data: Any = None) -> None:
    """Load one (verified) checkpoint directory into the trainer and `data`; collective. A weights-only
    checkpoint (`loom checkpoint import`) sets the parameters and the step count alone.

    Any optimizer level's checkpoint loads at any level, on any mesh: DCP reshards the per-parameter states;
    at levels 1-3 each rank reads its own chunks of them when the optimizer builds them (the first step).
    Nothing read runs code: a file holding anything but checkpoint data is a `CheckpointError` (safe.py).
    """
    path = mf.require_checkpoint(path)
    manifest = mf.read_manifest(path)
    model, optimizer = trainer.model, trainer.optimizer
    st.require_unbuilt(optimizer)
    if manifest.get("kind") == mf.WEIGHTS:  # `loom checkpoint import`: a model to start training from
        load_model_weights(path, model)
        trainer.step = int(manifest.get("step", 0))
        return
    metadata = read_metadata(path / "dcp" / METADATA)
    _refuse_rank_local_zero(path, manifest, metadata)
    state = st.load_template(model, optimizer, metadata)
    read = _reader(path)
    read(state)
    if not _read_in_place(model, state["model"]):
        model.load_state_dict(state["model"])
    st.load_optimizer_state(model, optimizer, state, metadata, read)
    shared = load_torch_file(path / "train_state.pt")
    _load_shared(trainer, data, shared)
    _load_rank(path, manifest, seeded=getattr(trainer, "rng", None) is not None)


def _read_in_place(model: nn.Module, read: dict[str, Any]) -> bool:
    """Whether DCP read every entry of the model's state straight into the model's own tensors (the template
    is `model.state_dict()`, whose tensors share the parameters' and buffers' memory), so that
    `load_state_dict` would only copy each tensor onto itself."""
    own = model.state_dict()
    return own.keys() == read.keys() and all(_same_memory(own[key], value) for key, value in read.items())


def _same_memory(a: Any, b: Any) -> bool:
    if not (torch.is_tensor(a) and torch.is_tensor(b)):
        return False
    a, b = (t.to_local() if isinstance(t, DTensor) else t for t in (a, b))
    return (
        a.data_ptr() == b.data_ptr()
        and a.shape == b.shape
        and a.stride() == b.stride()
        and a.dtype == b.dtype
    )


def _reader(path: Path) -> Callable[[dict[str, Any]], None]:
    """Reads a template state (DTensors, tensors, `Pieces`) from checkpoint `path`, in place (collective).

    Each rank plans and reads its own part alone (DCP's collective planning only gathers and scatters
    plans that load planning never changes); one agreement then makes any rank's failure every rank's
    `CheckpointError`."""

    def read(state: dict[str, Any]) -> None:
        error = None
        try:
            with warnings.catch_warnings():  # DCP's notice that it reads without collectives: intended
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")
                dcp.load(
                    state,
                    storage_reader=DirectReader(path / "dcp"),
                    planner=PiecesLoadPlanner(),
                    no_dist=True,
                )
        except SAVE_ERRORS as exc:
            error = describe(exc)
        error, _ = agree(error, {})
        if error is not None:
            raise CheckpointError(f"loading {path} failed ({error})")

    return read


def _refuse_rank_local_zero(path: Path, manifest: dict[str, Any], metadata: Metadata) -> None:
    """Checkpoints of levels 1-3 written before optimizer states went into DCP kept them in the rank files;
    this version cannot read those (rather than resume silently with fresh states)."""
    if manifest.get("optimizer_level", 0) == 0 or st.saved_optimizer_states(metadata):
        return
    rank_file = load_torch_file(path / "rank_00000.pt")
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
    rank_state = load_torch_file(path / f"rank_{env.rank():05d}.pt")
    st.load_rng_state(rank_state["rng"])


def load_model_weights(path: str | Path, model: nn.Module) -> None:
    """Only the parameters of one checkpoint directory into `model` (any layout, or a plain model on one
    process): DCP reshards them to whatever `model` holds."""
    path = mf.require_checkpoint(path)
    read_metadata(path / "dcp" / METADATA)  # a clear error here, where DCP would try other files first
    state = {"model": st.model_state(model)}
    with _full_parameters(model):
        try:
            with warnings.catch_warnings():  # DCP's notice when it reads on one process: intended
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")
                dcp.load(
                    state,
                    storage_reader=SafeReader(path / "dcp"),
                    planner=SafeLoadPlanner(),
                    no_dist=not distributed(),
                )
        except CheckpointException as exc:
            raise CheckpointError(f"loading the weights of {path} failed ({describe(exc)})") from None
        model.load_state_dict(state["model"])
