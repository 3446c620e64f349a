"""How a parallel run is compared with one device, so that the comparison holds on every CPU.

Two runs of the same maths differ by rounding: another CPU (AVX-512 or AVX2 kernels, another thread count)
or another mesh (tensor-parallel shards summed in another order) changes every output, loss and gradient by
about 1e-7 relative. Whatever is Lipschitz in its inputs carries that difference through at the same scale.
The rule every equivalence test follows:

1. Losses, outputs, gradient norms and gradients: relative tolerance `RTOL`.
2. Parameters after optimizer steps are compared only when each step is Lipschitz in the gradient: SGD, or
   AdamW with `eps = LIPSCHITZ_EPS` (`adamw`, `ADAMW`). Adam's update `m / (sqrt(v) + eps)` with the default
   `eps = 1e-8` is not: for an entry whose gradients are near zero, `sqrt(v) ~ |m|`, and a rounding
   difference in that gradient moves the entry by up to `lr`, whatever the tolerance of everything else
   (seen: one entry of 1024 off by 1.4e-5 under AVX2 while losses agreed to 1e-7). With `eps = 1e-3` a step
   moves by at most `lr * dg / eps` more when the gradient moves by `dg`: `param_atol` is that bound.
3. Where a test keeps the true AdamW (`eps = 1e-8`), its parameters are compared with
   `assert_adamw_params_close`: every entry within the most two runs can drift apart (`2 * lr * steps`: with
   `(1 - beta1) <= sqrt(1 - beta2)` Adam moves an entry by at most `lr` a step) and nearly every entry within
   `param_atol`.
4. Bitwise claims (resume, restart) compare a machine with itself (`torch.equal`), never with tolerances.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

RTOL = 1e-5
"""Relative tolerance for losses, outputs, gradient norms and gradients (fp32)."""

LIPSCHITZ_EPS = 1e-3
"""AdamW's `eps` in equivalence tests: a step then moves by at most `lr / eps` per unit of gradient change."""

GRAD_ATOL = 1e-7
"""How far the runs' gradient entries may differ (absolute): fp32 rounding of sums whose entries are below
0.1 here (the largest gradient entry of the test models is about 0.06)."""

ADAMW = {"lr": 3e-3, "weight_decay": 0.1, "eps": LIPSCHITZ_EPS, "betas": (0.9, 0.95)}
"""The equivalence tests' AdamW hyper-parameters (`make_optimizer(model, torch.optim.AdamW, level, **ADAMW)`)."""

NEAR_ALL = 0.99
"""With the true AdamW, the share of entries that must still agree within `param_atol`."""


def adamw(params: Iterable[torch.nn.Parameter], **overrides) -> torch.optim.AdamW:
    """AdamW whose steps are Lipschitz in the gradient (`ADAMW`, any key overridden)."""
    return torch.optim.AdamW(params, **(ADAMW | overrides))


def param_atol(lr: float, steps: int, eps: float = LIPSCHITZ_EPS) -> float:
    """Absolute tolerance for parameters after `steps` Lipschitz AdamW (or SGD, `eps = 1`) steps: each step
    moves an entry by at most `lr * GRAD_ATOL / eps` more; a factor 10 covers the moments' accumulation and
    the gradients' own drift as the parameters drift."""
    return 10 * steps * lr * GRAD_ATOL / eps


def assert_params_close(
    actual: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Tensor], *, lr: float, steps: int,
    eps: float = LIPSCHITZ_EPS,
) -> None:  # fmt: skip
    """Every parameter of `expected` is in `actual` and within `param_atol(lr, steps, eps)`."""
    assert actual.keys() == expected.keys(), sorted(set(actual) ^ set(expected))
    atol = param_atol(lr, steps, eps)
    for name, tensor in expected.items():
        torch.testing.assert_close(actual[name], tensor, rtol=0, atol=atol, msg=lambda m, n=name: f"{n}: {m}")


def assert_adamw_params_close(
    actual: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Tensor], *, lr: float, steps: int
) -> None:
    """Parameters after `steps` steps of the true AdamW (`eps = 1e-8`, `(1 - beta1) <= sqrt(1 - beta2)`):
    every entry within `2 * lr * steps` (how far two runs can drift apart at most) and `NEAR_ALL` of them
    within `param_atol` (only entries with near-zero gradients may move by a rounding difference)."""
    assert actual.keys() == expected.keys(), sorted(set(actual) ^ set(expected))
    bound, tight = 2 * lr * steps, param_atol(lr, steps)
    errors = torch.cat([(actual[name] - tensor).abs().flatten() for name, tensor in expected.items()])
    assert errors.max().item() <= bound, (
        f"an entry moved {errors.max().item():.3g} > 2 * lr * steps = {bound}"
    )
    share = (errors <= tight).float().mean().item()
    assert share >= NEAR_ALL, f"only {share:.4f} of the entries agree within {tight:.3g} (need {NEAR_ALL})"


def train_steps(
    model: torch.nn.Module, optimizer, batches: Iterable, loss_of, keep_grads: bool = True
) -> tuple:
    """Train `model` one `optimizer` step per batch (`loss_of(batch)` gives the step's loss): the losses, the
    first step's gradients (None when not `keep_grads`: above optimizer level 1 each rank keeps only its chunk
    of them) and the parameters after the last step, all whole on every rank (`loom.full`; a model sharded
    at rest, optimizer level 3, gathered for it), for comparing a parallel run with one device."""
    import contextlib

    import loom

    losses, grads = [], None
    for step, batch in enumerate(batches):
        loss = loss_of(batch)
        optimizer.zero_grad()
        loss.backward()
        if step == 0 and keep_grads:
            grads = {name: loom.full(p.grad).clone() for name, p in model.named_parameters()}
        optimizer.step()
        losses.append(loom.full(loss).item())
    state = getattr(model, "loom", None)
    with state.full_parameters() if state is not None else contextlib.nullcontext():
        params = {name: loom.full(p).detach().clone() for name, p in model.named_parameters()}
    return losses, grads, params


def sgd_losses_and_first_grads(model: torch.nn.Module, batches: Iterable, loss_of, lr: float) -> tuple:
    """`train_steps` with plain SGD at `lr`: the losses and the first step's gradients."""
    losses, grads, _ = train_steps(model, torch.optim.SGD(model.parameters(), lr=lr), batches, loss_of)
    return losses, grads
