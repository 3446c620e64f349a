"""A mixture-of-experts layer: a top-k token-choice router and experts computed as one grouped matmul.

`MoE(config)` maps `[tokens, hidden]` or `[batch, seq, hidden]` to the same shape. Per token the router
scores every expert (softmax or sigmoid, in fp32 whatever the input's dtype), picks the `top_k` best and
weighs the chosen experts' outputs by their scores. Options:

- capacity: `capacity_factor=None` is dropless; a number caps each expert at
  `ceil(capacity_factor * tokens * top_k / experts)` token-expert pairs, dropping the lowest-scored pairs
  (`drop_policy="probability"`) or the latest ones in token order (`"position"`). A dropped pair adds
  nothing: the residual connection around the layer carries its token on.
- balancing: the Switch/GShard load-balancing loss `experts * sum_i f_i * P_i` (f_i the fraction of pairs
  routed to expert i before dropping, P_i the mean routing probability of expert i) and the router z-loss
  `mean(logsumexp(logits)^2)`, each with its coefficient; or DeepSeek-V3's auxiliary-loss-free balancing:
  a per-expert bias added to the scores for the choice of experts only, moved by `update_bias(rate)`
  towards under-loaded experts.
- shared experts: an always-on dense MLP of `shared_experts * ffn_hidden` added to the routed output.

Auxiliary losses: after each forward, `layer.aux_loss` holds the weighted sum of both losses (a 0-dim fp32
tensor in the graph); a training loop adds `sum(m.aux_loss for m in moe_layers(model))` to its loss.
Keeping the output a plain tensor lets the layer drop into any model (`nn.Sequential`, a residual block).

The experts (`GroupedExperts`) hold their weights stacked, `[experts, ...]`, and run as one
`torch._grouped_mm` over the tokens sorted by expert where that operator exists and runs for the device,
dtype and sizes (probed once) on an accelerator, a loop over the experts otherwise (on CPU unless
`grouped_mm=True`). `loom.parallel.experts` shards the stacked weights over an expert-parallel group and
exchanges the tokens with all-to-alls.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cache

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate

from loom.dist._torch_private import grouped_mm

__all__ = [
    "GroupedExperts",
    "MoE",
    "MoEConfig",
    "Routing",
    "aux_losses",
    "balance_sums",
    "check_expert_split",
    "chosen_routing",
    "combine",
    "expert_mlp",
    "grouped_mm_usable",
    "local_parameter",
    "moe_layers",
    "update_biases",
]

SCORES = ("softmax", "sigmoid")
DROP_POLICIES = ("probability", "position")
ACTIVATIONS = ("swiglu", "gelu")


def _fail(field: str, value, fix: str) -> None:
    raise ValueError(f"MoEConfig.{field} = {value!r}: {fix}")


@dataclass(frozen=True, kw_only=True)
class MoEConfig:
    """Shape and routing of one mixture-of-experts layer (see the module's docstring)."""

    hidden: int
    ffn_hidden: int  # of each expert
    experts: int
    top_k: int = 2
    activation: str = "swiglu"  # "swiglu" (gate, up, down) or "gelu" (up, down)
    score: str = "softmax"  # "softmax" (Mixtral, Switch) or "sigmoid" (DeepSeek-V3)
    normalize_weights: bool = True  # the chosen experts' weights rescaled to sum to 1 per token
    capacity_factor: float | None = None  # None: dropless
    drop_policy: str = "probability"  # which pairs an over-full expert drops: "probability" or "position"
    aux_loss_coef: float = 0.01
    z_loss_coef: float = 0.0
    expert_bias: bool = False  # DeepSeek-V3's auxiliary-loss-free balancing bias
    bias_rate: float = 1e-3  # how far `update_bias` moves the bias by default
    shared_experts: int = 0  # an always-on MLP of shared_experts * ffn_hidden
    grouped_mm: bool | None = None  # None: torch._grouped_mm where usable but on CPU; False: the loop
    init_std: float = 0.02

    def __post_init__(self) -> None:
        for field in ("hidden", "ffn_hidden", "experts", "top_k"):
            value = getattr(self, field)
            if not isinstance(value, int) or value < 1:
                _fail(field, value, "give a positive integer")
        if self.top_k > self.experts:
            _fail("top_k", self.top_k, f"choose at most experts = {self.experts} experts per token")
        if self.activation not in ACTIVATIONS:
            _fail("activation", self.activation, f"use one of {ACTIVATIONS}")
        if self.score not in SCORES:
            _fail("score", self.score, f"use one of {SCORES}")
        if self.drop_policy not in DROP_POLICIES:
            _fail("drop_policy", self.drop_policy, f"use one of {DROP_POLICIES}")
        if self.capacity_factor is not None and not self.capacity_factor > 0:
            _fail("capacity_factor", self.capacity_factor, "give a positive number, or None for dropless")
        for field in ("aux_loss_coef", "z_loss_coef", "init_std", "bias_rate"):
            if not getattr(self, field) >= 0:
                _fail(field, getattr(self, field), "give a number >= 0")
        if self.shared_experts < 0:
            _fail("shared_experts", self.shared_experts, "give 0 (none) or a positive count")
        if self.score == "softmax" and self.top_k == 1 and self.normalize_weights:
            # a lone softmax weight renormalised is always 1: the router would get no gradient
            _fail("normalize_weights", True, "set it False with top_k = 1 and softmax scores (Switch)")

    def capacity(self, tokens: int) -> int | None:
        """Token-expert pairs each expert takes for a batch of `tokens` tokens (None: no limit)."""
        if self.capacity_factor is None:
            return None
        return math.ceil(self.capacity_factor * tokens * self.top_k / self.experts)


@dataclass(frozen=True)
class Routing:
    """Where a batch's token-expert pairs go, sorted by expert: the pair `i` takes token `token[i]` to
    expert `expert[i]` with weight `weight[i]` (fp32, in the graph); `counts[e]` pairs go to expert `e`.
    Dropped pairs are absent."""

    token: torch.Tensor
    expert: torch.Tensor
    weight: torch.Tensor
    counts: torch.Tensor


def chosen_routing(
    chosen: torch.Tensor, weight: torch.Tensor, experts: int, kept: torch.Tensor | None = None
) -> Routing:
    """The routing of tokens to their chosen experts: `chosen` and `weight` are `[tokens, top_k]` (expert
    indices, their weights); `kept` masks the flattened pairs that fit their expert's capacity (None: all)."""
    token = torch.arange(chosen.shape[0], device=chosen.device).repeat_interleave(chosen.shape[1])
    expert, weight = chosen.reshape(-1), weight.reshape(-1)
    if kept is not None:
        token, expert, weight = token[kept], expert[kept], weight[kept]
    order = torch.argsort(expert, stable=True)
    counts = torch.bincount(expert, minlength=experts)
    return Routing(token=token[order], expert=expert[order], weight=weight[order], counts=counts)


def combine(
    flat: torch.Tensor, routing: Routing, experts: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
) -> torch.Tensor:
    """Each token's rows `flat` `[tokens, hidden]` sent through `experts(rows, counts)` (rows sorted by
    expert) as `routing` says, and the outputs summed back per token, each weighed by its pair's weight."""
    rows = experts(flat[routing.token], routing.counts)
    rows = rows * routing.weight.unsqueeze(-1).to(rows.dtype)
    return torch.zeros_like(flat).index_add(0, routing.token, rows)


def local_parameter(param: torch.Tensor, tokens_cut: list[bool]) -> torch.Tensor:
    """The local piece of a DTensor parameter of a mixture of experts computed on this rank's tokens (plain
    tensors pass through). Its gradient stays cut where the parameter is (an expert shard's rows come back
    through the exchange), pending (`Partial`) over the other mesh dims that cut the tokens, for the
    data-parallel replicas to reduce, and complete where the tokens are whole."""
    if not isinstance(param, DTensor):
        return param
    grads = [
        p if p.is_shard() else Partial() if cut else Replicate()
        for p, cut in zip(param.placements, tokens_cut, strict=True)
    ]
    return param.to_local(grad_placements=grads)


def check_expert_split(ep: int, experts: int, dp: int | None, *, ep_name: str, experts_name: str) -> None:
    """A ValueError unless `ep` ranks can share `experts` experts out of `dp` data-parallel ranks (None: not
    known yet): `ep` divides the experts and is made of the last prime factors of `dp` (ep groups are blocks
    of consecutive data-parallel ranks, the innermost canonical dims of the mesh's "dp" axis: always true for
    powers of two). `ep_name` and `experts_name` say where the two numbers come from in the message."""
    from loom.dist.mesh import is_inner_factor, prime_factors

    if experts % ep:
        choices = [
            d for d in range(1, experts + 1) if experts % d == 0 and (dp is None or is_inner_factor(d, dp))
        ]
        raise ValueError(f"{ep_name} = {ep} must divide {experts_name} = {experts}; choose ep in {choices}")
    if dp is not None and not is_inner_factor(ep, dp):
        raise ValueError(
            f"{ep_name} = {ep}: expert groups are made of the innermost factors of dp = {dp} (prime factors "
            f"{list(prime_factors(dp))}); choose an ep that is a product of its last factors"
        )


def _kept(scores: torch.Tensor, chosen: torch.Tensor, config: MoEConfig) -> torch.Tensor:
    """Mask over the flattened (token, k) pairs that fit their expert's capacity."""
    pairs = chosen.numel()
    capacity = config.capacity(chosen.shape[0])
    if capacity is None or capacity >= pairs:
        return torch.ones(pairs, dtype=torch.bool, device=chosen.device)
    expert = chosen.reshape(-1)
    if config.drop_policy == "probability":
        priority = scores.detach().gather(1, chosen).reshape(-1)
        order = torch.argsort(priority, descending=True, stable=True)
    else:  # position: earlier tokens first, a token's first choice before its second
        order = torch.arange(pairs, device=chosen.device)
    # rank of each pair within its expert, in priority order: a stable sort by expert keeps that order
    by_expert = order[torch.argsort(expert[order], stable=True)]
    counts = torch.bincount(expert, minlength=config.experts)
    starts = torch.cumsum(counts, 0) - counts
    rank = torch.empty_like(expert)
    rank[by_expert] = torch.arange(pairs, device=chosen.device) - starts[expert[by_expert]]
    return rank < capacity


class GroupedExperts(nn.Module):
    """`experts` MLPs with weights stacked `[experts, in, out]`: `gate_proj` and `up_proj` `[E, hidden,
    ffn]` (SwiGLU; `up_proj` alone for GELU) and `down_proj` `[E, ffn, hidden]`. `forward(rows, counts)`
    takes rows sorted by expert, `counts[e]` of them for expert `e`."""

    def __init__(self, config: MoEConfig, *, init: bool = True) -> None:
        super().__init__()
        self.config = config
        e, h, f = config.experts, config.hidden, config.ffn_hidden
        if config.activation == "swiglu":
            self.gate_proj = nn.Parameter(torch.empty(e, h, f))
        self.up_proj = nn.Parameter(torch.empty(e, h, f))
        self.down_proj = nn.Parameter(torch.empty(e, f, h))
        # `loom.parallel.experts` sets a callable `(rows, counts, weights, config) -> outputs` here that
        # exchanges the rows with the ranks holding the other experts; None: every expert is here
        self.exchange: Callable | None = None
        if init:
            self.reset_parameters()

    def reset_parameters(self) -> None:
        """Normal(0, init_std) weights, drawn for the whole stack at once (one draw per tensor)."""
        for weight in self.weights():
            nn.init.normal_(weight, std=self.config.init_std)

    def weight_names(self) -> tuple[str, ...]:
        """Names of the stacked weights, in a fixed order."""
        return (
            ("gate_proj", "up_proj", "down_proj")
            if self.config.activation == "swiglu"
            else ("up_proj", "down_proj")
        )

    def weights(self) -> list[nn.Parameter]:
        """The stacked weights, in the order of `weight_names`."""
        return [getattr(self, name) for name in self.weight_names()]

    @property
    def num_experts(self) -> int:
        """Experts this module holds."""
        return self.up_proj.shape[0]

    def forward(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        if self.exchange is not None:
            return self.exchange(rows, counts, self.weights(), self.config)
        return expert_mlp(rows, counts, self.weights(), self.config)


def expert_mlp(rows: torch.Tensor, counts: torch.Tensor, weights: list[torch.Tensor], config: MoEConfig):
    """Each expert's MLP on its rows (`rows` sorted by expert, `counts[e]` rows for expert `e`)."""
    # automatic: not on CPU, where torch's grouped matmul is a slow reference kernel (hundreds of times
    # the loop's time on small experts, seen on torch 2.13)
    wanted = config.grouped_mm is True or (config.grouped_mm is None and rows.device.type != "cpu")
    usable = wanted and grouped_mm_usable(rows.device.type, rows.dtype, config.hidden, config.ffn_hidden)
    if config.grouped_mm and not usable:
        raise ValueError(
            f"MoEConfig.grouped_mm = True: torch._grouped_mm does not run on {rows.device.type} in "
            f"{rows.dtype} with hidden {config.hidden} and ffn_hidden {config.ffn_hidden} (rows must be "
            f"16-byte aligned); set grouped_mm None (automatic) or False (the per-expert loop)"
        )
    if usable:
        ends = torch.cumsum(counts, 0).to(torch.int32)
        matmul = lambda x, w: _contiguous_grad(grouped_mm(x, w, ends))  # noqa: E731
    else:
        sizes = counts.tolist()
        matmul = lambda x, w: _looped_mm(x, w, sizes)  # noqa: E731
    if config.activation == "swiglu":
        gate, up, down = weights
        hidden = F.silu(matmul(rows, gate)) * matmul(rows, up)
    else:
        up, down = weights
        hidden = F.gelu(matmul(rows, up))
    return matmul(hidden, down)


def _looped_mm(rows: torch.Tensor, weight: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    pieces = torch.split(rows, sizes)
    return torch.cat([piece @ weight[e] for e, piece in enumerate(pieces)])


class _ContiguousGrad(torch.autograd.Function):
    """Identity on a grouped matmul's output whose backward makes the incoming gradient contiguous:
    `torch._grouped_mm`'s backward rejects a stride-0 gradient (as `y.sum().backward()` sends)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


def _contiguous_grad(x: torch.Tensor) -> torch.Tensor:
    return _ContiguousGrad.apply(x) if x.requires_grad else x


@cache
def grouped_mm_usable(device_type: str, dtype: torch.dtype, hidden: int, ffn_hidden: int) -> bool:
    """Whether `torch._grouped_mm` runs forward and backward for these sizes and dtype on this device type
    (it needs 16-byte aligned strides and, on GPUs, recent architectures). Probed once per key."""
    device = torch.device(device_type)
    try:
        rows = torch.ones(3, hidden, device=device, dtype=dtype, requires_grad=True)
        weight = torch.ones(2, hidden, ffn_hidden, device=device, dtype=dtype, requires_grad=True)
        ends = torch.tensor([1, 3], device=device, dtype=torch.int32)
        out = grouped_mm(rows, weight, ends)
        if out is None:  # no such operator in this torch
            return False
        back = grouped_mm(out, weight.transpose(1, 2), ends)
        back.backward(torch.ones_like(back))
    except (RuntimeError, NotImplementedError):
        return False
    return True


class MoE(nn.Module):
    """A mixture-of-experts MLP (see the module's docstring). After each forward: `aux_loss` (weighted
    load-balancing plus z-loss, fp32, in the graph), `load` (pairs routed to each expert, before dropping)
    and `dropped` (pairs dropped for capacity). In training mode with gradients on (not in an evaluation
    under `torch.no_grad`), `load_total` (int64) accumulates `load` for `update_bias`; a recomputed
    forward counts again, which scales every expert's load alike and so leaves the update unchanged."""

    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        self.config = config
        # made without nn.Linear's own draw: every draw happens in reset_parameters, in one order
        here = torch.empty(0).device  # the default device, a `with torch.device(...)` block's included
        self.router = nn.Linear(config.hidden, config.experts, bias=False, device="meta").to_empty(
            device=here
        )
        self.experts = GroupedExperts(config, init=False)
        self.shared = None
        if config.shared_experts:
            width = config.shared_experts * config.ffn_hidden
            fields = {"experts": 1, "top_k": 1, "normalize_weights": False, "ffn_hidden": width}
            shared = MoEConfig(**{**_fields(config), **fields, "shared_experts": 0, "expert_bias": False})
            self.shared = GroupedExperts(shared, init=False)
        self.register_buffer("expert_bias", torch.zeros(config.experts), persistent=config.expert_bias)
        # int64: a model cast to bf16 keeps exact counts
        self.register_buffer("load_total", torch.zeros(config.experts, dtype=torch.int64), persistent=False)
        self.aux_loss: torch.Tensor | None = None
        # sums over this rank's tokens -> sums over the whole batch (see `balance_sums`); None: this rank's
        self.reduce_sums: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None = None
        self.load: torch.Tensor | None = None
        self._kept: torch.Tensor | None = None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Normal(0, init_std) weights drawn in one fixed order (router, expert stacks, shared experts), so
        that a seed gives one layer whether it is made whole, sharded over experts afterwards
        (`loom.parallel.experts`) or made on the meta device and reset once materialised; a zero bias and
        zero load counts."""
        nn.init.normal_(self.router.weight, std=self.config.init_std)
        self.experts.reset_parameters()
        if self.shared is not None:
            self.shared.reset_parameters()
        with torch.no_grad():  # the balancing state too (a meta-device buffer materialises as garbage)
            self.expert_bias.zero_()
            self.load_total.zero_()

    @property
    def dropped(self) -> int:
        """Token-expert pairs the last forward dropped for capacity (reading it waits for the device)."""
        return 0 if self._kept is None else int(self._kept.numel() - self._kept.sum())

    def route(self, x: torch.Tensor) -> Routing:
        """Choose experts for the rows of `x` `[tokens, hidden]`; sets `aux_loss`, `load` and `dropped`."""
        config = self.config
        logits = F.linear(x.float(), self.router.weight.float())  # router math in fp32
        scores = torch.softmax(logits, -1) if config.score == "softmax" else torch.sigmoid(logits)
        # the bias steers the choice only; the weights stay the unbiased scores
        pick = scores + self.expert_bias.float() if config.expert_bias else scores
        chosen = torch.topk(pick.detach(), config.top_k, dim=-1).indices
        weight = scores.gather(1, chosen)
        if config.normalize_weights:
            weight = weight / weight.sum(-1, keepdim=True)
        load = torch.bincount(chosen.reshape(-1), minlength=config.experts)
        self.load = load
        if self.training and torch.is_grad_enabled():  # an evaluation between steps steers nothing
            self.load_total += load
        self.aux_loss = self._aux_loss(logits, scores, load)
        kept = self._kept = _kept(scores, chosen, config)
        return chosen_routing(chosen, weight, config.experts, kept)

    def _aux_loss(self, logits: torch.Tensor, scores: torch.Tensor, load: torch.Tensor) -> torch.Tensor:
        """The weighted balancing losses from sums over tokens (`balance_sums`), summed over the ranks that
        hold other tokens first when `reduce_sums` is set, so that they are those of the whole batch."""
        config = self.config
        sums = balance_sums(logits, scores, load, config)
        if self.reduce_sums is not None:
            sums = self.reduce_sums(sums)
        tokens = sums["tokens"].clamp(min=1)  # no token: every sum is 0, and so is the loss (in the graph)
        loss = sums["probs"].sum() * 0.0  # zero, yet in the graph: the router gets a gradient from no tokens
        if config.aux_loss_coef:
            share = sums["load"] / (tokens * config.top_k)
            loss = loss + config.aux_loss_coef * config.experts * (share * sums["probs"] / tokens).sum()
        if config.z_loss_coef:
            loss = loss + config.z_loss_coef * sums["z"] / tokens
        return loss

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        if shape[-1] != self.config.hidden:
            raise ValueError(
                f"MoE: input's last dim is {shape[-1]}, the layer's hidden is {self.config.hidden}"
            )
        flat = x.reshape(-1, shape[-1])
        out = combine(flat, self.route(flat), self.experts)
        if self.shared is not None:
            out = out + self.shared(flat, torch.tensor([flat.shape[0]], device=flat.device))
        return out.reshape(shape)

    @torch.no_grad()
    def update_bias(self, rate: float | None = None, group=None) -> torch.Tensor:
        """DeepSeek-V3's update: each expert's bias moves by `rate` (default: the config's `bias_rate`) up
        if its load since the last update
        is below the mean, down if above (`load_total`, summed over `group` first when given so that every
        replica moves its bias alike); `load_total` restarts at zero. Returns the load used."""
        if not self.config.expert_bias:
            raise ValueError(
                "MoE.update_bias: the layer has no bias; build it with MoEConfig(expert_bias=True)"
            )
        rate = self.config.bias_rate if rate is None else rate
        load = self.load_total.clone()
        if group is not None:
            torch.distributed.all_reduce(load, group=group)
        share = load.double()
        self.expert_bias += (rate * torch.sign(share.mean() - share)).to(self.expert_bias.dtype)
        self.load_total.zero_()
        return load


def balance_sums(
    logits: torch.Tensor, scores: torch.Tensor, load: torch.Tensor, config: MoEConfig
) -> dict[str, torch.Tensor]:
    """What the balancing losses need, as sums over the tokens of `logits` (so that sums over several
    ranks' tokens give the whole batch's losses): `tokens`, `load` (pairs per expert, before dropping),
    `probs` (routing probabilities per expert; sigmoid scores normalised per token, so that each is a
    share as with softmax) and `z` (the squared log-sum-exp of the logits)."""
    probs = scores if config.score == "softmax" else scores / scores.sum(-1, keepdim=True)
    return {
        "tokens": torch.tensor(float(logits.shape[0]), device=logits.device),
        "load": load.float(),
        "probs": probs.sum(0),
        "z": torch.logsumexp(logits, -1).square().sum(),
    }


def _fields(config: MoEConfig) -> dict:
    return {name: getattr(config, name) for name in config.__dataclass_fields__}


def moe_layers(model: nn.Module) -> Iterator[MoE]:
    """Every `MoE` in `model` (for summing their `aux_loss` or updating their biases)."""
    return (m for m in model.modules() if isinstance(m, MoE))


def aux_losses(model: nn.Module) -> torch.Tensor | None:
    """The sum of the balancing losses of `model`'s mixtures of experts after its last forward (what a
    training loop adds to the loss it differentiates); None for a model without any."""
    losses = [m.aux_loss for m in moe_layers(model) if m.aux_loss is not None]
    return sum(losses[1:], losses[0]) if losses else None


def update_biases(model: nn.Module, group=None) -> None:
    """After an optimizer step: `update_bias` every mixture of experts of `model` that balances by bias,
    with the loads summed over `group` (the ranks holding other tokens; ranks counting the same tokens
    scale every load alike, which leaves the update unchanged)."""
    for moe in moe_layers(model):
        if moe.config.expert_bias:
            moe.update_bias(group=group)
