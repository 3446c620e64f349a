"""The shape of a decoder-only transformer (GPT and Llama families, GQA, SwiGLU, MoE): parameters and FLOPs.

FLOPs follow Megatron's convention, which both validation papers use: only matrix multiplications count,
2 FLOPs per multiply-add, attention scores over the full (not causal-halved) s x s square, backward twice the
forward. For a GPT layer this gives exactly 72·B·s·l·h²·(1 + s/(6h) + V/(12hl)) per iteration.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from loom.cost.plan import PRICED_RECOMPUTE, TORCHTITAN_LAYER_EVERY, WHOLE_LAYER_RECOMPUTES, check_choice
from loom.models.config import NORMS, GPTConfig

__all__ = [
    "Matmul",
    "ROW_PARALLEL",
    "local_linear",
    "TransformerConfig",
    "transformer_config",
    "hf_transformer_config",
    "megatron_model_flops",
    "megatron_parameter_count",
    "megatron_recompute_flops",
]

Matmul = tuple[str, int, int]  # a linear layer: (name, input features, output features)
# the linear layers tensor parallelism cuts by their input features (row-parallel: each rank's output is a
# partial sum of the whole width); the others it cuts by their output features (torchtitan's layer plan)
ROW_PARALLEL: tuple[str, ...] = ("wo", "w2")


def local_linear(name: str, k: float, n: float, tp: int) -> tuple[float, float]:
    """A named linear's (input, output) features on one tensor-parallel rank: a row-parallel one
    (`ROW_PARALLEL`) cut along its input, every other along its output."""
    return (k / tp, n) if name in ROW_PARALLEL else (k, n / tp)


@dataclass(frozen=True, kw_only=True)
class TransformerConfig:
    """A decoder-only transformer. `experts > 1` makes every MLP a mixture of `experts` routed `top_k`."""

    name: str = "custom"
    layers: int
    hidden: int
    heads: int
    vocab: int
    kv_heads: int | None = None  # grouped-query attention; None: as many as `heads`
    ffn_hidden: int | None = None  # None: 4 * hidden
    gated_mlp: bool = False  # SwiGLU: three matrices (gate, up, down) instead of two
    experts: int = 1
    top_k: int = 1
    norm: str = "layernorm"  # or "rmsnorm" (no bias)
    biases: bool = True
    dropout: bool = True  # dropout masks are stored for backward (GPT); Llama trains without dropout
    learned_positions: int = 0  # rows of a learned position embedding (GPT: the sequence length)
    tied_embeddings: bool = True
    fused_qkv: bool = False  # one matrix projects query, key and value, its output split (GPT-2's c_attn)
    head_size: int | None = None  # None: hidden // heads (Qwen3 uses 128 with hidden / heads = 64)

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "heads", "vocab", "experts", "top_k"):
            if getattr(self, name) < 1:
                raise ValueError(f"TransformerConfig {self.name!r}: {name} must be >= 1")
        if self.hidden % self.heads:
            raise ValueError(
                f"TransformerConfig {self.name!r}: hidden {self.hidden} not divisible by heads {self.heads}"
            )
        if self.heads % self.kv:
            raise ValueError(
                f"TransformerConfig {self.name!r}: heads {self.heads} not divisible by kv_heads {self.kv}"
            )
        if self.top_k > self.experts:
            raise ValueError(f"TransformerConfig {self.name!r}: top_k {self.top_k} > experts {self.experts}")
        if self.norm not in NORMS:
            raise ValueError(f"TransformerConfig {self.name!r}: norm must be one of {NORMS}")

    @property
    def kv(self) -> int:
        """Key/value heads."""
        return self.kv_heads or self.heads

    @property
    def ffn(self) -> int:
        """Hidden size of the MLP (of each expert)."""
        return self.ffn_hidden or 4 * self.hidden

    @property
    def head_dim(self) -> int:
        """Size of one attention head."""
        return self.head_size or self.hidden // self.heads

    @property
    def is_moe(self) -> bool:
        """True when the MLPs are mixtures of experts."""
        return self.experts > 1

    def replace(self, **changes) -> TransformerConfig:
        """A copy with some fields changed."""
        return dataclasses.replace(self, **changes)

    # ---- parameters ----
    def attention_parameters(self) -> int:
        """Weights (and biases) of one attention block, without its norm."""
        h, q, kv = self.hidden, self.heads * self.head_dim, 2 * self.kv * self.head_dim
        return h * (q + kv) + q * h + ((q + kv + h) if self.biases else 0)

    def mlp_parameters(self) -> int:
        """Weights (and biases) of one expert's (or the dense) MLP."""
        h, f, mats = self.hidden, self.ffn, 3 if self.gated_mlp else 2
        return mats * h * f + (((mats - 1) * f + h) if self.biases else 0)

    def norm_parameters(self) -> int:
        """Parameters of one norm."""
        return self.hidden * (2 if self.norm == "layernorm" else 1)

    def layer_parameters(self) -> int:
        """Parameters of one transformer layer (all experts, the router, two norms)."""
        router = self.hidden * self.experts if self.is_moe else 0
        return (
            self.attention_parameters()
            + self.experts * self.mlp_parameters()
            + router
            + 2 * self.norm_parameters()
        )

    def embedding_parameters(self) -> int:
        """Token (and learned position) embedding."""
        return (self.vocab + self.learned_positions) * self.hidden

    def output_parameters(self) -> int:
        """Final norm and, when not tied to the embedding, the output projection."""
        return self.norm_parameters() + (0 if self.tied_embeddings else self.vocab * self.hidden)

    def parameter_count(self) -> int:
        """All parameters of the model."""
        return self.layers * self.layer_parameters() + self.embedding_parameters() + self.output_parameters()

    def active_parameter_count(self) -> int:
        """Parameters one token uses (MoE: only `top_k` experts)."""
        inactive = (self.experts - self.top_k) * self.mlp_parameters() * self.layers
        return self.parameter_count() - inactive

    # ---- FLOPs ----
    def layer_forward_flops_per_token(self, seq: int) -> dict[str, float]:
        """Forward matmul FLOPs of one layer for one token: 'dense' (projections, MLP) and 'attention' (core)."""
        h, d = self.hidden, self.head_dim
        q, kv = self.heads * d, 2 * self.kv * d
        mats = 3 if self.gated_mlp else 2
        mlp = 2 * mats * h * self.ffn * self.top_k + (2 * h * self.experts if self.is_moe else 0)
        dense = 2 * h * (q + kv) + 2 * q * h + mlp
        attention = 2 * 2 * seq * q  # Q·K^T and softmax·V over the whole s x s square
        return {"dense": float(dense), "attention": float(attention)}

    def logits_forward_flops_per_token(self) -> float:
        """Forward FLOPs of the output projection for one token."""
        return 2.0 * self.hidden * self.vocab

    def model_flops(self, batch: int, seq: int) -> float:
        """Model FLOPs of one training iteration (forward + backward, no recomputation) on batch x seq tokens."""
        layer = self.layer_forward_flops_per_token(seq)
        per_token = (
            self.layers * (layer["dense"] + layer["attention"]) + self.logits_forward_flops_per_token()
        )
        return 3.0 * per_token * batch * seq

    def op_sac_matmuls(self) -> tuple[list[Matmul], list[Matmul]]:
        """One layer's linear layers as (name, input features, output features) in the order its forward runs
        them, split into those torchtitan's op-level selective checkpointing saves and those it recomputes.

        Its policy (`torchtitan/parallelisms/parallelize_llama.py` at 395a526, `_custom_policy` with
        `no_recompute_list`) saves the outputs of `aten.mm`, of the flash and memory-efficient attention
        kernels and of the functional reduce-scatter, "except every second mm", counting the layer's mm calls
        from 1 (a fresh count per checkpointed layer and per mode: forward and recompute); every other op is
        recomputed. The Llama forward calls wq, wk, wv (`Attention.forward`), wo, then w1, w3, w2
        (`FeedForward.forward`: `w2(silu(w1(x)) * w3(x))`), so wq, wv, w1 and w2 are saved, wk, wo and w3
        recomputed. Bias-free linears only: a linear with a bias runs `aten.addmm`, which the policy neither
        counts nor saves; and no mixture of experts (torchtitan's Llama had none)."""
        if self.is_moe or self.biases or self.fused_qkv:
            raise ValueError(
                f"{self.name!r} is not torchtitan's dense, bias-free Llama layer (separate wq, wk, wv, no "
                "experts), which torchtitan's op-level checkpointing counts: price it with none, selective or full"
            )
        h, q, kv, f = self.hidden, self.heads * self.head_dim, self.kv * self.head_dim, self.ffn
        mlp = [("w1", h, f), ("w3", h, f), ("w2", f, h)] if self.gated_mlp else [("w1", h, f), ("w2", f, h)]
        order = [("wq", h, q), ("wk", h, kv), ("wv", h, kv), ("wo", q, h), *mlp]
        return order[0::2], order[1::2]  # the 1st, 3rd, ... mm saved; the 2nd, 4th, ... recomputed

    def recompute_flops(self, batch: int, seq: int, recompute: str, *, skip_mlp_out: bool = False) -> float:
        """Extra forward FLOPs that recomputation adds: the whole layers ('full', or one in
        `TORCHTITAN_LAYER_EVERY` for 'torchtitan_layer'; less the MLP's output
        projection with `skip_mlp_out`: `loom.cost.layer.skips_mlp_out`), attention cores ('selective') or the
        matmuls torchtitan's op-level policy does not save ('torchtitan_op': its fused attention kernel is
        saved)."""
        check_choice("recompute_flops", "recompute", recompute, PRICED_RECOMPUTE)
        if recompute == "none":
            return 0.0
        layer = self.layer_forward_flops_per_token(seq)
        if recompute == "torchtitan_op":
            per_layer = sum(2.0 * k * n for _, k, n in self.op_sac_matmuls()[1])
        elif recompute in WHOLE_LAYER_RECOMPUTES:
            per_layer = layer["dense"] + layer["attention"]
            if skip_mlp_out:
                per_layer -= 2.0 * self.ffn * self.hidden
            if recompute == "torchtitan_layer":  # every TORCHTITAN_LAYER_EVERY-th layer
                per_layer /= TORCHTITAN_LAYER_EVERY
        else:
            per_layer = layer["attention"]
        return per_layer * self.layers * batch * seq

    def hardware_flops(self, batch: int, seq: int, recompute: str, *, skip_mlp_out: bool = False) -> float:
        """FLOPs the devices execute, recomputation included (`skip_mlp_out`: see `recompute_flops`)."""
        flops = self.recompute_flops(batch, seq, recompute, skip_mlp_out=skip_mlp_out)
        return self.model_flops(batch, seq) + flops


def transformer_config(config: GPTConfig, name: str = "gpt") -> TransformerConfig:
    """loom's GPT as the cost model sees it: the one conversion that `loom simulate CONFIG.toml` and the
    trainer's predictions share. Its projections have no biases (only LayerNorm has one) and it keeps the
    s x s attention scores (no fused attention)."""
    return TransformerConfig(
        name=name,
        layers=config.n_layers,
        hidden=config.d_model,
        heads=config.n_heads,
        vocab=config.vocab_size,
        kv_heads=config.kv_heads,
        ffn_hidden=config.ff_dim,
        gated_mlp=config.mlp == "swiglu",
        norm=config.norm,
        biases=False,
        dropout=config.dropout > 0,
        learned_positions=config.max_seq_len if config.positions == "learned" else 0,
        tied_embeddings=config.tie_embeddings,
        experts=config.experts,
        top_k=config.top_k if config.is_moe else 1,
    )


# Hugging Face model types whose attention projects query, key and value with one matrix (GPT-2's Conv1D
# `c_attn`), and whose every projection has a bias
FUSED_QKV_TYPES = ("gpt2",)


def hf_transformer_config(config: Any, name: str | None = None) -> TransformerConfig:
    """A Hugging Face model's config as the cost model sees it: the shape `loom.models.hf.model_shape`
    reads (the `[model]` keys, through loom's GPT's conversion), plus what that shape leaves out: biases
    (GPT-2's projections, Llama's `attention_bias`) and GPT-2's fused query/key/value matrix."""
    from loom.models.hf import model_shape

    model_type = getattr(config, "model_type", "")
    fused = model_type in FUSED_QKV_TYPES
    base = transformer_config(GPTConfig.from_dict(model_shape(config)), name=name or model_type or "hf")
    return base.replace(
        biases=fused or bool(getattr(config, "attention_bias", False)),
        fused_qkv=fused,
        dropout=any(getattr(config, key, 0.0) for key in ("resid_pdrop", "attention_dropout")),
    )


def megatron_model_flops(batch: int, seq: int, layers: int, hidden: int, vocab: int) -> float:
    """72·B·s·l·h²·(1 + s/(6h) + V/(12·h·l)): model FLOPs per iteration (Narayanan et al. 2021)."""
    b, s, ll, h, v = batch, seq, layers, hidden, vocab
    return 72 * b * s * ll * h**2 * (1 + s / (6 * h) + v / (12 * h * ll))


def megatron_recompute_flops(batch: int, seq: int, layers: int, hidden: int, vocab: int) -> float:
    """96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h)): FLOPs with full recomputation (Narayanan et al. 2021, Eq. 3)."""
    b, s, ll, h, v = batch, seq, layers, hidden, vocab
    return 96 * b * s * ll * h**2 * (1 + s / (6 * h) + v / (16 * ll * h))


def megatron_parameter_count(seq: int, layers: int, hidden: int, vocab: int) -> float:
    """12·l·h²·(1 + 13/(12h) + (V+s)/(12·l·h)): GPT parameters (Narayanan et al. 2021; omits the final norm)."""
    s, ll, h, v = seq, layers, hidden, vocab
    return 12 * ll * h**2 * (1 + 13 / (12 * h) + (v + s) / (12 * ll * h))
