"""Tier 2: loom.parallelize in data-parallel and semi-automatic modes equals one device; gradients are
synchronised by bucketed all-reduce."""

import copy

import pytest
import torch
import torch.nn.functional as F
from equivalence import RTOL, adamw, param_atol
from torch import nn
from torch.distributed.tensor.debug import CommDebugMode

import loom
from loom import ops
from loom.dist.context import unsharded
from loom.models import MLP


def _train(model, batches, steps_per_batch=1, local=None):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for x, y in batches:
        xs, ys = (x, y) if local is None else (local(x), local(y))
        loss = F.mse_loss(model(xs), ys)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loom.full(loss).item())
    return losses


def _batches(n=4, batch=16, d_in=12, d_out=5):
    generator = torch.Generator().manual_seed(3)
    return [(torch.randn(batch, d_in, generator=generator), torch.randn(batch, d_out, generator=generator))
            for _ in range(n)]  # fmt: skip


def data_parallel_case(bucket_mb):
    torch.manual_seed(0)
    reference = MLP(12, 32, 5, depth=3)
    model = copy.deepcopy(reference)
    batches = _batches()
    with unsharded():
        expected = _train(reference, batches)
    loom.init()
    rank, world = loom.rank(), loom.world_size()
    loom.parallelize(model, mode="data_parallel", bucket_mb=bucket_mb)
    local = lambda t: t.chunk(world)[rank]  # noqa: E731
    losses = _train(model, batches, local=local)
    # per-rank losses are local; their mean is the global loss
    mean_losses = [torch.tensor(v) for v in losses]
    with CommDebugMode() as comm:
        x, y = batches[0]
        F.mse_loss(model(local(x)), local(y)).backward()
    errors = [
        (p - q).abs().max().item() for p, q in zip(model.parameters(), reference.parameters(), strict=True)
    ]
    sync = model.loom.grad_sync
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return (
        expected,
        [t.item() for t in mean_losses],
        max(errors),
        comm.get_total_counts(),
        (len(sync.buckets), sync.collectives, sync.reduced_bytes == param_bytes),
    )


@pytest.mark.parametrize("world", [2, 4])
def test_data_parallel_matches_one_device(dist_run, world):
    results = dist_run(world, data_parallel_case, 25.0)
    expected = results[0][0]
    mean_losses = torch.tensor([r[1] for r in results]).mean(0)
    torch.testing.assert_close(mean_losses, torch.tensor(expected), rtol=1e-5, atol=1e-6)
    for _, _, param_error, collectives, (buckets, issued, all_bytes) in results:
        assert param_error < 1e-5
        # 1.4k parameters fit one 25 MB bucket: one all-reduce of them, plus the tiny all-reduce that tells
        # every rank which parameters got a gradient anywhere
        assert buckets == 1 and issued == 1 and collectives == 2
        assert all_bytes  # one all-reduce volume of the parameters per step


def test_data_parallel_small_buckets_overlap(dist_run):
    results = dist_run(2, data_parallel_case, 0.001)  # ~1 KB buckets: one per gradient-ready group
    for _, _, param_error, collectives, (buckets, issued, all_bytes) in results:
        assert param_error < 1e-5
        assert buckets > 1 and issued == buckets and collectives == buckets + 1 and all_bytes


class TensorParallelMLP(nn.Module):
    """Megatron's MLP in strategies: first weight cut by columns, second by rows, on `tp` devices,
    with the batch cut over the rest."""

    def __init__(self, dp, tp, d=16, hidden=32):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(d, hidden) / d**0.5)
        self.b1 = nn.Parameter(torch.zeros(hidden))
        self.w2 = nn.Parameter(torch.randn(hidden, d) / hidden**0.5)
        self.up = ops.MatMul().shard(((dp, 1), (1, tp)))
        self.bias = ops.Add().shard(((dp, tp), (tp,)))
        self.act = ops.GELU().shard(((dp, tp),))
        self.down = ops.MatMul().shard(((dp, tp), (tp, 1)))

    def forward(self, x, y):
        out = self.down(self.act(self.bias(self.up(x, self.w1), self.b1)), self.w2)
        return ((out - y) ** 2).mean()


SEMI_AUTO_LR = 1e-2


def semi_auto_case(dp, tp):
    torch.manual_seed(0)
    reference = TensorParallelMLP(dp, tp)
    model = copy.deepcopy(reference)
    batches = [(x, y.repeat(1, 4)[:, :16]) for x, y in _batches(d_in=16)]
    optimizer = adamw(reference.parameters(), lr=SEMI_AUTO_LR)
    expected = []
    for x, y in batches:
        with unsharded():
            loss = reference(x, y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        expected.append(loss.item())
    mesh = loom.init({"dp": dp, "tp": tp})
    local = lambda t: t.chunk(dp)[mesh.dp_rank()]  # noqa: E731  (tensor-parallel peers read the same rows)
    loom.parallelize(model, mode="semi_auto", example_inputs=(local(batches[0][0]), local(batches[0][1])))
    optimizer = adamw(model.parameters(), lr=SEMI_AUTO_LR)
    losses = []
    for x, y in batches:
        loss = model(local(x), local(y))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loom.full(loss).item())
    errors = {name: (loom.full(p) - q).abs().max().item()
              for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True)}  # fmt: skip
    shapes = {name: tuple(p.to_local().shape) for name, p in model.named_parameters()}
    return expected, losses, errors, shapes, model.loom.describe()


@pytest.mark.parametrize(("dp", "tp"), [(1, 4), (2, 2), (4, 1)])
def test_semi_auto_tensor_parallel_mlp_matches_one_device(dist_run, dp, tp):
    for expected, losses, errors, shapes, plan in dist_run(4, semi_auto_case, dp, tp):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=RTOL, atol=1e-7)
        assert max(errors.values()) <= param_atol(SEMI_AUTO_LR, len(losses)), errors
        assert shapes == {"w1": (16, 32 // tp), "b1": (32 // tp,), "w2": (32 // tp, 16)}, plan


def test_parallelize_rejects_unknown_mode():
    with pytest.raises(ValueError, match="unknown mode 'fast'"):
        loom.parallelize(nn.Linear(2, 2), mode="fast")


class Branchy(nn.Module):
    """`b` runs only when the caller asks (a data-dependent branch, as in mixture-of-experts routing)."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 1)

    def forward(self, x, use_b):
        h = self.a(x)
        return self.c(self.b(h) if use_b else h)


def unused_case(bucket_mb):
    torch.manual_seed(0)
    model = Branchy()
    loom.init()
    loom.parallelize(model, mode="data_parallel", bucket_mb=bucket_mb)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    rank = loom.rank()
    grads = []
    for use_b in (True, rank == 0, False):  # b: used everywhere, then on rank 0 only, then nowhere
        optimizer.zero_grad()
        model(torch.ones(2, 4) * (rank + 1), use_b).sum().backward()
        grads.append(None if model.b.weight.grad is None else model.b.weight.grad.sum().item())
        optimizer.step()
    return grads, [p.detach().clone() for p in model.parameters()]


def test_parameters_used_on_some_ranks_get_the_average_everywhere(dist_run):
    for bucket_mb in (25.0, 1e-5):  # one bucket, and one bucket per gradient
        (grads0, params0), (grads1, params1) = dist_run(2, unused_case, bucket_mb)
        assert grads0[:2] == grads1[:2] and grads0[1] is not None  # rank 1 gets rank 0's gradient / 2
        assert grads0[2] is None and grads1[2] is None  # used nowhere: no gradient, as on one device
        assert all(torch.equal(a, b) for a, b in zip(params0, params1, strict=True))  # replicas agree


class TiedAndKeyword(nn.Module):
    """A weight used twice (tied), and a target passed by keyword."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Parameter(torch.randn(8, 4))
        self.first = ops.MatMul().shard(((1, 2), (2, 1)))
        self.second = ops.MatMul(transpose_b=True).shard(((1, 1), (2, 1)))

    def forward(self, x, target=None):
        out = self.second(self.first(x, self.embed), self.embed)
        return ((out - target) ** 2).mean()


def tied_keyword_case(rows):
    torch.manual_seed(0)
    model = TiedAndKeyword()
    loom.init()
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    loom.parallelize(model, mode="semi_auto", example_inputs=(x[:2],), example_kwargs={"target": x[:2]})
    loss = model(x[:2], target=x[:2])  # the keyword input is distributed like the positional one
    shape = tuple(model.embed.to_local().shape)
    try:
        model(x[: rows[loom.rank()]], target=x[: rows[loom.rank()]])
        error = None
    except ValueError as caught:
        error = str(caught)
    return shape, loom.full(loss).item(), error


def test_tied_weight_keeps_its_layout_keywords_are_distributed_and_uneven_batches_are_refused(dist_run):
    for shape, loss, error in dist_run(2, tied_keyword_case, (2, 1)):
        assert shape == (4, 4)  # (8, 4) cut in two by rows, although the weight has a second consumer
        assert loss > 0
        assert "local batches of different sizes (rank 0: [2, 2], rank 1: [1, 1] rows" in error
