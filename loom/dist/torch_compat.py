"""Where the older torch releases loom supports (2.11 and up; the suite runs 2.13) behave differently.

Each fix here is applied once, at `import loom.dist` (every part of loom that builds DTensors imports it,
workers included), and only to the releases that need it; each names the first release found without the
problem. What differs only in an expected figure, and not in loom's results, is documented in docs/gpu.md.
"""

from __future__ import annotations

import warnings

import torch

# torch 2.11's backward of topk, max/min over a dim, sort and median builds its zero gradient with
# `at::zeros(sizes, grad.options())`, a plain tensor, then scatters the DTensor gradient into it: DTensor
# refuses the mix ("aten.scatter.src got mixed torch.Tensor and DTensor"), so a Mixtral router (top-k over
# tensor-parallel activations) cannot train. 2.13 builds it from the gradient itself; 2.12 was not checked.
VALUE_SELECTING_FIXED_IN = (2, 13)

_LIBRARIES: list[torch.library.Library] = []  # a registration lasts as long as its Library object


def torch_version() -> tuple[int, int]:
    """This torch's (major, minor) release."""
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int(minor)


def value_selecting_reduction_backward(
    grad: torch.Tensor, dim: int, indices: torch.Tensor, sizes: list[int], keepdim: bool
) -> torch.Tensor:
    """The gradient of a value-selecting reduction (topk, max/min over `dim`, sort, median...): `grad`
    scattered at `indices` into zeros of the input's `sizes`, the zeros made from `grad` so that a
    DTensor gradient gives a DTensor on the same mesh (torch 2.13's formula)."""
    if not keepdim and len(sizes) > 0:
        grad, indices = grad.unsqueeze(dim), indices.unsqueeze(dim)
    return grad.new_zeros(sizes).scatter(dim, indices, grad)


def install() -> None:
    """Apply the fixes this torch needs; a second call does nothing."""
    if _LIBRARIES or torch_version() >= VALUE_SELECTING_FIXED_IN:
        return
    library = torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():  # torch warns that an existing kernel is replaced: that is the point
        warnings.simplefilter("ignore", UserWarning)
        library.impl(
            "value_selecting_reduction_backward",
            value_selecting_reduction_backward,
            "CompositeImplicitAutograd",
        )
    _LIBRARIES.append(library)


# torch 2.11's DTensor rule for `F.pad` (aten.constant_pad_nd) answers a one-axis placement whatever the
# mesh, so on a 2-D mesh the input's redistribution fails (IndexError in `generate_greedy_transform_infos`):
# Hugging Face's causal-LM loss pads the labels. 2.13 keeps the cuts of the dims it does not pad.
PAD_FIXED_IN = (2, 13)


def pad_dtensor(input, pad, mode: str = "constant", value: float | None = None):  # noqa: A002, ANN001, ANN201
    """`F.pad` of a DTensor as torch 2.13 lays it out: cuts of dims that are not padded stay (each rank pads
    its shard); a cut of a padded dim, or a partial sum, is gathered first (on its mesh axis alone)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from loom.parallel.local_region import contiguous_strides  # here: loom.parallel imports loom.dist

    ndim = input.ndim
    padded = {ndim - 1 - i for i in range(len(pad) // 2) if pad[2 * i] or pad[2 * i + 1]}
    kept = [
        p if isinstance(p, Replicate) or (type(p) is Shard and p.dim % ndim not in padded) else Replicate()
        for p in input.placements
    ]
    if kept != list(input.placements):
        input = input.redistribute(input.device_mesh, kept)
    local = torch.nn.functional.pad(input.to_local(), pad, mode=mode, value=value)
    shape = list(input.shape)
    for dim in padded:
        i = ndim - 1 - dim
        shape[dim] += pad[2 * i] + pad[2 * i + 1]
    return DTensor.from_local(
        local, input.device_mesh, input.placements, shape=torch.Size(shape), stride=contiguous_strides(shape)
    )


def local_regions() -> dict:
    """Torch functions that loom's semi-automatic forward (`loom.parallel.lift`) runs through these fixes
    instead of DTensor's rule, on the releases that need it."""
    if torch_version() >= PAD_FIXED_IN:
        return {}
    return {torch.nn.functional.pad: pad_dtensor}
