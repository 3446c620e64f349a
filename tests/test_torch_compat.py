"""loom.dist.torch_compat: the gradient of value-selecting reductions (topk, max over a dim, sort) through
DTensors, on every torch loom supports (torch 2.11's own formula mixes a plain tensor into the DTensor
gradient and fails)."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

import loom
from loom.dist import torch_compat

REDUCTIONS = {
    "topk": lambda x: torch.topk(x, 3, dim=-1).values,
    "topk_dim0": lambda x: torch.topk(x, 2, dim=0).values,
    "max": lambda x: x.max(dim=-1).values,
    "max_keepdim": lambda x: x.max(dim=1, keepdim=True).values,
    "sort": lambda x: x.sort(dim=-1).values,
}


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(4, 8, generator=generator)
    return x, torch.randn(4, 8, generator=generator)  # a weight, so that every gradient entry differs


@pytest.mark.parametrize("keepdim", [False, True])
@pytest.mark.parametrize("dim", [0, 1, -1])
def test_the_formula_is_torchs_gradient_of_max(dim, keepdim):
    x, _ = _inputs()
    x.requires_grad_(True)
    values, indices = x.max(dim=dim, keepdim=keepdim)
    grad = torch.randn(values.shape, generator=torch.Generator().manual_seed(1))
    (expected,) = torch.autograd.grad(values, x, grad)
    got = torch_compat.value_selecting_reduction_backward(grad, dim, indices, list(x.shape), keepdim)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    # and by hand: the gradient lands where the maximum was, zero elsewhere
    dense = torch.zeros_like(x).scatter(
        dim, indices if keepdim else indices.unsqueeze(dim), grad if keepdim else grad.unsqueeze(dim)
    )
    torch.testing.assert_close(got, dense, rtol=0, atol=0)


def test_the_fix_is_installed_exactly_where_torch_needs_it():
    needed = torch_compat.torch_version() < torch_compat.VALUE_SELECTING_FIXED_IN
    assert bool(torch_compat._LIBRARIES) == needed
    torch_compat.install()  # a second call changes nothing
    assert len(torch_compat._LIBRARIES) == int(needed)


def dtensor_reduction_grads() -> dict[str, dict[str, torch.Tensor]]:
    """On 2 ranks: each reduction's input gradient through a DTensor, sharded on rows and replicated; then
    `pad_dtensor` on a 2-axis mesh (what torch 2.11's own rule cannot redistribute)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    mesh = loom.init({"tp": 2})
    x, weight = _inputs()
    grads: dict[str, dict[str, torch.Tensor]] = {}
    for layout, placement in (("rows", Shard(0)), ("replicated", Replicate())):
        grads[layout] = {}
        for name, reduce in REDUCTIONS.items():
            if layout == "rows" and name == "topk_dim0":
                continue  # a top-k across the sharded dim: not what this checks
            leaf = distribute_tensor(x, mesh.device_mesh, [placement]).requires_grad_(True)
            (reduce(leaf * distribute_tensor(weight, mesh.device_mesh, [placement]))).sum().backward()
            grads[layout][name] = leaf.grad.full_tensor()
    # a 2-axis mesh (loom.init drops axes of 1): torch 2.11's own rule answers one placement for it
    grads["pad"] = _pads(init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp")))
    return grads


PADS = {"last": (0, 1), "rows": (0, 0, 2, 1)}  # pad the last dim; pad the first dim (and not the last)


def _pads(mesh) -> dict[str, object]:  # noqa: ANN001
    """Each `PADS` of a (rows, columns) DTensor cut on both mesh axes: values, placements, gradient."""
    from torch.distributed.tensor import distribute_tensor

    x, weight = _inputs()
    out = {}
    for name, pad in PADS.items():
        leaf = distribute_tensor(x, mesh, [Shard(0), Shard(1)]).requires_grad_(True)
        padded = torch_compat.pad_dtensor(leaf, pad, value=-1.0)
        (
            padded * distribute_tensor(torch.nn.functional.pad(weight, pad), mesh, padded.placements)
        ).sum().backward()
        out[name] = (padded.full_tensor(), tuple(padded.placements), leaf.grad.full_tensor())
    return out


def test_dtensor_gradients_of_value_selecting_reductions_equal_one_device(dist_run):
    x, weight = _inputs()
    expected = {}
    for name, reduce in REDUCTIONS.items():
        leaf = x.clone().requires_grad_(True)
        reduce(leaf * weight).sum().backward()
        expected[name] = leaf.grad
    for rank in dist_run(2, dtensor_reduction_grads):
        pads = rank.pop("pad")
        for name, pad in PADS.items():
            values, placements, grad = pads[name]
            torch.testing.assert_close(values, torch.nn.functional.pad(x, pad, value=-1.0), rtol=0, atol=0)
            torch.testing.assert_close(grad, weight, rtol=0, atol=0)  # the padding takes no gradient back
            # the cut of a dim that is not padded stays; a padded dim's is gathered
            assert placements == {"last": (Shard(0), Replicate()), "rows": (Replicate(), Shard(1))}[name]
        for layout, grads in rank.items():
            for name, grad in grads.items():
                torch.testing.assert_close(grad, expected[name], rtol=1e-6, atol=1e-6, msg=f"{layout} {name}")


def test_the_registered_kernel_is_what_autograd_runs():
    """In a fresh process, the fix installed as on an older torch: topk's backward (plain tensors here)
    runs loom's formula through the `torch.library` registration, with torch's own result."""
    import subprocess
    import sys

    code = """
import torch
import loom.dist.torch_compat as tc
calls = []
formula = tc.value_selecting_reduction_backward
tc.value_selecting_reduction_backward = lambda *a: calls.append(1) or formula(*a)
tc.VALUE_SELECTING_FIXED_IN = (99, 0)
x = torch.randn(4, 6, generator=torch.Generator().manual_seed(0), requires_grad=True)
(before,) = torch.autograd.grad(x.topk(3, dim=1).values.sum(), x)
tc.install()
(after,) = torch.autograd.grad(x.topk(3, dim=1).values.sum(), x)
assert calls, "the registered formula did not run"
torch.testing.assert_close(after, before, rtol=0, atol=0)
print("ok", len(calls))
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.startswith("ok"), done.stderr[-2000:]
