"""A GPT / Llama-style decoder written with loom.ops, carrying Megatron's tensor-parallel strategies.

Every operator's strategy is a map of one named `Layout((dp, tp), ("dp", "tp"))`, so the same code runs on
one device (strategies ignored) and on a dp x tp mesh:
- column-parallel projections (Q, K, V, MLP up/gate: weight columns cut over `tp`) and row-parallel ones
  (attention output, MLP down: weight rows cut over `tp`, output a pending sum), so each block issues one
  reduction after attention and one after the MLP;
- attention heads cut over `tp` (so `tp` must divide the number of heads, and of key/value heads);
- a vocabulary-parallel embedding (table rows cut over `tp`) and a vocabulary-parallel cross-entropy on
  logits whose vocabulary dim is cut over `tp` (computed from max, log-sum-exp and the target's logit, each
  a reduction over the cut dim);
- sequence parallelism (optional): norms and residual additions work on the sequence cut over `tp`; the
  pending sums become reduce-scatters and the column-parallel inputs all-gathers, as in Megatron;
- a mixture of experts in place of each MLP (`GPTConfig.experts > 1`, `MoEMLP`): computed on each rank's
  own tokens, its stacked expert weights cut over `ep` consecutive data-parallel ranks (expert parallelism,
  the tokens exchanged by `loom.parallel.experts`), replicated over the rest;
- context parallelism (optional, `cp > 1`): each rank of the mesh's `cp` axis brings a shard of every
  sequence (`shard_inputs`), which the model treats as rows of their own: the batch is cut over dp x cp, so
  the mean loss is over every token and the parameter gradients are reduced over dp x cp like any pending sum.
  Only attention mixes positions: it runs on local shards by Ulysses or ring attention over the `cp` group,
  and positions (rotary or learned) are looked up by each token's global position.
"""

from __future__ import annotations

import functools
import hashlib
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.func import functional_call

from loom import ops
from loom.dist.mesh import Mesh
from loom.layout import Layout
from loom.models.config import GPTConfig
from loom.models.moe import MoE, MoEConfig, local_parameter, moe_layers
from loom.parallel.context import chunk_count, sequence_layout, shard_sequence, ulysses_attention
from loom.parallel.lift import attention_on_local_shards
from loom.parallel.local_region import contiguous_strides
from loom.parallel.ring import ring_attention

CONTEXT_ATTENTIONS = {"ulysses": ulysses_attention, "ring": ring_attention}


@dataclass(frozen=True)
class Strategies:
    """The tensor maps the model's operators use, for a `dp` x `tp` arrangement of the devices."""

    dp: int = 1
    tp: int = 1
    sequence_parallel: bool = False
    ep: int = 1  # expert parallelism: ranks sharing the experts, carved out of dp
    cp: int = 1
    attention: str = "ulysses"  # how attention spans the sequence cut over cp: "ulysses" or "ring"

    def __post_init__(self) -> None:
        if self.dp < 1 or self.tp < 1 or self.ep < 1 or self.cp < 1:
            raise ValueError(f"dp {self.dp}, tp {self.tp}, ep {self.ep} and cp {self.cp} must be positive")
        if self.dp % self.ep:
            raise ValueError(f"ep {self.ep} must divide dp {self.dp} (experts shard the data-parallel ranks)")
        if self.attention not in CONTEXT_ATTENTIONS:
            raise ValueError(f"attention {self.attention!r} is not one of {sorted(CONTEXT_ATTENTIONS)}")

    @property
    def layout(self) -> Layout:
        # the cp ranks' sequence shards are rows of their own: the "dp" axis of the maps spans dp x cp
        return Layout((self.dp * self.cp, self.tp), ("dp", "tp"))

    @property
    def sequence_layout(self) -> str:
        """How the sequence is cut over cp (`loom.parallel.context.sequence_layout`)."""
        return sequence_layout(self.attention)

    def map(self, *dims: str) -> object:
        return self.layout(*dims)

    @property
    def stream(self):
        """The residual stream (batch, seq, hidden): batch over dp, and seq over tp with sequence parallelism."""
        return self.map("dp", "tp" if self.sequence_parallel else "None", "None")

    @property
    def replicated_rows(self):
        """Activations entering column-parallel projections: batch over dp, whole on every tp rank."""
        return self.map("dp", "None", "None")

    @property
    def columns(self):
        """Outputs of column-parallel projections: last dim cut over tp."""
        return self.map("dp", "None", "tp")

    @property
    def experts(self):
        """Stacked expert weights [experts, in, out]: the experts cut over the `ep` innermost data-parallel
        ranks (blocks of consecutive ones), replicated over the others, over cp and over tp."""
        layout = Layout((self.dp // self.ep, self.ep, self.cp, self.tp), ("edp", "ep", "cp", "tp"))
        return layout("ep", "None", "None")

    @property
    def heads(self):
        """(batch, heads, seq, head_dim) with the heads cut over tp."""
        return self.map("dp", "tp", "None", "None")

    @property
    def rotary_table(self):
        """Rotary tables: (seq, head_dim), whole; with cp > 1 (batch, 1, seq, head_dim), one per row, as the
        rows' tokens sit at different global positions."""
        return self.map("dp", "None", "None", "None") if self.cp > 1 else self.map("None", "None")


class Norm(nn.Module):
    """LayerNorm or RMSNorm over the hidden dim, on the residual stream's layout."""

    def __init__(self, config: GPTConfig, s: Strategies) -> None:
        super().__init__()
        self.kind, d = config.norm, config.d_model
        self.weight = nn.Parameter(torch.ones(d))
        whole = s.map("None")
        if self.kind == "layernorm":
            self.bias = nn.Parameter(torch.zeros(d))
            self.op = ops.LayerNorm(-1, -1, config.norm_eps).shard((s.stream, whole, whole))
        else:
            self.eps = config.norm_eps
            self.square = ops.Mul().shard((s.stream, s.stream))
            self.mean = ops.ReduceMean(keep_dims=True).shard((s.stream,))
            self.scale = ops.Mul().shard((s.stream, s.stream))
            self.gain = ops.Mul().shard((s.stream, whole))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "layernorm":
            return self.op(x, self.weight, self.bias)
        inv_rms = torch.rsqrt(self.mean(self.square(x, x), -1) + self.eps)
        return self.gain(self.scale(x, inv_rms), self.weight)


class Attention(nn.Module):
    """Causal multi-head (or grouped-query) self-attention with heads cut over tp; with cp > 1 the sequence
    is cut over the `mesh`'s cp axis and attention spans it by Ulysses or ring attention."""

    def __init__(self, config: GPTConfig, s: Strategies, mesh: Mesh | None = None) -> None:
        super().__init__()
        self.config, self.strategies, self.mesh = config, s, mesh
        d, kv = config.d_model, config.kv_heads * config.head_dim
        self.wq = nn.Parameter(torch.empty(d, d))
        self.wk = nn.Parameter(torch.empty(d, kv))
        self.wv = nn.Parameter(torch.empty(d, kv))
        self.wo = nn.Parameter(torch.empty(d, d))
        # with sequence parallelism the input is gathered once (not once per projection)
        self.gather = ops.Identity().shard((s.replicated_rows,))
        column = (s.replicated_rows, s.map("None", "tp"))
        self.q_proj, self.k_proj, self.v_proj = (ops.BatchMatMul().shard(column) for _ in range(3))
        self.split = ops.Reshape().shard((s.columns,))
        self.to_heads = ops.Transpose().shard((s.map("dp", "None", "tp", "None"),))
        self.scores = ops.BatchMatMul(transpose_b=True).shard((s.heads, s.heads))
        self.mask = ops.Add().shard((s.heads, s.map("None", "None")))
        self.softmax = ops.Softmax(-1).shard((s.heads,))
        self.mix = ops.BatchMatMul().shard((s.heads, s.heads))
        self.from_heads = ops.Transpose().shard((s.heads,))
        self.merge = ops.Reshape().shard((s.map("dp", "None", "tp", "None"),))
        self.out_proj = ops.BatchMatMul().shard((s.columns, s.map("tp", "None")))
        if config.positions == "rotary":
            self.rotate = ops.Mul().shard((s.heads, s.rotary_table))
            self.rotate_sin = ops.Mul().shard((s.heads, s.rotary_table))
            self.rotate_add = ops.Add().shard((s.heads, s.heads))

    def _heads(self, x: torch.Tensor, heads: int) -> torch.Tensor:
        batch, seq, _ = x.shape
        return self.to_heads(self.split(x, (batch, seq, heads, self.config.head_dim)), (0, 2, 1, 3))

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        first, second = x.chunk(2, dim=-1)
        return self.rotate_add(self.rotate(x, cos), self.rotate_sin(torch.cat((-second, first), dim=-1), sin))

    def forward(self, x: torch.Tensor, mask: torch.Tensor, rope: tuple | None) -> torch.Tensor:
        c = self.config
        x = self.gather(x)
        q = self._heads(self.q_proj(x, self.wq), c.n_heads)
        k = self._heads(self.k_proj(x, self.wk), c.kv_heads)
        v = self._heads(self.v_proj(x, self.wv), c.kv_heads)
        if rope is not None:
            q, k = self._rope(q, *rope), self._rope(k, *rope)
        if self.strategies.cp > 1:
            return self._output(self._attend_over_cp(q, k, v))
        if c.attention_kernel == "sdpa":
            return self._output(self._fused_attention(q, k, v))
        if c.kv_heads != c.n_heads:  # each key/value head serves a group of query heads
            k, v = (_repeat_heads(t, c.n_heads // c.kv_heads) for t in (k, v))
        scores = self.mask(self.scores(q, k) * (1.0 / math.sqrt(c.head_dim)), mask)
        return self._output(self.mix(self.softmax(scores), v))

    def _fused_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention by `F.scaled_dot_product_attention` (flash kernels on a GPU), on the local heads
        of DTensors (heads cut over tp) or on plain tensors; the same values as the matmul path."""
        grouped = self.config.kv_heads != self.config.n_heads
        attend = functools.partial(F.scaled_dot_product_attention, is_causal=True, enable_gqa=grouped)
        if isinstance(q, DTensor):
            return attention_on_local_shards(attend, q, k, v)
        return attend(q, k, v)

    def _output(self, heads: torch.Tensor) -> torch.Tensor:
        out = self.from_heads(heads, (0, 2, 1, 3))
        batch, seq = out.shape[:2]
        return self.out_proj(self.merge(out, (batch, seq, self.config.d_model)), self.wo)

    def _attend_over_cp(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention of this rank's sequence shards over the whole sequence of the cp group (key/value
        heads unrepeated: both attentions take grouped-query inputs, and ring sends only kv heads)."""
        s = self.strategies
        attend = functools.partial(
            CONTEXT_ATTENTIONS[s.attention],
            group=self.mesh.axis_group("cp"),
            causal=True,
            layout=s.sequence_layout,
        )
        if isinstance(q, DTensor):
            return attention_on_local_shards(attend, q, k, v)
        if q.is_meta:  # the layout dry run: shapes only, no exchanges
            return torch.empty_like(q)
        return attend(q, k, v)


def _repeat_heads(t: torch.Tensor, groups: int) -> torch.Tensor:
    batch, heads, seq, dim = t.shape
    return t[:, :, None].expand(batch, heads, groups, seq, dim).reshape(batch, heads * groups, seq, dim)


class MLP(nn.Module):
    """GELU or SwiGLU feed-forward: column-parallel up (and gate), row-parallel down."""

    def __init__(self, config: GPTConfig, s: Strategies) -> None:
        super().__init__()
        self.swiglu = config.mlp == "swiglu"
        d, f = config.d_model, config.ff_dim
        self.w_up = nn.Parameter(torch.empty(d, f))
        self.w_down = nn.Parameter(torch.empty(f, d))
        self.gather = ops.Identity().shard((s.replicated_rows,))
        self.up = ops.BatchMatMul().shard((s.replicated_rows, s.map("None", "tp")))
        self.down = ops.BatchMatMul().shard((s.columns, s.map("tp", "None")))
        if self.swiglu:
            self.w_gate = nn.Parameter(torch.empty(d, f))
            self.gate = ops.BatchMatMul().shard((s.replicated_rows, s.map("None", "tp")))
            self.glu = ops.Mul().shard((s.columns, s.columns))
        else:
            self.act = ops.GELU(approximate="tanh").shard((s.columns,))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.gather(x)
        if self.swiglu:
            hidden = self.glu(F.silu(self.gate(x, self.w_gate)), self.up(x, self.w_up))
        else:
            hidden = self.act(self.up(x, self.w_up))
        return self.down(hidden, self.w_down)


def moe_config(config: GPTConfig) -> MoEConfig:
    """The `MoEConfig` of each block's mixture of experts: experts of d_ff, of the model's MLP kind."""
    return MoEConfig(
        hidden=config.d_model, ffn_hidden=config.ff_dim, experts=config.experts, top_k=config.top_k,
        activation=config.mlp, normalize_weights=config.top_k > 1, capacity_factor=config.capacity_factor,
        aux_loss_coef=config.aux_loss_coef, z_loss_coef=config.z_loss_coef,
        expert_bias=config.expert_bias_rate > 0, bias_rate=config.expert_bias_rate or 1e-3,
    )  # fmt: skip


class MoEMLP(nn.Module):
    """The MLP as a mixture of experts (`loom.models.moe.MoE`, as `self.moe`), computed on each rank's own
    tokens whatever the mesh: on DTensors the layer runs on the local pieces of its input and parameters
    and returns a DTensor laid out as its input.

    Gradients: a parameter's local gradient is one part of the whole batch's where the input is cut (so
    pending, `Partial`, over those mesh dims: the data-parallel replicas reduce it), complete where it is
    replicated, and the expert weights keep their cut over ep (their rows' gradients come back through the
    exchange). The balancing losses are summed over the ranks holding other tokens before they are formed
    (`MoE.reduce_sums`), so that `aux_loss` is the whole batch's, as on one device."""

    def __init__(self, config: GPTConfig, s: Strategies) -> None:
        super().__init__()
        self.moe = MoE(moe_config(config))
        # no operator of loom's consumes the expert weights: this declares their layout to the dry run
        self.place_experts = ops.Identity().shard((s.experts,))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_meta:  # `loom.parallelize`'s dry run: only the experts' layout is recorded
            for weight in self.moe.experts.weights():
                self.place_experts(weight)
            return torch.zeros_like(x)
        if not isinstance(x, DTensor):
            return self.moe(x)
        mesh, cut = x.device_mesh, [p.is_shard() for p in x.placements]
        local = {name: local_parameter(p, cut) for name, p in self.moe.named_parameters()}
        cut_experts = local["experts.up_proj"].shape[0] != self.moe.config.experts
        if cut_experts and self.moe.experts.exchange is None:
            raise RuntimeError(
                "the experts are cut over ep but not connected to their exchange: lay the model out with "
                "loom.parallelize, which connects them"
            )
        self.moe.reduce_sums = lambda sums: {k: _sum_over(v, mesh, cut) for k, v in sums.items()}
        out = functional_call(self.moe, local, (x.to_local(),))
        return DTensor.from_local(out, mesh, x.placements, run_check=False, shape=x.shape, stride=x.stride())


def _sum_over(value: torch.Tensor, mesh, cut: list[bool]) -> DTensor:  # noqa: ANN001  (a DeviceMesh)
    """A sum over this rank's tokens summed over the mesh dims that cut the tokens (differentiable)."""
    pending = [Partial() if tokens_cut else Replicate() for tokens_cut in cut]
    return DTensor.from_local(value, mesh, pending, run_check=False).redistribute(
        mesh, [Replicate()] * mesh.ndim
    )


class Block(nn.Module):
    """Pre-norm transformer block: x + attention(norm(x)), then x + mlp(norm(x)) (the MLP a mixture of
    experts when the config has experts)."""

    def __init__(self, config: GPTConfig, s: Strategies, mesh: Mesh | None = None) -> None:
        super().__init__()
        self.norm1, self.norm2 = Norm(config, s), Norm(config, s)
        self.attention = Attention(config, s, mesh)
        self.mlp = MoEMLP(config, s) if config.is_moe else MLP(config, s)
        self.residual1 = ops.Add().shard((s.stream, s.stream))
        self.residual2 = ops.Add().shard((s.stream, s.stream))

    def forward(self, x: torch.Tensor, mask: torch.Tensor, rope: tuple | None) -> torch.Tensor:
        x = self.residual1(x, self.attention(self.norm1(x), mask, rope))
        return self.residual2(x, self.mlp(self.norm2(x)))


class GPT(nn.Module):
    """The decoder: `model(ids)` gives logits (vocab dim cut over tp); `model(ids, targets)` the mean loss.

    With `strategies.cp > 1`, `mesh` (whose `cp` axis cuts the sequence) is needed, and each rank brings its
    shard of the ids and targets (`shard_inputs`).
    """

    def __init__(
        self, config: GPTConfig, strategies: Strategies | None = None, mesh: Mesh | None = None
    ) -> None:
        super().__init__()
        s = strategies or Strategies()
        if config.n_heads % s.tp or config.kv_heads % s.tp:
            raise ValueError(
                f"tp {s.tp} must divide n_heads {config.n_heads} and n_kv_heads {config.kv_heads} "
                f"(attention heads are cut over tp)"
            )
        config.check_expert_parallel(s.ep, s.dp)
        _check_context(config, s, mesh)
        self.config, self.strategies, self.mesh = config, s, mesh
        self.embedding = nn.Parameter(torch.empty(config.vocab_size, config.d_model))
        self.lookup = ops.Gather().shard((s.map("tp", "None"), s.map("dp", "None")))
        self.enter = ops.Identity().shard((s.stream,))
        if config.positions == "learned":
            self.positions = nn.Parameter(torch.empty(config.max_seq_len, config.d_model))
            table = s.stream if s.cp > 1 else s.map("tp" if s.sequence_parallel else "None", "None")
            self.add_positions = ops.Add().shard((s.stream, table))
        if s.cp > 1:  # tables looked up by each token's global position
            self.position_rows = ops.Gather().shard((s.map("None", "None"), s.map("dp", "None")))
        self.blocks = nn.ModuleList(Block(config, s, mesh) for _ in range(config.n_layers))
        self.norm = Norm(config, s)
        if not config.tie_embeddings:
            self.head = nn.Parameter(torch.empty(config.vocab_size, config.d_model))
        self.logits = ops.BatchMatMul(transpose_b=True).shard((s.replicated_rows, s.map("tp", "None")))
        size = (config.max_seq_len, config.max_seq_len)
        self.register_buffer("causal_mask", torch.empty(size), persistent=False)
        if config.positions == "rotary":
            tables = (config.max_seq_len, config.head_dim)
            self.register_buffer("rope_cos", torch.empty(tables), persistent=False)
            self.register_buffer("rope_sin", torch.empty(tables), persistent=False)
        self.init_weights()

    def forward(self, ids: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        seq = ids.shape[1]
        x = self.lookup(self.embedding, ids)
        positions = self._token_positions(ids) if self.strategies.cp > 1 else None
        if self.config.positions == "learned":
            table = (
                self.positions[:seq] if positions is None else self.position_rows(self.positions, positions)
            )
            x = self.add_positions(x, table)
        else:
            x = self.enter(x)
        mask = self.causal_mask[:seq, :seq]
        rope = None
        if self.config.positions == "rotary" and positions is None:
            rope = (self.rope_cos[:seq], self.rope_sin[:seq])
        elif self.config.positions == "rotary":  # per row: (batch, 1, seq / cp, head_dim)
            rope = tuple(
                self.position_rows(t, positions).unsqueeze(1) for t in (self.rope_cos, self.rope_sin)
            )
        for block in self.blocks:
            x = block(x, mask, rope)
        logits = self.logits(self.norm(x), self.embedding if self.config.tie_embeddings else self.head)
        if targets is None:
            return logits
        # an automatic plan chose the logits' layout and priced the loss's operators as DTensor runs them:
        # the per-row sums are left to DTensor, as priced, rather than made whole by an unpriced move
        return vocab_parallel_cross_entropy(logits, targets, whole_rows=not self.logits.follow_inputs)

    def _token_positions(self, ids: torch.Tensor) -> torch.Tensor:
        """The global position of every token this rank holds (see `token_positions`)."""
        return token_positions(ids, self.strategies, self.mesh, self.config.max_seq_len)

    def shard_inputs(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """This rank's shard of each (batch, seq) tensor (ids; targets already shifted on the whole
        sequence), cut over the cp axis as the model expects; unchanged with cp = 1."""
        s = self.strategies
        if s.cp == 1:
            return tensors
        group = self.mesh.axis_group("cp")
        return tuple(_shard_tokens(t, group, s) for t in tensors)

    @torch.no_grad()
    def init_weights(self, seed: int = 0) -> None:
        """Initialise every parameter from (seed, its name), whole-tensor values identical on one device and
        on any mesh (a DTensor keeps the slice of the full draw that it holds)."""
        if not self.causal_mask.is_meta:  # constant tables, recomputed after `to_empty`
            self.causal_mask.copy_(_causal_mask(self.config.max_seq_len))
            for moe in moe_layers(self):  # the balancing state starts at zero
                moe.expert_bias.zero_()
                moe.load_total.zero_()
            if self.config.positions == "rotary":
                cos, sin = _rotary_tables(self.config.max_seq_len, self.config.head_dim)
                self.rope_cos.copy_(cos)
                self.rope_sin.copy_(sin)
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layers)
        for name, param in self.named_parameters():
            if param.is_meta:
                continue
            generator = torch.Generator().manual_seed(_name_seed(seed, name))
            leaf = name.rsplit(".", 1)[-1]
            if leaf in ("weight", "bias") and param.ndim == 1:
                full = torch.ones(param.shape) if leaf == "weight" else torch.zeros(param.shape)
            else:
                std = residual_std if leaf in ("wo", "w_down", "down_proj") else 0.02
                full = torch.randn(param.shape, generator=generator) * std
            _assign(param, full.to(param.dtype))

    def num_parameters(self, exclude_embeddings: bool = False, active: bool = False) -> int:
        """Parameter count of the whole (global) model; with `active`, the experts of each mixture count
        `top_k / experts` of theirs (the parameters one token computes with: what model FLOPs count)."""
        total = sum(p.numel() for p in self.parameters())
        if exclude_embeddings:
            total -= self.embedding.numel() + (self.positions.numel() if hasattr(self, "positions") else 0)
        if active and self.config.is_moe:
            experts = sum(p.numel() for moe in moe_layers(self) for p in moe.experts.parameters())
            total -= experts - experts * self.config.top_k // self.config.experts
        return total


def token_positions(like: torch.Tensor, s: Strategies, mesh: Mesh, max_seq_len: int) -> torch.Tensor:
    """The global position of every token this rank holds, shaped (batch, seq / cp) and laid out as `like`'s
    first two dims (token ids, or the residual stream a pipeline stage receives): the sequence cut over cp
    as `GPT.shard_inputs` cuts the tokens."""
    local = like.to_local() if isinstance(like, DTensor) else like
    whole = like.shape[1] * s.cp
    if whole > max_seq_len:
        raise ValueError(
            f"the sequence of {whole} tokens ({like.shape[1]} per rank x cp {s.cp}) is longer than "
            f"max_seq_len {max_seq_len}"
        )
    every = torch.arange(whole, device=local.device)
    mine = shard_sequence(every, 0, mesh.axis_group("cp"), layout=s.sequence_layout)
    mine = mine.expand(local.shape[0], like.shape[1]).contiguous()
    if not isinstance(like, DTensor):
        return mine
    shape = like.shape[:2]
    # rows as `like`'s; whole along the sequence (a stream cut over tp by sequence parallelism included)
    rows = tuple(p if p == Shard(0) else Replicate() for p in like.placements)
    return DTensor.from_local(
        mine,
        like.device_mesh,
        rows,
        run_check=False,
        shape=shape,
        stride=contiguous_strides(shape),
    )


def _check_context(config: GPTConfig, s: Strategies, mesh: Mesh | None) -> None:
    """What context parallelism needs of the model and the mesh, refused at construction."""
    if s.cp == 1:
        return
    if s.attention == "ulysses" and config.n_heads % (s.tp * s.cp):
        raise ValueError(
            f"Ulysses attention cuts each tp rank's heads over cp: tp x cp = {s.tp * s.cp} must divide n_heads "
            f"{config.n_heads}; use attention='ring', which takes any head count"
        )
    if mesh is None or mesh.axis_size("cp") != s.cp:
        found = "no mesh" if mesh is None else f"the mesh {mesh}"
        raise ValueError(
            f"cp {s.cp} needs the mesh whose 'cp' axis has {s.cp} ranks (GPT(..., mesh=mesh)); got {found}"
        )


def _shard_tokens(t: torch.Tensor, group: object, s: Strategies) -> torch.Tensor:
    """One (batch, seq) tensor's shard along the sequence, with the error naming the fix."""
    chunks = chunk_count(s.cp, s.sequence_layout)
    if t.shape[1] % chunks:
        raise ValueError(
            f"the sequence of {t.shape[1]} tokens does not cut evenly over cp {s.cp} with {s.attention} attention "
            f"({s.sequence_layout!r} layout: {chunks} equal chunks); use a sequence length that is a multiple of "
            f"{chunks}"
        )
    return shard_sequence(t, 1, group, layout=s.sequence_layout)


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, targets: torch.Tensor, whole_rows: bool = True
) -> torch.Tensor:
    """Mean cross-entropy of `logits` (batch, seq, vocab) against integer `targets` (batch, seq).

    Written with reductions over the vocab dim only, so that with that dim cut over tp each rank works on
    its slice: the max and the sum of exponentials are reduced across tp, and the target's logit is picked
    with a one-hot mask that each rank builds for its own slice. With `whole_rows` (Megatron's layouts) each
    per-row sum is made whole at once (`_whole_rows`); without it (an automatic plan, whose planner priced
    the captured operators) the sums are left as DTensor's rules make them.
    """
    whole = _whole_rows if whole_rows else lambda per_row, _: per_row
    shift = whole(logits.detach().amax(dim=-1, keepdim=True), logits)
    log_sum_exp = torch.log(whole(torch.exp(logits - shift).sum(dim=-1), logits)) + shift.squeeze(-1)
    picked = whole((logits * F.one_hot(targets, logits.shape[-1]).to(logits.dtype)).sum(dim=-1), logits)
    return (log_sum_exp - picked).mean()


def _whole_rows(per_row: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """A per-row reduction over the vocabulary, summed over the vocabulary cut at once (Megatron's
    all-reduce). Left pending, DTensor reduce-scatters it over the rows, and the gradient then stays cut
    along tp through the whole backward pass (a reduce-scatter and an all-gather per all-reduce)."""
    if not isinstance(logits, DTensor):
        return per_row
    vocab = logits.ndim - 1
    # a pending sum of the logits (a head whose contracted dim an automatic plan cut) is summed too
    rows = [
        Replicate() if (isinstance(p, Shard) and p.dim == vocab) or p.is_partial() else p
        for p in logits.placements
    ]
    return per_row.redistribute(logits.device_mesh, rows)


def _assign(param: torch.Tensor, full: torch.Tensor) -> None:
    if isinstance(param, DTensor):
        local = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None).to_local()
        param.to_local().copy_(local)
    else:
        param.copy_(full)


def _name_seed(seed: int, name: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little") % 2**63


def _causal_mask(size: int) -> torch.Tensor:
    return torch.full((size, size), float("-inf")).triu(1)


def _rotary_tables(seq: int, dim: int, base: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = base ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    angles = torch.outer(torch.arange(seq, dtype=torch.float64), inv_freq)
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos().float(), angles.sin().float()
