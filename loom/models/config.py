"""`GPTConfig`: the one description of loom's reference decoder, and the one place its rules are checked.

The TOML `[model]` section (`loom.train.config.ModelConfig`) is its surface: same keys, checked by building
a `GPTConfig`, so a bad value fails when the config is read, not inside the workers. The cost model prices
it through `loom.cost.transformer.transformer_config`. Plain data: no torch here.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

__all__ = ["ATTENTION_KERNELS", "MLPS", "NORMS", "POSITIONS", "GPTConfig"]

NORMS: tuple[str, ...] = ("layernorm", "rmsnorm")
POSITIONS: tuple[str, ...] = ("learned", "rotary")
MLPS: tuple[str, ...] = ("gelu", "swiglu")
ATTENTION_KERNELS: tuple[str, ...] = ("matmul", "sdpa")


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    """Shape and flavour of the decoder (GPT-2: layernorm, learned positions, gelu; Llama: rmsnorm, rotary,
    swiglu, grouped-query attention with `n_kv_heads < n_heads`). `n_kv_heads=None` means n_heads,
    `d_ff=None` means 4 * d_model. `experts > 1` makes every block's MLP a mixture of `experts` MLPs of
    d_ff (`loom.models.moe`), `top_k` per token. Errors name the `[model]` key of a config:
    `model.d_model = 30 ...`."""

    vocab_size: int = 256
    d_model: int = 128
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int | None = None
    d_ff: int | None = None
    max_seq_len: int = 64
    # "matmul": scores, mask, softmax and mix as loom's operators (each seen by the planner's trace);
    # "sdpa": `F.scaled_dot_product_attention`, causal (flash kernels on a GPU: the scores never stored)
    attention_kernel: str = "matmul"
    norm: str = "layernorm"
    positions: str = "learned"
    mlp: str = "gelu"
    tie_embeddings: bool = True
    dropout: float = 0.0
    norm_eps: float = 1e-5
    # mixture of experts (`experts > 1`): every block's MLP becomes a `loom.models.moe.MoE` of `experts`
    # MLPs of d_ff each (of kind `mlp`), `top_k` of them per token
    experts: int = 1
    top_k: int = 2
    capacity_factor: float | None = None  # None: dropless
    aux_loss_coef: float = 0.01
    z_loss_coef: float = 0.0
    expert_bias_rate: float = 0.0  # > 0: DeepSeek-V3's balancing bias, moved by this much after each step

    def __post_init__(self) -> None:
        for key in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff", "max_seq_len"):
            value = getattr(self, key)
            if value is not None and value < 1:
                self._fail(key, "use a value >= 1")
        for key, choices in (
            ("norm", NORMS),
            ("positions", POSITIONS),
            ("mlp", MLPS),
            ("attention_kernel", ATTENTION_KERNELS),
        ):
            if getattr(self, key) not in choices:
                self._fail(key, f"use one of {choices}")
        if self.d_model % self.n_heads:
            self._fail("d_model", f"it must be divisible by model.n_heads = {self.n_heads}")
        if self.n_heads % self.kv_heads:
            self._fail("n_kv_heads", f"it must divide model.n_heads = {self.n_heads}")
        if self.positions == "rotary" and self.head_dim % 2:
            self._fail(
                "d_model", f"rotary positions need an even head dim, d_model / n_heads = {self.head_dim}"
            )
        if not 0 <= self.dropout < 1:
            self._fail("dropout", "use a probability in [0, 1)")
        if self.dropout:  # a parallel run would draw other masks than one device: no equivalence
            self._fail("dropout", "dropout > 0 is not supported yet; use 0.0")
        if self.norm_eps <= 0:
            self._fail("norm_eps", "use a value > 0")
        self._check_experts()

    def _check_experts(self) -> None:
        if self.experts < 1:
            self._fail("experts", "use 1 (a dense MLP) or more experts")
        if self.is_moe and not 1 <= self.top_k <= self.experts:
            self._fail("top_k", f"choose between 1 and model.experts = {self.experts} experts per token")
        if self.capacity_factor is not None and not self.capacity_factor > 0:
            self._fail("capacity_factor", "use a number > 0, or none for dropless routing")
        for key in ("aux_loss_coef", "z_loss_coef", "expert_bias_rate"):
            if not getattr(self, key) >= 0:
                self._fail(key, "use a value >= 0")

    def check_expert_parallel(self, ep: int, dp: int | None) -> None:
        """A ValueError unless `ep` ranks can share the experts out of `dp` data-parallel ranks (None: not
        known yet): the model has experts, `ep` divides them, and `ep` is made of the last prime factors of
        `dp` (ep groups are blocks of consecutive data-parallel ranks, the innermost canonical dims of the
        mesh's "dp" axis: always true for powers of two). That `ep` divides `dp` is the Plan's rule."""
        if ep == 1:
            return
        if not self.is_moe:
            raise ValueError(
                f"parallel.ep = {ep} shards experts, but the model has none (model.experts = {self.experts}); "
                "set model.experts > 1 or parallel.ep = 1"
            )
        from loom.models.moe import check_expert_split  # imports torch: only here

        check_expert_split(ep, self.experts, dp, ep_name="parallel.ep", experts_name="model.experts")

    def _fail(self, key: str, fix: str) -> None:
        raise ValueError(f"model.{key} = {getattr(self, key)!r} is out of range: {fix}")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> GPTConfig:
        """A config from a `[model]` table (as a TrainConfig dict or a checkpoint's plan.json holds it);
        keys that describe no shape (`name`) are left out."""
        known = {f.name for f in fields(cls)}
        return cls(**{key: value for key, value in data.items() if key in known})

    @property
    def is_moe(self) -> bool:
        """True when the blocks' MLPs are mixtures of experts."""
        return self.experts > 1

    @property
    def kv_heads(self) -> int:
        """Key/value heads (n_kv_heads, or n_heads when unset)."""
        return self.n_kv_heads or self.n_heads

    @property
    def head_dim(self) -> int:
        """d_model / n_heads."""
        return self.d_model // self.n_heads

    @property
    def ff_dim(self) -> int:
        """Hidden size of the MLP (d_ff, or 4 * d_model when unset)."""
        return self.d_ff or 4 * self.d_model
