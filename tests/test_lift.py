"""Tier 2: the local regions of `loom.parallel.lift` on cuts a Hugging Face model does not make: attention on
3-D inputs cut along the sequence, cross entropy with class weights and an `ignore_index` past the classes,
uneven batch cuts, and the fused losses DTensor differentiates wrongly on a cut batch (2 ranks; rtol 1e-5
against one device)."""

import torch
import torch.nn.functional as F
from equivalence import RTOL
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import loom
from loom.parallel.lift import local_attention, local_cross_entropy


def attention_case():
    mesh = loom.init({"dp": 2}).device_mesh
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(3, 8, 4, generator=generator) for _ in range(3))  # (batch, seq, dim); 3 rows
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    by_seq = [distribute_tensor(t, mesh, [Shard(1)]) for t in (q, k, v)]  # the sequence cut: gathered
    by_rows = [distribute_tensor(t, mesh, [Shard(0)]) for t in (q, k, v)]  # 3 rows over 2 ranks: uneven
    mask = torch.ones(8, 8, dtype=torch.bool).tril()
    positional = F.scaled_dot_product_attention(q, k, v, mask, 0.0)  # sdpa's positional mask and dropout
    errors = [
        (local_attention(*cut, is_causal=True).full_tensor() - expected).abs().max().item()
        for cut in (by_seq, by_rows)
    ]
    errors.append((local_attention(*by_rows, mask, 0.0).full_tensor() - positional).abs().max().item())
    # a DTensor and a plain tensor met inside a namedtuple are lifted as inside a plain tuple
    from collections import namedtuple

    from loom.parallel.lift import LiftPlainTensors

    pair = namedtuple("Pair", "a b")
    with LiftPlainTensors():
        joined = torch.cat(pair(by_rows[0], torch.zeros(3, 8, 4)), dim=2)
    errors.append((joined.full_tensor() - torch.cat([q, torch.zeros(3, 8, 4)], dim=2)).abs().max().item())
    return errors


def test_attention_on_3d_inputs_cut_along_the_sequence_or_unevenly_matches_one_device(dist_run):
    for errors in dist_run(2, attention_case):
        assert max(errors) < 1e-6, errors


def cross_entropy_case():
    mesh = loom.init({"dp": 2}).device_mesh
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 5, generator=generator)
    labels = torch.tensor([0, 5, 3, 5, 1, 4])  # 5: ignored, past the 5 classes
    weight = torch.rand(5, generator=generator)
    results = []
    for reduction in ("mean", "sum"):
        expected = F.cross_entropy(logits, labels, weight=weight, ignore_index=5, reduction=reduction)
        cut = local_cross_entropy(
            distribute_tensor(logits, mesh, [Shard(0)]), distribute_tensor(labels, mesh, [Shard(0)]),
            weight=DTensor.from_local(weight, mesh, [Replicate()]), ignore_index=5, reduction=reduction,
        )  # fmt: skip
        results.append((cut.full_tensor().item(), expected.item()))
    return results


def test_weighted_cross_entropy_with_an_ignore_index_past_the_classes_matches_one_device(dist_run):
    for results in dist_run(2, cross_entropy_case):
        for got, want in results:
            assert abs(got - want) <= RTOL * abs(want), results


class _Regression(torch.nn.Module):
    """A linear layer scored by `loss` (a name of `LOSSES`) against a target in [0, 1]."""

    def __init__(self, loss: str) -> None:
        super().__init__()
        self.linear, self.loss = torch.nn.Linear(4, 3), loss

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return LOSSES[self.loss](self.linear(x), y)


LOSSES = {  # the fused losses DTensor gets wrong on a cut batch, with their reductions and options
    "mse": lambda out, y: F.mse_loss(out, y),
    "mse sum": lambda out, y: F.mse_loss(out, y, reduction="sum"),
    "mse legacy size_average": lambda out, y: F.mse_loss(out, y, size_average=False),
    "mse elementwise_mean": lambda out, y: F.mse_loss(out, y, reduction="elementwise_mean"),
    "mse weighted": lambda out, y: F.mse_loss(out, y, weight=_weights(out)),
    "smooth_l1": lambda out, y: F.smooth_l1_loss(out, y, beta=0.5),
    "huber": lambda out, y: F.huber_loss(out, y, delta=0.5),
    "soft_margin": lambda out, y: F.soft_margin_loss(out, y * 2 - 1),
    "binary_cross_entropy": lambda out, y: F.binary_cross_entropy(out.sigmoid(), y),
}


def _weights(out: torch.Tensor) -> torch.Tensor:
    """Weights of every element of `out`, made in forward (1, 2, 3, 1, ...)."""
    return (torch.arange(out.numel(), device=out.device) % 3 + 1.0).reshape(out.shape)


def losses_case():
    """Each loss of `LOSSES` in a semi_auto model on dp 2 (rows cut over the ranks): the loss and the
    weight's gradient, and one device's."""
    import copy

    loom.init({"dp": 2})
    generator = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, 4, generator=generator), torch.rand(8, 3, generator=generator)
    rows = lambda t: t.chunk(2)[loom.rank()]  # noqa: E731
    results = {}
    for name in LOSSES:
        torch.manual_seed(0)
        reference = _Regression(name)
        model = loom.parallelize(
            copy.deepcopy(reference), mode="semi_auto", example_inputs=(rows(x), rows(y))
        )
        expected = reference(x, y)
        expected.backward()
        loss = model(rows(x), rows(y))
        loss.backward()
        grad = model.linear.weight.grad
        results[name] = (
            loss.full_tensor(),
            grad.full_tensor(),
            expected.detach(),
            reference.linear.weight.grad,
        )
    return results


def test_fused_losses_on_a_cut_batch_give_one_devices_gradients(dist_run):
    """DTensor's own rules for these losses give n times the gradient on rows cut over n ranks (torch 2.13);
    run inside a semi_auto model they give one device's loss and gradients, at every reduction."""
    for results in dist_run(2, losses_case):
        for name, (loss, grad, expected_loss, expected_grad) in results.items():
            torch.testing.assert_close(loss, expected_loss, rtol=RTOL, atol=0, msg=name)
            torch.testing.assert_close(grad, expected_grad, rtol=RTOL, atol=1e-7, msg=name)
