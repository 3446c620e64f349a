"""Hugging Face causal language models for `loom train`: built offline from a `config.json`, or loaded from a
local directory of safetensors weights, each rank reading only its own slices of the parameters.

    config = read_config("runs/tiny-llama/config.json", "model.hf_config")
    model = build_model(config, seed=0)                  # random weights, as `from_config` makes them
    model = empty_model(config)                          # parameters on the meta device, buffers real
    ...parallelise and materialise the empty model, then
    load_weights(model, "runs/tiny-llama")               # each parameter's local slice, one at a time

The model is never edited: `train_on_token_pairs` adds forward hooks so that `model(inputs, targets)` returns
the mean next-token cross entropy, as loom's Trainer calls loom's GPT; any other call is left alone. `greedy`
decodes from any causal LM given a function from token ids to logits.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard

__all__ = [
    "WEIGHTS_INDEX",
    "build_model",
    "causal_lm_class",
    "empty_model",
    "greedy",
    "load_weights",
    "model_shape",
    "read_config",
    "require_transformers",
    "shifted_causal_lm_loss",
    "train_on_token_pairs",
]

WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"  # what save_pretrained writes beside sharded weights


def require_transformers() -> Any:
    """The `transformers` module, or a ValueError saying how to install it."""
    try:
        import transformers
    except ImportError:
        raise ValueError(
            "model.hf_config / model.hf_pretrained need the transformers package; install it with "
            "pip install 'loom[hf]'"
        ) from None
    transformers.logging.set_verbosity_error()  # tiny test vocabularies make some configs warn at length
    return transformers


def read_config(path: str | Path, key: str) -> Any:
    """The Hugging Face config in the JSON file `path` (read offline), checked to describe a causal language
    model; every error names the config `key` that gave the path and says how to fix it."""
    path = Path(path)
    if not path.is_file():
        what = "a directory saved by save_pretrained" if key.endswith("pretrained") else "a config.json"
        raise ValueError(
            f"{key}: {str(path)!r} does not exist; point {key} at {what} of a Hugging Face model"
        )
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{key}: {str(path)!r} is not a JSON file ({exc})") from None
    model_type = data.get("model_type") if isinstance(data, dict) else None
    transformers = require_transformers()
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as CAUSAL

    if model_type not in CAUSAL:
        raise ValueError(
            f"{key}: {str(path)!r} has model_type {model_type!r}, which is not a causal language model "
            f"transformers knows (e.g. 'gpt2', 'llama', 'mistral', 'qwen2'); loom train trains causal LMs only"
        )
    config = transformers.CONFIG_MAPPING[model_type].from_dict(data)
    config.use_cache = False  # training: no key/value cache
    return config


def model_shape(config: Any) -> dict[str, Any]:
    """The `[model]` keys that describe the model, as the Hugging Face `config` gives them (what the config
    checks, the cost model and the plan printout read): shapes, and the norm, positions and MLP kinds as
    loom's GPT names them (RMSNorm when the config has `rms_norm_eps`, rotary when it has rope settings,
    SwiGLU when its activation is SiLU)."""
    heads = config.num_attention_heads
    hidden = config.hidden_size
    ffn = getattr(config, "intermediate_size", None) or getattr(config, "n_inner", None) or 4 * hidden
    return {
        "vocab_size": config.vocab_size,
        "d_model": hidden,
        "n_layers": config.num_hidden_layers,
        "n_heads": heads,
        "n_kv_heads": getattr(config, "num_key_value_heads", None) or heads,
        "d_ff": ffn,
        "max_seq_len": config.max_position_embeddings,
        "tie_embeddings": bool(getattr(config, "tie_word_embeddings", False)),
        "norm": "rmsnorm" if hasattr(config, "rms_norm_eps") else "layernorm",
        "positions": "rotary"
        if any(hasattr(config, k) for k in ("rope_theta", "rope_parameters"))
        else "learned",
        "mlp": "swiglu" if getattr(config, "hidden_act", None) == "silu" else "gelu",
    }


def causal_lm_class(config: Any) -> str:
    """The name of the causal LM class `AutoModelForCausalLM` builds from `config` (e.g. "LlamaForCausalLM")."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as CAUSAL

    return CAUSAL[config.model_type]


def build_model(config: Any, seed: int) -> nn.Module:
    """The causal LM of `config` with the random weights `from_config` gives after `torch.manual_seed(seed)`
    (the same on every rank), in fp32."""
    transformers = require_transformers()
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)


def empty_model(config: Any) -> nn.Module:
    """The causal LM of `config` with its parameters on the meta device (no memory, no values) and its
    buffers (rotary tables, masks) computed on the CPU: lay it out, materialise it, then `load_weights`."""
    transformers = require_transformers()
    with _parameters_on_meta():
        return transformers.AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)


@contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Inside the block every registered parameter is created on the meta device; buffers are not (they are
    computed from the config when the model is built, and would otherwise be lost)."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None and not param.is_meta:  # one already on meta may be tied: keep it as it is
            module._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


# ---- weights -------------------------------------------------------------------------------------------


def weight_files(directory: str | Path, key: str = "model.hf_pretrained") -> dict[str, Path]:
    """Parameter name -> the safetensors file of `directory` that holds it (one `model.safetensors`, or the
    shards an index lists)."""
    directory = Path(directory)
    index = directory / WEIGHTS_INDEX
    if index.is_file():
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        return {name: directory / file for name, file in weight_map.items()}
    single = directory / WEIGHTS
    if not single.is_file():
        raise ValueError(
            f"{key}: {str(directory)!r} holds neither {WEIGHTS} nor {WEIGHTS_INDEX}; save the model with "
            "save_pretrained (safetensors weights)"
        )
    from safetensors import safe_open

    with safe_open(single, framework="pt") as file:
        return {name: single for name in file.keys()}  # noqa: SIM118 (not a dict)


@torch.no_grad()
def load_weights(model: nn.Module, directory: str | Path, key: str = "model.hf_pretrained") -> None:
    """Fill `model`'s parameters (materialised, plain or DTensor) from the safetensors weights in
    `directory`, file by file: each rank reads only its local slice of each parameter, one at a time."""
    from safetensors import safe_open

    files = weight_files(directory, key)
    wanted = _parameter_sources(model, files, directory, key)
    for path in sorted(set(files.values())):
        with safe_open(path, framework="pt") as file:
            for stored, param in wanted.get(path, []):
                local = param.to_local() if isinstance(param, DTensor) else param
                local.copy_(file.get_slice(stored)[_local_slices(param)])


def _parameter_sources(
    model: nn.Module, files: dict[str, Path], directory: str | Path, key: str
) -> dict[Path, list[tuple[str, torch.Tensor]]]:
    """For each file, the (stored name, parameter) pairs to read from it; a tied parameter is read once, under
    whichever of its names the weights hold (save_pretrained keeps one). A ValueError for a missing one."""
    prefix = getattr(model, "base_model_prefix", "") + "."
    names: dict[int, list[str]] = {}
    params: dict[int, torch.Tensor] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
        params[id(param)] = param
    sources: dict[Path, list[tuple[str, torch.Tensor]]] = {}
    for ident, aliases in names.items():
        candidates = aliases + [a.removeprefix(prefix) for a in aliases if a.startswith(prefix)]
        stored = next((c for c in candidates if c in files), None)
        if stored is None:
            raise ValueError(
                f"{key}: the weights in {str(directory)!r} have no tensor for parameter {aliases[0]!r}; they "
                "must come from the same model family and config as config.json"
            )
        sources.setdefault(files[stored], []).append((stored, params[ident]))
    return sources


def _local_slices(param: torch.Tensor) -> tuple[slice, ...]:
    """The index of this rank's part of `param` in the whole tensor (everything for a plain tensor). Each
    mesh dim with `Shard(d)` cuts dim d as `torch.chunk` does, mesh dims in order (DTensor's layout)."""
    bounds = [(0, size) for size in param.shape]
    if isinstance(param, DTensor):
        mesh = param.device_mesh
        coordinate = mesh.get_coordinate()
        assert coordinate is not None, "a parameter laid out on a mesh this rank is not part of"
        for mesh_dim, placement in enumerate(param.placements):
            if isinstance(placement, Shard):
                start, stop = bounds[placement.dim]
                chunk = -(-(stop - start) // mesh.size(mesh_dim))
                first = min(start + coordinate[mesh_dim] * chunk, stop)
                bounds[placement.dim] = (first, min(first + chunk, stop))
        local = tuple(stop - start for start, stop in bounds)
        assert local == tuple(param.to_local().shape), (local, param.to_local().shape)
    return tuple(slice(start, stop) for start, stop in bounds)


# ---- training and sampling -----------------------------------------------------------------------------


def train_on_token_pairs(model: nn.Module) -> nn.Module:
    """Make `model(inputs, targets)` return the mean cross entropy of predicting `targets` (the inputs
    shifted by one, as loom's data gives them) over every token, as loom's GPT does; returns `model`.

    The loss is the model's own (`labels=`, with `shift_labels=targets` so that no token is dropped), so it
    is computed inside forward, where loom lays out what a parallel model creates. Only a call with exactly
    these two positional tensors changes; any other call (`model(input_ids=ids)`, sampling) is untouched.
    """
    pending: list[bool] = []  # one entry per call in flight: whether it was a (inputs, targets) call

    def before(_: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        pairs = len(args) == 2 and not kwargs and all(isinstance(a, torch.Tensor) for a in args)
        pending.append(pairs)
        if not pairs:
            return None
        inputs, targets = args
        return (), {"input_ids": inputs, "labels": targets, "shift_labels": targets}

    def after(_: nn.Module, __: tuple, output: Any) -> Any:
        return output.loss if pending.pop() else None

    model.register_forward_pre_hook(before, with_kwargs=True, prepend=True)
    model.register_forward_hook(after, prepend=True, always_call=True)
    return model


def shifted_causal_lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The model's own causal LM loss (`ForCausalLMLoss`) of logits (batch, seq, vocab) against `targets`
    already shifted (the inputs moved by one, as loom's data gives them): what `train_on_token_pairs` makes
    the model return, as a pipeline's last stage computes it from its logits."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    return ForCausalLMLoss(logits, None, vocab_size=logits.shape[-1], shift_labels=targets)


def greedy(
    logits_of: Callable[[torch.Tensor], torch.Tensor],
    prompts: list[list[int]],
    max_new_tokens: int,
    window: int,
    multiple: int = 1,
) -> list[list[int]]:
    """The `max_new_tokens` ids a causal LM picks greedily after each of `prompts`, all decoded as one batch.
    `logits_of` maps a (batch, length) tensor of ids to whole logits (batch, length, vocab). Each row feeds
    at most its last `window` ids, right-padded to the longest row and to a multiple of `multiple` (a
    sequence cut over ranks needs it): causality keeps a row's padding out of its answer, so each row's ids
    are those it would get alone (up to the kernels' rounding of a batch).

    Every step feeds the same length, the longest context any step needs: a sharded model then meets one
    shape, which DTensor's sharding propagation computes once instead of once per new length (on a small
    model that is most of the decoding time)."""
    rows = [list(ids) for ids in prompts]
    if window < multiple:
        raise ValueError(
            f"greedy: a window of {window} ids holds no multiple of {multiple}; widen the window"
        )
    window -= window % multiple
    longest = max(map(len, rows), default=0) + max_new_tokens - 1
    length = min(window, longest + -longest % multiple)
    new: list[list[int]] = [[] for _ in rows]
    for _ in range(max_new_tokens):
        contexts = [ids[-window:] for ids in rows]
        batch = torch.tensor([context + [0] * (length - len(context)) for context in contexts])
        logits = logits_of(batch)
        for row, context in enumerate(contexts):
            new[row].append(int(logits[row, len(context) - 1].argmax()))
            rows[row].append(new[row][-1])
    return new
