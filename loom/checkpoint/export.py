"""One checkpoint's model as a single unsharded file, and such a file back as a checkpoint.

    export_model("runs/ckpt/step_000100", "model.safetensors")   # + model.config.json, the [model] config
    export_hf("runs/ckpt/step_000100", "runs/hf")                # a Hugging Face model's run: a directory
    import_model("model.safetensors", "runs/init")               # -> runs/init/step_000000/ (weights only)

An exported `.safetensors` file is what plain PyTorch reads: `safetensors.torch.load_file` gives name ->
tensor for `model.load_state_dict` of an unsharded model; its metadata holds the step and the model config
(JSON). `.pt`, `.pth` and `.bin` are written with `torch.save`; any other suffix is refused. Exports are
created with the permissions the user's umask gives new files. An imported checkpoint holds only the model:
`dcp/` (the same keys `save_checkpoint` writes, so `load_model_weights` reshards it onto any mesh),
`plan.json` and a manifest with `"kind": "weights"`; it has no optimizer or data state to resume a run from.
A run of a Hugging Face model also exports as a directory (`config.json` + `model.safetensors`) that
`from_pretrained` loads.
"""

from __future__ import annotations

import json
import os
import shutil
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from safetensors.torch import save_file
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from loom.checkpoint import manifest as mf
from loom.checkpoint.manifest import CheckpointError
from loom.checkpoint.safe import SafeLoadPlanner, SafeReader, load_torch_file
from loom.plan import Plan

PREFIX = "model."
SAFETENSORS = ".safetensors"
TORCH_SUFFIXES = (".pt", ".pth", ".bin")  # what `export_model` writes with torch.save
EXPORT_SUFFIXES = (SAFETENSORS, *TORCH_SUFFIXES)
# The manifest's "kind": what a checkpoint directory holds ("full" when absent, as save_checkpoint writes).
FULL, WEIGHTS = mf.FULL, mf.WEIGHTS


def read_model_tensors(checkpoint: str | Path) -> dict[str, torch.Tensor]:
    """Every model tensor of a checkpoint directory, whole (resharded from any mesh), on this process.
    Nothing read runs code (see safe.py)."""
    checkpoint = mf.require_checkpoint(checkpoint)
    reader = SafeReader(checkpoint / "dcp")
    metadata = reader.read_metadata().state_dict_metadata
    tensors = {
        key.removeprefix(PREFIX): torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
        for key, meta in metadata.items()
        if key.startswith(PREFIX) and isinstance(meta, TensorStorageMetadata)
    }
    state = {"model": tensors}
    try:
        with warnings.catch_warnings():  # DCP's notice that it reads on one process: that is the intent here
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state, storage_reader=reader, planner=SafeLoadPlanner(), no_dist=True)
    except CheckpointException as exc:
        failures = "; ".join(f"{type(e).__name__}: {e}" for e, _ in exc.failures.values())
        raise CheckpointError(f"reading the model of {checkpoint} failed ({failures})") from None
    return state["model"]


def config_path(tensor_file: str | Path) -> Path:
    """Where the model config of an exported file lives: `model.safetensors` -> `model.config.json`."""
    return Path(tensor_file).with_suffix(".config.json")


# ---- export --------------------------------------------------------------------------------------------


def export_model(checkpoint: str | Path, out: str | Path) -> int:
    """Write the model's parameters of `checkpoint` to `out`, whole; returns the number of tensors.

    `out` ending in `.safetensors`: a safetensors file whose metadata holds "step" and "config" (the JSON
    of plan.json's config -> model section; "plan", the whole plan, when there is no config). `.pt`, `.pth`,
    `.bin`: a `torch.save` file of name -> tensor; any other suffix is a `CheckpointError`. When the
    checkpoint carries a config, it is also written next to `out` as `<stem>.config.json` (what
    `import_model` reads back). Files appear whole or not at all, readable as the umask says.
    """
    checkpoint, out = Path(checkpoint), check_export_target(out)
    tensors = read_model_tensors(checkpoint)
    plan = _read_plan(checkpoint)
    config = _model_config(plan)
    if out.suffix == SAFETENSORS:
        save_safetensors(tensors, out, _export_metadata(checkpoint, plan, config))
    else:
        _replace_with(out, lambda tmp: torch.save(tensors, tmp))
    if config is not None:
        mf.write_atomic(config_path(out), (json.dumps(config, indent=1, sort_keys=True) + "\n").encode())
    return len(tensors)


def export_hf(checkpoint: str | Path, out: str | Path, hf_config: str | Path | None = None) -> int:
    """Write the Hugging Face model of `checkpoint` (a run with `[model] hf_config` or `hf_pretrained`) as a
    directory that `transformers.AutoModelForCausalLM.from_pretrained(out)` loads: `config.json` (the model's
    Hugging Face config, from `hf_config` when given, else the file the run named) and `model.safetensors`
    (every parameter whole). `out` is created if missing; returns the number of tensors."""
    checkpoint, out = Path(checkpoint), Path(out)
    source = Path(hf_config) if hf_config is not None else hf_config_file(checkpoint)
    if source is None:
        raise CheckpointError(
            f"{checkpoint}: its model is loom's GPT, not a Hugging Face model ([model] hf_config or "
            "hf_pretrained), so it has no Hugging Face export; export it to a file, e.g. model.safetensors"
        )
    if not source.is_file():
        raise CheckpointError(
            f"{source}: the Hugging Face config of {checkpoint}'s model is missing; restore it, or give one "
            "with --hf-config PATH"
        )
    if out.exists() and not out.is_dir():
        raise CheckpointError(f"{out}: is a file; a Hugging Face export is a directory, give a new path")
    tensors = read_model_tensors(checkpoint)
    out.mkdir(parents=True, exist_ok=True)
    metadata = {"format": "pt"}  # what Hugging Face loaders look for
    step = _checkpoint_step(checkpoint)
    if step is not None:
        metadata["step"] = str(step)
    save_safetensors(tensors, out / "model.safetensors", metadata)
    mf.write_atomic(out / "config.json", source.read_bytes())
    return len(tensors)


def hf_config_file(checkpoint: str | Path) -> Path | None:
    """The Hugging Face config.json that the run of `checkpoint` built its model from (as the run named it;
    it may have moved since); None when the model is loom's GPT."""
    model = _model_config(_read_plan(Path(checkpoint)))
    model = model if isinstance(model, dict) else {}
    if model.get("hf_pretrained"):
        return Path(model["hf_pretrained"]) / "config.json"
    if model.get("hf_config"):
        return Path(model["hf_config"])
    return None


def check_export_target(out: str | Path) -> Path:
    """`out` as a file `export_model` can write; `CheckpointError` naming it and the fix otherwise (an
    unknown suffix, a directory, a missing parent directory)."""
    out = Path(out)
    if out.suffix not in EXPORT_SUFFIXES:
        found = f"suffix {out.suffix!r}" if out.suffix else "no suffix"
        raise CheckpointError(
            f"{out}: {found}; export writes {SAFETENSORS} (safetensors) or {', '.join(TORCH_SUFFIXES)} "
            f"(torch.save): name the file e.g. {out.with_suffix(SAFETENSORS).name}"
        )
    if out.is_dir():
        raise CheckpointError(
            f"{out}: is a directory; give a file to write, e.g. {out / 'model.safetensors'}"
        )
    if not out.parent.is_dir():
        raise CheckpointError(f"{out}: its directory {out.parent} does not exist; create it first")
    return out


def _read_plan(checkpoint: Path) -> dict[str, Any]:
    """plan.json of a checkpoint ({} when it has none, e.g. one saved by an older loom)."""
    path = checkpoint / "plan.json"
    if not path.is_file():
        return {}
    try:
        plan = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path}: corrupt JSON ({exc})") from None
    return plan if isinstance(plan, dict) else {}


def saved_plan(checkpoint: str | Path) -> Plan | None:
    """The `loom.plan.Plan` of the run that saved `checkpoint` (plan.json's "plan"); None for a checkpoint
    saved without one (an older loom, an imported weights file). A broken one is a `CheckpointError`."""
    path = Path(checkpoint) / "plan.json"
    data = _read_plan(Path(checkpoint)).get("plan")
    if data is None:
        return None
    try:
        return Plan.from_dict(data, str(path))
    except ValueError as exc:
        raise CheckpointError(f"{path}: not a loadable plan ({exc})") from None


def _model_config(plan: dict[str, Any]) -> Any:
    """The model's config in a plan: the [model] section of a TrainConfig, or the whole config otherwise."""
    config = plan.get("config")
    if isinstance(config, dict) and isinstance(config.get("model"), dict):
        return config["model"]
    return config


def _checkpoint_step(checkpoint: Path) -> int | None:
    """The manifest's step, else the number in a `step_N` name (None when neither says)."""
    try:
        return int(mf.read_manifest(checkpoint)["step"])
    except (CheckpointError, KeyError, TypeError, ValueError):
        return mf.step_of(checkpoint.name)


def _export_metadata(checkpoint: Path, plan: dict[str, Any], config: Any) -> dict[str, str]:
    """safetensors metadata (strings only). "format": "pt" is what Hugging Face loaders look for."""
    metadata = {"format": "pt"}
    step = _checkpoint_step(checkpoint)
    if step is not None:
        metadata["step"] = str(step)
    if config is not None:
        metadata["config"] = json.dumps(config, sort_keys=True)
    elif plan:
        metadata["plan"] = json.dumps(plan, sort_keys=True, default=str)
    return metadata


def save_safetensors(
    tensors: dict[str, torch.Tensor], out: str | Path, metadata: dict[str, str] | None = None
) -> None:
    """Write name -> tensor as a safetensors file, whole or not at all. Unlike `save_file` it takes any
    state dict: tensors sharing memory (tied weights under two names, views) and non-contiguous ones are
    copied as needed, since safetensors stores each tensor on its own."""
    _replace_with(Path(out), lambda tmp: save_file(_unshared(tensors), tmp, metadata=metadata))


def _unshared(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Contiguous tensors, no two on one storage: safetensors refuses shared memory (tied weights saved
    under two names, views), so every later tensor on an already seen storage is copied."""
    seen: set[int] = set()
    result = {}
    for name, tensor in tensors.items():
        tensor = tensor.detach()
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if not tensor.is_contiguous() or (storage.nbytes() and key in seen):
            tensor = tensor.clone(memory_format=torch.contiguous_format)
        elif storage.nbytes():
            seen.add(key)
        result[name] = tensor
    return result


def _replace_with(out: Path, write: Any) -> None:
    """`write(tmp)` then rename over `out`: a failed export never leaves a half-written file behind."""
    tmp = out.with_name(out.name + ".partial")
    try:
        write(tmp)
        os.chmod(tmp, 0o666 & ~_umask())  # safetensors creates its files 0600 whatever the umask
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)


def _umask() -> int:
    """This process's umask (read from /proc where it can be, without changing it)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


# ---- import --------------------------------------------------------------------------------------------


def import_model(
    source_file: str | Path, checkpoint_dir: str | Path, *, step: int | None = None, config: Any = None
) -> Path:
    """Write the tensors of `source_file` (`.safetensors`, or a `torch.save` file of name -> tensor) as a
    weights-only loom checkpoint; returns its directory.

    `checkpoint_dir` is a checkpoint root: the checkpoint becomes `checkpoint_dir/step_{step:06d}` (step 0
    by default), where `loom checkpoint ls`, `export` and `latest_valid` find it. A path that is itself
    named `step_N` is taken as the checkpoint directory (step N). The model config comes from `config`
    (the [model] section, or a whole TrainConfig dict), else from `<stem>.config.json` beside the source,
    else from the safetensors metadata. Written into a temporary directory, manifest last, then renamed
    into place; `CheckpointError` (naming the file) for an unreadable source or an existing target.
    Call it on one process. Import into a root of its own, not a run's checkpoint root: resuming a run
    needs the optimizer and data state that a weights-only checkpoint does not have.
    """
    source = Path(source_file)
    tensors, metadata = _read_tensor_file(source)
    step, final = _import_target(Path(checkpoint_dir), step)
    if final.exists():
        raise CheckpointError(f"{final}: already exists; import into another directory or step")
    if config is None:
        config = _sidecar_config(source) or _metadata_config(source, metadata)
    plan: dict[str, Any] = {"kind": WEIGHTS, "world_size": 1, "source": str(source.resolve())}
    if config is not None:
        # plan.json holds a TrainConfig dict, as `loom train` saves it: the model config is its [model]
        whole = isinstance(config, dict) and isinstance(config.get("model"), dict)
        plan["config"] = config if whole else {"model": config}
    _write_weights_checkpoint(final, step, tensors, plan)
    return final


def _read_tensor_file(source: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """name -> tensor from a safetensors or torch.save file, and the safetensors metadata ({} for .pt). A
    torch.save file is read with torch's weights-only unpickler: a file from elsewhere runs no code."""
    fix = f"import takes a {SAFETENSORS} file or a torch.save file ({', '.join(TORCH_SUFFIXES)}) of name -> tensor"
    if source.is_dir():
        raise CheckpointError(f"{source}: is a directory; {fix}")
    if not source.is_file():
        raise CheckpointError(f"{source}: no such file; {fix}")
    if source.suffix != SAFETENSORS:
        tensors = load_torch_file(source, fix=fix)
        _check_tensors(source, tensors)
        return tensors, {}
    try:
        with safe_open(source, framework="pt") as file:
            metadata = file.metadata() or {}
            tensors = {name: file.get_tensor(name) for name in file.keys()}  # noqa: SIM118 (not a dict)
    except Exception as exc:  # header and I/O errors come in many types; all mean "unreadable"
        raise CheckpointError(
            f"{source}: not a readable safetensors file ({type(exc).__name__}: {exc}); {fix}"
        ) from None
    _check_tensors(source, tensors)
    return tensors, metadata


def _check_tensors(source: Path, tensors: Any) -> None:
    """A non-empty dict of str -> plain tensor, or `CheckpointError` naming the first offending entry."""
    if not isinstance(tensors, dict):
        raise CheckpointError(f"{source}: holds a {type(tensors).__name__}, not a dict of name -> tensor")
    if not tensors:
        raise CheckpointError(f"{source}: holds no tensors")
    for name, value in tensors.items():
        if not isinstance(name, str):
            raise CheckpointError(f"{source}: key {name!r} is not a string (names must be parameter names)")
        if not isinstance(value, torch.Tensor):
            raise CheckpointError(f"{source}: {name!r} holds a {type(value).__name__}, not a tensor")


def _import_target(path: Path, step: int | None) -> tuple[int, Path]:
    """(step, checkpoint directory) for an import into `path` (a root, or a `step_N` directory)."""
    if path.exists() and not path.is_dir():
        raise CheckpointError(
            f"{path}: is a file; import into a directory (a checkpoint root, which gets step_NNNNNN/ inside, "
            "or a step_N directory)"
        )
    named = mf.step_of(path.name)
    if named is None:
        step = 0 if step is None else step
        if step < 0:
            raise CheckpointError(f"step {step}: must be >= 0")
        return step, path / mf.step_dir_name(step)
    if step is not None and step != named:
        raise CheckpointError(f"{path}: named for step {named}, but step {step} was asked for")
    return named, path


def _sidecar_config(source: Path) -> Any:
    """The config in `<stem>.config.json` beside the source (None when there is none)."""
    path = config_path(source)
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path}: corrupt JSON ({exc})") from None


def _metadata_config(source: Path, metadata: dict[str, str]) -> Any:
    """The config that `export_model` put in a safetensors file's metadata (None when absent)."""
    if "config" not in metadata:
        return None
    try:
        return json.loads(metadata["config"])
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{source}: metadata 'config' is not JSON ({exc})") from None


def _write_weights_checkpoint(
    final: Path, step: int, tensors: dict[str, torch.Tensor], plan: dict[str, Any]
) -> None:
    """dcp/ and plan.json into a temporary directory, manifest last, then rename into place (as
    `save_checkpoint` publishes): a reader never sees a half-written checkpoint."""
    temp = final.parent / mf.temp_dir_name(step)  # what `prune` clears should an import die half-way
    shutil.rmtree(temp, ignore_errors=True)
    (temp / "dcp").mkdir(parents=True)
    try:
        with warnings.catch_warnings():  # DCP's notice that it writes on one process: that is the intent
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            # {"model": ...} flattens to "model.<name>" keys, exactly as save_checkpoint's model state
            dcp.save({"model": tensors}, checkpoint_id=temp / "dcp", no_dist=True)
        (temp / "plan.json").write_text(json.dumps(plan, indent=1, default=str))
        mf.write_manifest(temp, {"step": step, "saved_at": time.time(), **plan})
        mf.publish(temp, final)
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        raise
