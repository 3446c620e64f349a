"""Federated averaging (McMahan et al. 2017): clients with private data train locally; a server averages
their updates, weighted by their data, with a sampled subset of clients taking part in each round.

    clients = dirichlet_split(labels, clients=100, alpha=0.3, seed=0)      # non-IID: index lists per client
    data = [(x[idx], y[idx]) for idx in clients]                          # each client's private tensors
    history = fedavg(model, data, rounds=50, per_round=10, local_epochs=1, batch_size=32,
                     make_optimizer=lambda params: torch.optim.SGD(params, lr=0.1), loss_fn=F.cross_entropy)

The client population may be far larger than the number of processes: each round's sampled clients are
dealt to the ranks in turn and each rank simulates its clients one after another, from the round's global
weights. What leaves a client is its weighted parameter update (local weights minus the round's global
weights, times its number of examples); the ranks sum those updates and the counts with one all-reduce of
the parameters' bytes (plus one number) per round, so raw data never moves. Every rank samples the same
clients from `seed` and the round, and ends each round with the same global weights.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

__all__ = ["RoundReport", "dirichlet_split", "fedavg", "iid_split", "label_split"]


def iid_split(count: int, clients: int, seed: int = 0) -> list[list[int]]:
    """Indices 0..count-1 shuffled and dealt into `clients` parts of equal size (the first get one more)."""
    _check_clients(clients, count)
    order = list(range(count))
    random.Random(f"loom-iid:{seed}").shuffle(order)
    return [sorted(order[c::clients]) for c in range(clients)]


def label_split(
    labels: Sequence[int], clients: int, labels_per_client: int, seed: int = 0
) -> list[list[int]]:
    """Pathological non-IID: each client holds examples of only `labels_per_client` labels. Each label's
    examples are cut into as many equal shards as clients hold that label, and shards are dealt out."""
    _check_clients(clients, len(labels))
    classes = sorted(set(labels))
    if not 1 <= labels_per_client <= len(classes):
        raise ValueError(
            f"labels_per_client = {labels_per_client} must be in [1, {len(classes)}] (the labels)"
        )
    if clients * labels_per_client < len(classes):
        raise ValueError(
            f"{clients} clients x labels_per_client = {labels_per_client} hold fewer labels than the "
            f"{len(classes)} there are: raise labels_per_client to {-(-len(classes) // clients)} or use more clients"
        )
    rng = random.Random(f"loom-labels:{seed}")
    held = [[classes[(c * labels_per_client + k) % len(classes)] for k in range(labels_per_client)]
            for c in range(clients)]  # fmt: skip
    holders = {label: [c for c in range(clients) if label in held[c]] for label in classes}
    out: list[list[int]] = [[] for _ in range(clients)]
    for label in classes:
        examples = [i for i, y in enumerate(labels) if y == label]
        rng.shuffle(examples)
        owners = holders[label]
        for k, owner in enumerate(owners):
            out[owner] += examples[k :: len(owners)]
    return [sorted(part) for part in out]


def dirichlet_split(
    labels: Sequence[int], clients: int, alpha: float, seed: int = 0, min_size: int = 1
) -> list[list[int]]:
    """Non-IID by Dirichlet allocation (Hsu et al. 2019): each label's examples are shared among the
    clients in proportions drawn from Dirichlet(alpha); small alpha = each client sees few labels. The
    allocation is drawn again until every client holds at least `min_size` examples."""
    _check_clients(clients, len(labels))
    if not alpha > 0:
        raise ValueError(f"alpha = {alpha} must be > 0 (small: very non-IID; large: close to IID)")
    if not 1 <= min_size * clients <= len(labels):
        raise ValueError(f"min_size = {min_size} for {clients} clients needs at most {len(labels)} examples")
    rng = np.random.default_rng(seed)
    for _ in range(1000):
        parts = _dirichlet_draw(labels, clients, alpha, rng)
        if min(map(len, parts)) >= min_size:
            return parts
    raise ValueError(
        f"dirichlet_split: 1000 draws with alpha = {alpha} left a client with fewer than {min_size} examples: "
        "use fewer clients, a larger alpha or a smaller min_size"
    )


def _dirichlet_draw(
    labels: Sequence[int], clients: int, alpha: float, rng: np.random.Generator
) -> list[list[int]]:
    """One Dirichlet allocation of every label's examples among the clients."""
    out: list[list[int]] = [[] for _ in range(clients)]
    for label in sorted(set(labels)):
        examples = [i for i, y in enumerate(labels) if y == label]
        order = rng.permutation(len(examples)).tolist()
        shares = rng.dirichlet(np.full(clients, float(alpha)))
        cuts = np.rint(np.cumsum(shares) * len(examples)).astype(int).tolist()
        start = 0
        for client, end in enumerate(cuts):
            out[client] += [examples[j] for j in order[start:end]]
            start = end
    return [sorted(part) for part in out]


def _check_clients(clients: int, count: int) -> None:
    if isinstance(clients, bool) or not isinstance(clients, int) or not 1 <= clients <= count:
        raise ValueError(f"clients = {clients!r} must be an integer in [1, {count}] (the examples)")


@dataclass
class RoundReport:
    """One round: the clients sampled, the examples they held, and the bytes this rank sent."""

    round: int
    clients: list[int]
    examples: int
    bytes_sent: int
    extra: dict = field(default_factory=dict)


def fedavg(
    model: nn.Module,
    clients: Sequence[tuple[torch.Tensor, torch.Tensor]],
    *,
    rounds: int,
    per_round: int,
    local_epochs: int,
    batch_size: int,
    make_optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    group: dist.ProcessGroup | None = None,
    seed: int = 0,
    on_round: Callable[[RoundReport, nn.Module], dict | None] | None = None,
) -> list[RoundReport]:
    """Train `model` (its weights are the global weights, the same on every rank at the start) by
    federated averaging over `clients` (each a pair of tensors: inputs, targets); see the module docstring.
    Each round samples `per_round` clients without replacement, each runs `local_epochs` epochs of
    mini-batches of `batch_size` with a fresh `make_optimizer(parameters)`, and the global weights move to
    the average of the clients' weights, weighted by their examples. `on_round(report, model)` may return
    extra numbers (an accuracy) to keep in the report."""
    _check_fedavg(clients, rounds, per_round, local_epochs, batch_size)
    rank = dist.get_rank(group) if dist.is_initialized() else 0
    ranks = dist.get_world_size(group) if dist.is_initialized() else 1
    # what a client changes: parameters and floating buffers (a norm's running statistics) are averaged;
    # other buffers (counters) restart from the round's global value for every client and keep it
    averaged = list(model.parameters()) + [b for b in model.buffers() if b.is_floating_point()]
    kept = [b for b in model.buffers() if not b.is_floating_point()]
    reports = []
    for round_index in range(rounds):
        sampled = sorted(
            random.Random(f"loom-fedavg:{seed}:{round_index}").sample(range(len(clients)), per_round)
        )
        start = [t.detach().clone() for t in averaged + kept]
        # the clients' weighted updates and, last, their examples (fp32, on the model's device)
        update = torch.zeros(sum(t.numel() for t in averaged) + 1, device=averaged[0].device)
        for client in sampled[rank::ranks]:
            _load(averaged + kept, start)
            _train_client(model, clients[client], local_epochs, batch_size, make_optimizer, loss_fn,
                          seed=(seed, round_index, client))  # fmt: skip
            examples = len(clients[client][0])
            deltas = [(t.detach() - g).float().flatten() for t, g in zip(averaged, start, strict=False)]
            update[:-1] += torch.cat(deltas) * examples
            update[-1] += examples
        if ranks > 1:
            dist.all_reduce(update, group=group)
        _load(averaged + kept, start)
        with torch.no_grad():
            offset = 0
            for t in averaged:
                n = t.numel()
                t.add_((update[offset : offset + n] / update[-1]).view_as(t).to(t.dtype))
                offset += n
        sent = update.numel() * update.element_size() if ranks > 1 else 0
        report = RoundReport(round_index, sampled, int(update[-1].item()), sent)
        if on_round is not None:
            report.extra = on_round(report, model) or {}
        reports.append(report)
    return reports


def _load(tensors: list[torch.Tensor], values: list[torch.Tensor]) -> None:
    with torch.no_grad():
        for t, v in zip(tensors, values, strict=True):
            t.copy_(v)


def _train_client(model, data, epochs, batch_size, make_optimizer, loss_fn, seed) -> None:
    """Local training of one client, mini-batches in an order drawn from (seed, round, client)."""
    inputs, targets = data
    optimizer = make_optimizer(list(model.parameters()))
    generator = torch.Generator().manual_seed(_seed_of(seed))
    for _ in range(epochs):
        order = torch.randperm(len(inputs), generator=generator)
        for start in range(0, len(inputs), batch_size):
            index = order[start : start + batch_size]
            loss_fn(model(inputs[index]), targets[index]).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)


def _seed_of(parts: tuple) -> int:
    """A seed from a tuple, the same in every process (unlike hash() of strings)."""
    value = 0
    for part in parts:
        value = (value * 1_000_003 + int(part)) % (2**63 - 1)
    return value


def _check_fedavg(clients, rounds, per_round, local_epochs, batch_size) -> None:
    if not clients:
        raise ValueError("fedavg needs at least one client")
    for name, value in (("rounds", rounds), ("local_epochs", local_epochs), ("batch_size", batch_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} = {value!r} must be a positive integer")
    if isinstance(per_round, bool) or not isinstance(per_round, int) or not 1 <= per_round <= len(clients):
        raise ValueError(f"per_round = {per_round!r} must be an integer in [1, {len(clients)}] (the clients)")
    empty = [c for c, (x, _) in enumerate(clients) if len(x) == 0]
    if empty:
        raise ValueError(f"clients {empty[:5]} hold no examples: drop them or split the data again")
