"""Tier 2: loom.shard on functions and modules, with strategies and Layouts, equals the unsharded call."""

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode

import loom
from loom.dist.comm import collective_counts
from loom.dist.context import unsharded


def attention_scores(q, k):
    return torch.softmax(q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5, dim=-1)


def function_case():
    loom.init({"dp": 2, "tp": 2})
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(4, 6, 8, generator=generator, requires_grad=True)
    k = torch.randn(4, 6, 8, generator=generator, requires_grad=True)
    expected = attention_scores(q, k)
    grad_q, grad_k = torch.autograd.grad(expected.sum() * 0 + (expected**2).sum(), (q, k))
    layout = loom.Layout((2, 2), ("dp", "tp"))
    sharded = loom.shard(attention_scores, (layout("dp", "tp", "None"), (2, 1, 1)), out_strategy=((4, 1, 1),))
    out = sharded(q, k)
    got_q, got_k = torch.autograd.grad((loom.full(out) ** 2).sum(), (q, k))
    return (
        (loom.full(out) - expected).abs().max().item(),
        (got_q - grad_q).abs().max().item(),  # plain tensors in: whole gradients out, on every rank
        (got_k - grad_k).abs().max().item(),
        out.to_local().shape,
    )


def test_shard_function_with_layout_and_strategy(dist_run):
    for out_error, q_error, k_error, local_shape in dist_run(4, function_case):
        assert out_error < 1e-6 and q_error < 1e-5 and k_error < 1e-5
        assert local_shape == (1, 6, 6)  # out_strategy ((4, 1, 1),): batch over all 4 ranks


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(8, 16)
        self.down = nn.Linear(16, 8)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


def module_case():
    loom.init()
    torch.manual_seed(0)
    block = Block()
    x = torch.randn(8, 8)
    with unsharded():
        expected = block(x)
        expected.sum().backward()
    grads = {name: p.grad.clone() for name, p in block.named_parameters()}
    block.zero_grad()
    # Megatron's MLP: up cut by output features (rows of nn.Linear's weight), down by input features.
    plan = {"up.weight": (2, 1), "up.bias": (2,), "down.weight": (1, 2)}
    sharded = loom.shard(block, ((1, 1),), out_strategy=((1, 1),), parameter_plan=plan)
    out = sharded(x)
    out.sum().backward()
    shapes = {name: tuple(p.to_local().shape) for name, p in sharded.named_parameters()}
    errors = [(loom.full(p.grad) - grads[name]).abs().max().item() for name, p in sharded.named_parameters()]
    return (loom.full(out) - expected).abs().max().item(), max(errors), shapes, isinstance(out, DTensor)


def test_shard_module_with_parameter_plan(dist_run):
    for out_error, grad_error, shapes, is_dtensor in dist_run(2, module_case):
        assert out_error < 1e-6 and grad_error < 1e-5 and is_dtensor
        assert shapes == {"up.weight": (8, 8), "up.bias": (8,), "down.weight": (8, 8), "down.bias": (8,)}


def bad_plan_case():
    loom.init()
    try:
        loom.shard(Block(), ((1, 1),), parameter_plan={"up.wieght": (2, 1)})
    except ValueError as error:
        return str(error)


def test_shard_module_unknown_parameter_is_named(dist_run):
    for message in dist_run(2, bad_plan_case):
        assert "unknown parameter 'up.wieght'" in message and "up.weight" in message


def layout_change_case():
    loom.init()
    x = torch.randn(16, 4, generator=torch.Generator().manual_seed(0))
    rows = loom.shard(lambda t: t, ((8, 1),))(x)
    with CommDebugMode() as comm:
        cols = loom.shard(lambda t: t, ((1, 4),))(rows)
    return collective_counts(comm), torch.equal(loom.full(cols), x)


def test_rows_to_columns_on_8_ranks(dist_run):
    for counts, equal in dist_run(8, layout_change_case):
        assert equal
        # rows over 8 -> columns over 4 (replicated over the outer 2): DTensor's all-to-all per mesh dim
        # (gloo emulates all-to-all with an all-gather); never more than one collective per mesh dim
        assert sum(counts.values()) <= 3, counts


def test_shard_needs_init():
    with pytest.raises(RuntimeError, match="call loom.init"), unsharded():
        loom.shard(lambda t: t, ((1,),))
