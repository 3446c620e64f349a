"""Tier 1: the mixture-of-experts layer (`loom.models.moe`) on one process, against plain per-token math.

The reference routes token by token in Python: scores, the top-k choice (with the balancing bias added
for the choice only), each expert's MLP from its slice of the stacked weights, capacity applied expert by
expert in the policy's priority order. fp32 outputs and gradients compared at rtol/atol 1e-5 (Lipschitz
quantities), the auxiliary losses against their formulas, the grouped matmul against the loop.
"""

import math

import pytest
import torch
import torch.nn.functional as F

from loom.cost.moe import COUNT_BYTES, layer_moe_collectives, moe_collectives
from loom.cost.plan import ParallelPlan
from loom.cost.transformer import TransformerConfig
from loom.models.moe import MoE, MoEConfig, grouped_mm_usable, moe_layers

TOL = 1e-5
BASE = {"hidden": 8, "ffn_hidden": 12, "experts": 4, "top_k": 2, "init_std": 0.5}


def layer(**changes) -> MoE:
    torch.manual_seed(0)
    return MoE(MoEConfig(**{**BASE, **changes}))


def tokens(n: int = 10, seed: int = 1) -> torch.Tensor:
    return torch.randn(n, BASE["hidden"], generator=torch.Generator().manual_seed(seed))


def expert_output(moe: MoE, expert: int, x: torch.Tensor) -> torch.Tensor:
    """Expert `expert`'s MLP on rows `x`, from its slice of the stacked weights."""
    ex = moe.experts
    if moe.config.activation == "swiglu":
        hidden = F.silu(x @ ex.gate_proj[expert]) * (x @ ex.up_proj[expert])
    else:
        hidden = F.gelu(x @ ex.up_proj[expert])
    return hidden @ ex.down_proj[expert]


def naive(moe: MoE, x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The layer token by token; also the number of pairs dropped."""
    config = moe.config
    logits = x.float() @ moe.router.weight.float().T
    scores = torch.softmax(logits, -1) if config.score == "softmax" else torch.sigmoid(logits)
    pairs = []  # (flat index, token, expert, weight, score)
    for t in range(x.shape[0]):
        pick = (scores[t] + moe.expert_bias).tolist()
        chosen = sorted(range(config.experts), key=lambda e: -pick[e])[: config.top_k]
        weights = scores[t, chosen]
        if config.normalize_weights:
            weights = weights / weights.sum()
        pairs += [(t * config.top_k + j, t, e, weights[j], scores[t, e].item()) for j, e in enumerate(chosen)]
    capacity = config.capacity(x.shape[0])
    kept = []
    for e in range(config.experts):
        mine = [p for p in pairs if p[2] == e]
        if config.drop_policy == "probability":
            mine.sort(key=lambda p: (-p[4], p[0]))
        kept += mine if capacity is None else mine[:capacity]
    out = torch.zeros_like(x)
    for _, t, e, w, _ in kept:
        out[t] = out[t] + w * expert_output(moe, e, x[t : t + 1])[0]
    if moe.shared is not None:
        shared = moe.shared
        out = out + (F.silu(x @ shared.gate_proj[0]) * (x @ shared.up_proj[0])) @ shared.down_proj[0]
    return out, len(pairs) - len(kept)


def grads_of(moe: MoE, x: torch.Tensor, fn) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Output of `fn(moe, x)` and the gradients of a fixed projection of it (input first)."""
    moe.zero_grad()
    x = x.clone().requires_grad_()
    y = fn(moe, x)
    y = y[0] if isinstance(y, tuple) else y
    weight = torch.randn(y.shape, generator=torch.Generator().manual_seed(7))
    (y * weight).sum().backward()
    return y.detach(), [x.grad] + [p.grad.clone() for p in moe.parameters() if p.grad is not None]


def assert_close(a, b) -> None:
    torch.testing.assert_close(a, b, rtol=TOL, atol=TOL)


@pytest.mark.parametrize(
    "changes",
    [
        {},
        {"activation": "gelu", "score": "sigmoid", "top_k": 3},
        {"capacity_factor": 0.5},
        {"capacity_factor": 0.75, "drop_policy": "position"},
        {"shared_experts": 2, "top_k": 1, "normalize_weights": False},
        {"expert_bias": True, "score": "sigmoid"},
    ],
    ids=["dropless", "gelu-sigmoid-top3", "capacity-probability", "capacity-position", "shared", "bias"],
)
def test_layer_matches_token_by_token_routing_outputs_and_gradients(changes):
    moe = layer(**changes)
    if changes.get("expert_bias"):
        moe.expert_bias.copy_(torch.tensor([0.3, -0.2, 0.0, 0.1]))  # a different choice from the scores'
    x = tokens()
    y, grads = grads_of(moe, x, MoE.forward)
    want, want_grads = grads_of(moe, x, naive)
    assert_close(y, want)
    for got, expected in zip(grads, want_grads, strict=True):
        assert_close(got, expected)
    assert moe.dropped == naive(moe, x)[1]
    if "capacity_factor" in changes:
        assert moe.dropped > 0  # the case exercises dropping


def test_capacity_keeps_the_highest_scored_or_earliest_pairs_of_an_overfull_expert():
    moe = layer(top_k=1, normalize_weights=False, capacity_factor=1.0, expert_bias=True)
    moe.expert_bias.copy_(torch.tensor([10.0, 0, 0, 0]))  # every token chooses expert 0: 1 place of 4 kept
    x = tokens(4)
    scores = torch.softmax(x @ moe.router.weight.T, -1)[:, 0]
    best = int(scores.argmax())
    for policy, keep in (("probability", best), ("position", 0)):
        moe = layer(
            top_k=1, normalize_weights=False, capacity_factor=1.0, expert_bias=True, drop_policy=policy
        )
        moe.expert_bias.copy_(torch.tensor([10.0, 0, 0, 0]))
        y = moe(x)
        assert moe.dropped == 3
        assert [i for i in range(4) if y[i].abs().sum() > 0] == [keep], policy


def test_auxiliary_losses_match_their_formulas():
    moe = layer(aux_loss_coef=0.1, z_loss_coef=0.01)
    x = tokens(16)
    moe(x)
    logits = x @ moe.router.weight.T
    probs = torch.softmax(logits, -1)
    chosen = probs.topk(2, -1).indices.reshape(-1)
    share = torch.bincount(chosen, minlength=4).float() / (16 * 2)
    balance = 0.1 * 4 * (share * probs.mean(0)).sum()
    z = 0.01 * torch.logsumexp(logits, -1).square().mean()
    assert_close(moe.aux_loss, balance + z)
    assert moe.load.tolist() == torch.bincount(chosen, minlength=4).tolist()
    # perfectly balanced uniform routing gives the loss its minimum, the coefficient itself
    uniform = layer(aux_loss_coef=1.0)
    uniform.router.weight.data.zero_()
    uniform(tokens(8))  # ties: topk picks some two experts; P_i = 1/4 each, sum of shares 1
    assert math.isclose(uniform.aux_loss.item(), 1.0, rel_tol=1e-6)
    # the loss trains the router: it has a gradient there
    moe.zero_grad()
    moe(x)
    moe.aux_loss.backward()
    assert moe.router.weight.grad.abs().sum() > 0


def test_aux_losses_of_every_layer_sum_into_a_training_loss():
    model = torch.nn.Sequential(layer(), torch.nn.Tanh(), layer(aux_loss_coef=0.5))
    y = model(tokens().reshape(2, 5, 8))
    assert y.shape == (2, 5, 8)
    total = sum(m.aux_loss for m in moe_layers(model))
    assert total.requires_grad and total.item() > 0


@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
def test_grouped_matmul_equals_the_loop_with_an_idle_expert_and_a_sum_loss(activation):
    assert grouped_mm_usable("cpu", torch.float32, 8, 12)
    grouped, loop = (
        layer(activation=activation, grouped_mm=True),
        layer(activation=activation, grouped_mm=False),
    )
    for moe in (grouped, loop):
        moe.router.weight.data[3] = -5.0 * moe.router.weight.data[3].sign()  # expert 3 rarely chosen
    x = tokens(12)
    y, grads = grads_of(grouped, x, MoE.forward)
    want, want_grads = grads_of(loop, x, MoE.forward)
    assert_close(y, want)
    for got, expected in zip(grads, want_grads, strict=True):
        assert_close(got, expected)
    # y.sum() sends a stride-0 gradient, which the grouped matmul's backward would reject unguarded
    grouped.zero_grad()
    grouped(x).sum().backward()
    loop.zero_grad()
    loop(x).sum().backward()
    assert_close(grouped.experts.down_proj.grad, loop.experts.down_proj.grad)


def test_private_torch_operators_the_experts_use_exist():
    """Fails loudly when PyTorch moves a private name `loom.dist._torch_private` wraps for experts."""
    from torch.distributed._functional_collectives import all_to_all_single_autograd

    assert callable(all_to_all_single_autograd) and callable(torch._grouped_mm)


def test_unaligned_sizes_fall_back_to_the_loop_and_bf16_routes_in_fp32():
    assert not grouped_mm_usable("cpu", torch.float32, 6, 12)  # 24-byte rows: not 16-byte aligned
    moe = layer(hidden=6)
    x = torch.randn(5, 6)
    assert_close(moe(x), naive(moe, x)[0])
    with pytest.raises(ValueError, match="grouped_mm = True: .* set grouped_mm None"):
        layer(hidden=6, grouped_mm=True)(x)
    half = layer().to(torch.bfloat16)
    y = half(tokens().to(torch.bfloat16))
    assert y.dtype == torch.bfloat16 and half.aux_loss.dtype == torch.float32


def test_update_bias_moves_towards_underloaded_experts_and_steers_only_the_choice():
    moe = layer(expert_bias=True, top_k=1, normalize_weights=False)
    x = tokens(20)
    moe(x)
    moe(x)
    with torch.no_grad():  # an evaluation between steps counts no load
        moe(x)
    load = moe.load_total.clone()
    assert load.sum() == 40
    used = moe.update_bias(0.01)
    assert torch.equal(used, load)
    assert torch.equal(moe.expert_bias, 0.01 * torch.sign(load.double().mean() - load).float())
    assert moe.load_total.sum() == 0
    # a large bias takes every token to expert 2, whose weight stays its unbiased score
    moe.expert_bias.copy_(torch.tensor([0.0, 0.0, 5.0, 0.0]))
    y = moe(x)
    scores = torch.softmax(x @ moe.router.weight.T, -1)[:, 2:3]
    assert moe.load.tolist() == [0, 0, 20, 0]
    assert_close(y, scores * expert_output(moe, 2, x))
    assert "expert_bias" in moe.state_dict()
    with pytest.raises(ValueError, match="expert_bias=True"):
        layer().update_bias(0.01)


@pytest.mark.parametrize(
    "changes, field",
    [
        ({"experts": 0}, "experts"),
        ({"top_k": 5}, "top_k"),
        ({"score": "relu"}, "score"),
        ({"activation": "relu"}, "activation"),
        ({"capacity_factor": 0.0}, "capacity_factor"),
        ({"drop_policy": "random"}, "drop_policy"),
        ({"aux_loss_coef": -1.0}, "aux_loss_coef"),
        ({"shared_experts": -1}, "shared_experts"),
        ({"top_k": 1}, "normalize_weights"),
    ],
)
def test_config_errors_name_the_field_and_the_fix(changes, field):
    with pytest.raises(ValueError, match=rf"MoEConfig\.{field} = .*: "):
        MoEConfig(**{**BASE, **changes})


def test_no_tokens_give_an_empty_output_and_a_zero_loss():
    moe = layer(capacity_factor=1.0, z_loss_coef=0.1)
    x = torch.randn(0, 8, requires_grad=True)
    y = moe(x)
    (y.sum() + moe.aux_loss).backward()
    assert y.shape == (0, 8) and moe.aux_loss.item() == 0.0 and moe.dropped == 0
    assert moe.router.weight.grad.abs().sum() == 0


def test_wrong_hidden_size_is_a_clear_error():
    with pytest.raises(ValueError, match="hidden is 8"):
        layer()(torch.randn(3, 5))


def test_cost_formula_of_the_expert_parallel_exchanges():
    calls = moe_collectives(experts=8, hidden=16, sent_rows=10, received_rows=6, element_bytes=2, ep=4)
    assert [(c.phase, c.nbytes) for c in calls] == [
        ("forward", 8 * COUNT_BYTES), ("forward", 10 * 32), ("forward", 6 * 32),
        ("backward", 10 * 32), ("backward", 6 * 32),
    ]  # fmt: skip
    assert {c.kind for c in calls} == {"all_to_all"} and {c.axis for c in calls} == {"ep"}
    assert moe_collectives(experts=8, hidden=16, sent_rows=10, received_rows=6, element_bytes=2, ep=1) == []
    model = TransformerConfig(layers=2, hidden=64, heads=4, vocab=100, experts=8, top_k=2)
    plan = ParallelPlan(dp=4, ep=2, micro_batch=2, global_batch=8, seq=16)
    tokens_bytes = 2 * 16 * 2 * 64 * 2  # micro_batch * seq * top_k * hidden * bf16
    assert [c.nbytes for c in layer_moe_collectives(model, plan)] == [64] + [tokens_bytes] * 4


def test_an_uneven_expert_split_suggests_only_ep_values_that_fit_dp():
    from loom.models.moe import check_expert_split

    with pytest.raises(ValueError, match=r"choose ep in \[1, 3, 6\]"):  # 2 is not an inner factor of 12
        check_expert_split(4, 6, 12, ep_name="ep", experts_name="experts")
