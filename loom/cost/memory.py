"""Memory per device: model states per optimizer level (ZeRO) and activations per layer (Korthikanti et al.).

Model states, mixed-precision Adam (Rajbhandari et al., "ZeRO", 2020, Section 5.1): with Ψ parameters,
2Ψ bytes of fp16/bf16 parameters, 2Ψ of gradients and KΨ of optimizer states (K = 12: fp32 master copy,
momentum and variance), sharded over Nd data-parallel replicas from optimizer level 1 (states), 2 (plus
gradients) and 3 (plus parameters). That is a run whose optimizer keeps the fp32 master weights beside
16-bit parameters (Megatron-LM, DeepSpeed); its step also makes an fp32 copy of 16-bit gradients, which
the ZeRO paper leaves out: Megatron-LM documents 20 bytes per parameter for fp16 parameters and gradients
without its distributed optimizer, 18 for bf16 parameters with fp32 gradients. A run whose parameters are
the fp32 master weights (torch's autocast, FSDP, loom's runtime) keeps 4 + 4 + 8 (`state_bytes`).
"""

from __future__ import annotations

from loom.cost.compute import DTYPE_BYTES
from loom.cost.plan import (
    OPTIMIZER_LEVELS,
    RECOMPUTE,
    TORCHTITAN_LAYER_EVERY,
    ParallelPlan,
    check_choice,
    check_sizes,
)
from loom.cost.transformer import TransformerConfig, local_linear

__all__ = [
    "GRAD_BYTES",
    "OPTIMIZER_BYTES",
    "cast_weight_bytes",
    "korthikanti_activation_bytes",
    "layer_parameters_per_device",
    "layer_activation_bytes",
    "model_state_bytes",
    "op_sac_saved_bytes",
    "state_bytes",
]

PARAM_BYTES, GRAD_BYTES, OPTIMIZER_BYTES = 2, 2, 12  # mixed-precision Adam, the ZeRO paper's K = 12
FP32_BYTES, MOMENTS_BYTES = 4, 8  # fp32 master weights or gradients; Adam's fp32 momentum and variance


def state_bytes(plan: ParallelPlan) -> dict[str, int]:
    """Bytes per parameter of the parameter, its gradients and its optimizer states under mixed-precision
    Adam for `plan`, by where its fp32 master weights live (`ParallelPlan.master_weights`): keyword arguments
    of `model_state_bytes`.

    Parameters that are the fp32 master weights ("parameters", or fp32 training): 4 + 4 + 8, and at levels 1-2
    of loom's runtime (`moves_master_weights`) the fp32 copy of each rank's chunk its optimizer steps
    (`loom.parallel.zero.BucketShard`), 4 more sharded: 8 + 12/d at level 1, 4 + 16/d at level 2.
    "optimizer": 16-bit parameters, gradients in `grad_precision`, and K = 12 (fp32 master copy, momentum, variance) plus, for
    16-bit gradients, the fp32 copy the step makes of them (Megatron-LM's `main_grad.float()`, DeepSpeed's
    fp32 gradient partitions): 2 + 2 + 16 = 20, or 2 + 4 + 12 = 18.
    """
    param, grads = DTYPE_BYTES[plan.dtype], DTYPE_BYTES[plan.grad_precision]
    if plan.master_weights == "parameters" or param == FP32_BYTES:
        chunk = FP32_BYTES if plan.moves_master_weights and plan.optimizer_level in (1, 2) else 0
        return {"param_bytes": FP32_BYTES, "grad_bytes": FP32_BYTES, "optimizer_bytes": MOMENTS_BYTES + chunk}
    copy = FP32_BYTES if grads < FP32_BYTES else 0
    return {"param_bytes": param, "grad_bytes": grads, "optimizer_bytes": OPTIMIZER_BYTES + copy}


def layer_parameters_per_device(model: TransformerConfig, plan: ParallelPlan) -> tuple[float, float, float]:
    """Parameters of one layer one device holds, as (the weights split over tp: attention, the dense MLP, the
    router; the two norms, whole on every rank; the experts, split over etp x ep)."""
    norms = 2 * model.norm_parameters()
    experts = model.experts * model.mlp_parameters() if model.is_moe else 0
    split = model.layer_parameters() - norms - experts
    return split / plan.tp, norms, experts / (plan.etp * plan.ep)


def cast_weight_bytes(model: TransformerConfig, plan: ParallelPlan) -> tuple[float, float]:
    """Bytes per device of the 16-bit copies autocast makes of the fp32 matmul weights in one forward
    (`ParallelPlan.casts_weights`), as (one layer's, the output projection's); 0 where nothing is cast.
    The norms compute in fp32 and the embedding is a lookup: neither is cast; a tied table is cast for the
    output projection."""
    if not plan.casts_weights:
        return 0.0, 0.0
    split, _, experts = layer_parameters_per_device(model, plan)
    e = DTYPE_BYTES[plan.dtype]
    return e * (split + experts), e * model.vocab * model.hidden / plan.tp


def model_state_bytes(
    params: float, level: int, dp: int, *, param_bytes: int = PARAM_BYTES, grad_bytes: int = GRAD_BYTES,
    optimizer_bytes: int = OPTIMIZER_BYTES,
) -> float:  # fmt: skip
    """Bytes of parameters, gradients and optimizer states on one device at optimizer `level` over `dp` replicas.

    With P, G, K bytes per parameter of parameters, gradients and optimizer states (default the ZeRO
    paper's 2, 2, 12; `state_bytes` gives a plan's): level 0: (P + G + K)Ψ; 1: (P + G)Ψ + KΨ/Nd;
    2: PΨ + (G + K)Ψ/Nd; 3: (P + G + K)Ψ/Nd.
    """
    check_choice("model_state_bytes", "level", level, OPTIMIZER_LEVELS)
    check_sizes("model_state_bytes", {"dp": dp})
    p = params * param_bytes / (dp if level >= 3 else 1)
    g = params * grad_bytes / (dp if level >= 2 else 1)
    o = params * optimizer_bytes / (dp if level >= 1 else 1)
    return p + g + o


def korthikanti_activation_bytes(
    s: int, b: int, h: int, a: int, t: int = 1, *, recompute: str = "none", sequence_parallel: bool = False
) -> float:
    """Bytes of activations one GPT layer stores, by the closed forms of Korthikanti et al. (Table 2)."""
    check_choice("korthikanti_activation_bytes", "recompute", recompute, RECOMPUTE)
    sbh = s * b * h
    if recompute == "full":
        return 2 * sbh / (t if sequence_parallel else 1)
    attention = 0.0 if recompute == "selective" else 5 * a * s / h
    if sequence_parallel:
        return sbh / t * (34 + attention)
    return sbh * (10 + 24 / t + attention / t)


def layer_activation_bytes(
    model: TransformerConfig, s: int, b: int, t: int = 1, *, recompute: str = "none",
    sequence_parallel: bool = False, flash_attention: bool = False, dtype_bytes: int = 2, cp: int = 1,
    attention: str = "ulysses",
) -> float:  # fmt: skip
    """Bytes of activations one layer keeps for backward on one tensor-parallel rank, tensor by tensor; with
    `cp` > 1 on one rank of the cp group (sequences of `s` tokens cut over it, `attention` spanning them)."""
    e, h, d = dtype_bytes, model.hidden, model.head_dim
    tokens = s * b / cp
    local = tokens / t  # tensor-parallel-sharded regions
    replicated = tokens / t if sequence_parallel else tokens  # norms, dropouts: sharded only with SP
    if recompute == "full":
        return e * replicated * h  # only the layer's input
    if recompute == "torchtitan_op":
        return e * replicated * h + op_sac_saved_bytes(model, tokens, t, sequence_parallel, dtype_bytes)
    q, kv = model.heads * d, model.kv * d
    mask = 1 if model.dropout else 0  # one byte per element
    outside = (
        e * h * 4  # norm 1 input, QKV input, norm 2 input, MLP input
        + mask * h * 2  # dropout masks after attention and after the MLP
    ) * replicated
    blockwise = flash_attention or (cp > 1 and attention == "ring")  # no s x s tensors kept
    qkv = e * local * (q + 2 * kv)  # Q and K for the scores, V for the context
    qkv += e * local * q  # input of the output projection
    scores = 0.0
    if recompute in ("none", "torchtitan_layer") and not blockwise:
        # softmax output (and with dropout its mask and the dropped-out probabilities), a·s·s per sequence;
        # Ulysses: a/cp heads of whole sequences on each rank
        scores = (e + (mask + e if model.dropout else 0)) * model.heads * s * s * b / (t * cp)
    f = model.ffn
    # GELU keeps its input and the down projection's input; SwiGLU keeps gate and up outputs and their product
    mlp = e * local * f * (3 if model.gated_mlp else 2) * model.top_k
    kept = outside + qkv + scores + mlp
    if recompute == "torchtitan_layer":  # one layer in TORCHTITAN_LAYER_EVERY keeps its input only: the mean
        return (e * replicated * h + (TORCHTITAN_LAYER_EVERY - 1) * kept) / TORCHTITAN_LAYER_EVERY
    return kept


def op_sac_saved_bytes(
    model: TransformerConfig, tokens: float, t: int = 1, sequence_parallel: bool = False, dtype_bytes: int = 2
) -> float:
    """Bytes of op outputs torchtitan's op-level selective checkpointing keeps for one layer's backward on one
    tensor-parallel rank, besides the layer's input that the checkpoint holds (`TransformerConfig.
    op_sac_matmuls`): the saved matmuls' outputs (a row-parallel one is a partial sum over the whole width),
    the flash attention kernel's output and fp32 log-sum-exp, and with sequence parallelism the two
    reduce-scatters' outputs. Its cache keeps them all until the backward, needed or not (w2's output is)."""
    e, local = dtype_bytes, tokens / t
    matmuls = sum(e * tokens * local_linear(name, k, n, t)[1] for name, k, n in model.op_sac_matmuls()[0])
    attention = e * local * model.heads * model.head_dim + 4 * local * model.heads
    scattered = 2 * e * local * model.hidden if sequence_parallel and t > 1 else 0.0
    return matmuls + attention + scattered
