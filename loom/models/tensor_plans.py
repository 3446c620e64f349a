"""Megatron's tensor-parallel layouts for known model families, as module plans (data, no code).

Each plan is a `module_plan` for `loom.parallelize(model, mode="semi_auto", module_plan=...)`: attention's
query/key/value and the MLP's first matrices cut by output features along the mesh's "tp" axis (column
parallel), the attention output and the MLP's last matrix cut by input features (row parallel, their
partial sums reduced once per block), the embedding cut by vocabulary rows, and the head by vocabulary.
On a mesh without "tp" every entry means "not cut". `torch.nn.Linear` stores weights as (out, in);
Hugging Face GPT-2's `Conv1D` as (in, out), hence the transposed entries.
"""

from __future__ import annotations

from typing import Any

from torch import nn

__all__ = ["TENSOR_PLANS", "tensor_plan"]

# Rows of the batch along "dp"; a row-parallel output summed right away (Megatron's one all-reduce per
# row-parallel matrix), so that the residual stream stays whole along "tp" rather than a pending sum that
# every later operator would have to reduce.
WHOLE = (("dp", "None", "None"),)
COLUMN = {"parameter_plan": {"weight": ("tp", "None")}}
ROW = {"parameter_plan": {"weight": ("None", "tp")}, "out_strategy": WHOLE}
# The embedding's partial rows are summed once, right away (Megatron's all-reduce after a vocab-parallel
# embedding): its output is the batch cut along "dp", whole along "tp".
VOCAB_ROWS = {"parameter_plan": {"weight": ("tp", "None")}, "out_strategy": WHOLE}

_LLAMA = {
    "*.embed_tokens": VOCAB_ROWS,
    "*.self_attn.q_proj": COLUMN,
    "*.self_attn.k_proj": COLUMN,
    "*.self_attn.v_proj": COLUMN,
    "*.self_attn.o_proj": ROW,
    "*.mlp.gate_proj": COLUMN,
    "*.mlp.up_proj": COLUMN,
    "*.mlp.down_proj": ROW,
    "lm_head": COLUMN,
}

# GPT-2's attention projects query, key and value with one fused matrix and splits its output in three,
# so a column cut of it is gathered at the split (DTensor's rule); its MLP and projections are Megatron's.
_GPT2 = {
    "*.wte": VOCAB_ROWS,
    "*.attn.c_attn": {"parameter_plan": {"weight": ("None", "tp"), "bias": ("tp",)}},
    "*.attn.c_proj": {"parameter_plan": {"weight": ("tp", "None")}, "out_strategy": WHOLE},
    "*.mlp.c_fc": {"parameter_plan": {"weight": ("None", "tp"), "bias": ("tp",)}},
    "*.mlp.c_proj": {"parameter_plan": {"weight": ("tp", "None")}, "out_strategy": WHOLE},
}

# Mixtral: attention as Llama's; the router and the experts stay replicated (no expert parallelism yet)
# and run on each rank's own tokens (a local region: their routing has data-dependent shapes).
_MIXTRAL = {
    "*.embed_tokens": VOCAB_ROWS,
    "*.self_attn.q_proj": COLUMN,
    "*.self_attn.k_proj": COLUMN,
    "*.self_attn.v_proj": COLUMN,
    "*.self_attn.o_proj": ROW,
    "*.mlp.experts": {"local": True},
    "lm_head": COLUMN,
}

TENSOR_PLANS: dict[str, dict[str, Any]] = {"llama": _LLAMA, "gpt2": _GPT2, "mixtral": _MIXTRAL}
"""Model family (Hugging Face `config.model_type`) -> module plan."""


def tensor_plan(model: nn.Module) -> dict[str, Any]:
    """The Megatron module plan of `model`'s family (from `model.config.model_type`), or a clear error."""
    family = getattr(getattr(model, "config", None), "model_type", None)
    if family not in TENSOR_PLANS:
        raise ValueError(
            f"no tensor-parallel plan is known for {type(model).__name__} (model_type {family!r}); known: "
            f"{sorted(TENSOR_PLANS)}. Give its modules strategies yourself: "
            f"parallelize(model, mode='semi_auto', module_plan={{'*.q_proj': {{'parameter_plan': "
            f"{{'weight': ('tp', 'None')}}}}, ...}})"
        )
    return TENSOR_PLANS[family]
