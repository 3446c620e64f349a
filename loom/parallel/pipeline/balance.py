"""The balancing losses of a pipeline stage's mixtures of experts, carried by the stage's output.

Without pipelines the `Trainer` adds `aux_losses(model)` to the loss it differentiates. A pipeline stage
other than the last has no loss: torch's schedules run its backward from the gradient of its output, which
comes back from the next stage. So each stage's output carries its layers' balancing losses
(`carry_balancing_losses`): the output passes through unchanged, and in backward the losses receive the
gradient the micro-batch's loss gets (`weight`: the step's scale over the micro-batches), as Megatron's
`MoEAuxLossAutoScaler` does. The losses are formed on the micro-batch's tokens (on a stage mesh: the rows of
every data-parallel replica, summed first as `MoEMLP` does), so a pipeline step of M micro-batches computes
what one device computes accumulating the same M micro-batches.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from loom.models.moe import aux_losses, moe_layers
from loom.parallel.pipeline.tensor_stages import local_share


class _Carry(torch.autograd.Function):
    """`output` unchanged; in backward, `aux` gets `weight` as its gradient (it adds `weight * aux` to what
    the schedule differentiates)."""

    @staticmethod
    def forward(ctx, output: torch.Tensor, aux: torch.Tensor, weight: float) -> torch.Tensor:  # noqa: ANN001
        ctx.weight = weight
        ctx.save_for_backward(aux)
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: ANN001, ANN205
        (aux,) = ctx.saved_tensors
        return grad, torch.full_like(aux, ctx.weight), None


def carry_balancing_losses(
    module: nn.Module, weight: Callable[[], float], working: Callable[[], bool]
) -> bool:
    """Make `module` (a pipeline stage) carry the balancing losses of its mixtures of experts on its output,
    with gradient `weight()` (read at each forward); False (nothing done) for a stage without any.

    torch's schedules also run a stage's forward outside its pieces of work (`working()` false), on
    placeholder inputs, to infer shapes: the loads that forward counts are taken back, so that the
    balancing biases move by the micro-batches' tokens alone."""
    layers = list(moe_layers(module))
    if not layers:
        return False
    before: list[torch.Tensor] = []

    def keep(_: nn.Module, args: tuple) -> None:
        before[:] = [] if working() else [layer.load_total.clone() for layer in layers]

    def hook(_: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        if before:
            with torch.no_grad():
                for layer, load in zip(layers, before, strict=True):
                    layer.load_total.copy_(load)
        aux = aux_losses(module)
        if aux is None or not torch.is_grad_enabled() or not aux.requires_grad:
            return output
        # on a stage mesh the losses are replicated DTensors: this rank's plain value, the same gradient
        carried = _Carry.apply(output, local_share(aux), weight())
        # a zero-bubble schedule detaches its stages' outputs in place, which a view does not allow
        return carried.clone() if getattr(module, "copy_output", False) else carried

    module.register_forward_pre_hook(keep)
    module.register_forward_hook(hook)
    return True
