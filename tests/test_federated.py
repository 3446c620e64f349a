"""Federated averaging (loom.train.federated) on 1 and 2 gloo ranks: with every client, one local step and
equal data it is synchronous data parallelism (fp32, SGD, 1e-6); sampled clients are the same on every
rank and every rank ends a round with the same weights; one all-reduce per round of the parameters and a
count; client splits (IID, by label, Dirichlet) cover every example once."""

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from loom.train.federated import dirichlet_split, fedavg, iid_split, label_split

CLIENTS, PER_CLIENT, ROUNDS, TOL = 4, 8, 5, 1e-6


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))


def client_data(
    count: int = CLIENTS, per_client: int = PER_CLIENT
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(3)
    return [
        (
            torch.randn(per_client, 5, generator=generator),
            torch.randint(0, 3, (per_client,), generator=generator),
        )
        for _ in range(count)
    ]


def sgd(params):
    return torch.optim.SGD(params, lr=0.2)


def data_parallel_reference() -> list[torch.Tensor]:
    """One process: each step, the mean over the clients of their mean losses, one SGD step."""
    net, data = model(), client_data()
    optimizer = sgd(net.parameters())
    for _ in range(ROUNDS):
        torch.stack([F.cross_entropy(net(x), y) for x, y in data]).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return [p.detach() for p in net.parameters()]


def run(per_round: int, clients: int = CLIENTS, local_epochs: int = 1, batch_size: int = PER_CLIENT):
    net = model()
    sent = []
    original = dist.all_reduce

    def record(tensor, *args, **kwargs):
        sent.append(tensor.numel() * tensor.element_size())
        return original(tensor, *args, **kwargs)

    dist.all_reduce = record
    try:
        reports = fedavg(
            net, client_data(clients), rounds=ROUNDS, per_round=per_round, local_epochs=local_epochs,
            batch_size=batch_size, make_optimizer=sgd, loss_fn=F.cross_entropy, seed=1,
        )  # fmt: skip
    finally:
        dist.all_reduce = original
    return [p.detach() for p in net.parameters()], [r.clients for r in reports], sent


def all_clients_case():
    return run(per_round=CLIENTS)


def sampled_case():
    return run(per_round=3, clients=7, local_epochs=2, batch_size=3)


def test_all_clients_one_local_step_equal_data_is_data_parallelism(dist_run):
    expected = data_parallel_reference()
    one_process, _, _ = run(per_round=CLIENTS)
    for got in [one_process] + [params for params, _, _ in dist_run(2, all_clients_case)]:
        for a, b in zip(got, expected, strict=True):
            torch.testing.assert_close(a, b, rtol=TOL, atol=TOL)


def test_sampled_clients_agree_and_one_all_reduce_per_round(dist_run):
    results = dist_run(2, sampled_case)
    (params0, clients0, sent0), (params1, clients1, sent1) = results
    assert clients0 == clients1 and all(len(c) == 3 for c in clients0)
    assert len({tuple(c) for c in clients0}) > 1  # rounds sample different clients
    for a, b in zip(params0, params1, strict=True):
        assert torch.equal(a, b)
    parameter_count = sum(p.numel() for p in model().parameters())
    assert sent0 == sent1 == [(parameter_count + 1) * 4] * ROUNDS
    one_process, clients, _ = run(per_round=3, clients=7, local_epochs=2, batch_size=3)
    assert clients == clients0
    for a, b in zip(one_process, params0, strict=True):
        torch.testing.assert_close(a, b, rtol=TOL, atol=TOL)


def _labels() -> list[int]:
    return [i % 5 for i in range(200)]


def _covers_once(parts: list[list[int]], count: int) -> bool:
    flat = sorted(i for part in parts for i in part)
    return flat == list(range(count))


def test_splits_cover_every_example_once():
    labels = _labels()
    iid = iid_split(200, 6, seed=0)
    assert _covers_once(iid, 200) and {len(p) for p in iid} == {33, 34}
    by_label = label_split(labels, 10, labels_per_client=2, seed=0)
    assert _covers_once(by_label, 200)
    assert all(len({labels[i] for i in part}) <= 2 for part in by_label)
    narrow, wide = (
        dirichlet_split(labels, 8, alpha=0.1, seed=0),
        dirichlet_split(labels, 8, alpha=100.0, seed=0),
    )
    assert _covers_once(narrow, 200) and _covers_once(wide, 200)
    assert min(map(len, narrow)) >= 1  # drawn again until no client is empty
    assert dirichlet_split(labels, 8, alpha=0.1, seed=0) == narrow  # seeded
    kinds = lambda parts: sum(len({labels[i] for i in part}) for part in parts)  # noqa: E731
    assert kinds(narrow) < kinds(wide)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: iid_split(3, 4), "clients = 4 must be an integer in \\[1, 3\\]"),
        (
            lambda: label_split([0, 1, 1], 2, labels_per_client=3),
            "labels_per_client = 3 must be in \\[1, 2\\]",
        ),
        (lambda: dirichlet_split([0, 1], 2, alpha=0), "alpha = 0 must be > 0"),
        (lambda: label_split(_labels(), 2, labels_per_client=1), "hold fewer labels than the 5 there are"),
        (lambda: run(per_round=5), "per_round = 5 must be an integer in \\[1, 4\\]"),
        (lambda: run(per_round=2, local_epochs=0), "local_epochs = 0 must be a positive integer"),
    ],
)
def test_bad_settings_are_named(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_updates_are_weighted_by_each_clients_examples():
    generator = torch.Generator().manual_seed(5)
    sizes = [2, 6, 12]
    data = [
        (torch.randn(n, 5, generator=generator), torch.randint(0, 3, (n,), generator=generator))
        for n in sizes
    ]
    net = model()
    fedavg(
        net, data, rounds=1, per_round=3, local_epochs=1, batch_size=max(sizes), make_optimizer=sgd,
        loss_fn=F.cross_entropy,
    )  # fmt: skip
    reference = model()
    # one SGD step per client from the same weights, averaged by examples: the gradient of the
    # example-weighted mean of the clients' mean losses
    weighted = sum(n * F.cross_entropy(reference(x), y) for n, (x, y) in zip(sizes, data, strict=True))
    (weighted / sum(sizes)).backward()
    with torch.no_grad():
        for p in reference.parameters():
            p -= 0.2 * p.grad
    for a, b in zip(net.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=TOL, atol=TOL)


def test_running_statistics_are_averaged_and_counters_kept():
    """A BatchNorm's running mean after a round is the clients' running means averaged by examples, each
    client starting from the round's global statistics (lr 0: only the statistics move)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(5, 4), nn.BatchNorm1d(4))
    generator = torch.Generator().manual_seed(6)
    sizes = [4, 12]
    data = [(torch.randn(n, 5, generator=generator) + i, torch.randn(n, 4, generator=generator))
            for i, n in enumerate(sizes)]  # fmt: skip
    expected = []
    for x, _ in data:
        client = nn.Sequential(nn.Linear(5, 4), nn.BatchNorm1d(4))
        client.load_state_dict(net.state_dict())
        client(x)  # one batch: the whole client
        expected.append(client[1].running_mean * len(x))
    fedavg(
        net, data, rounds=1, per_round=2, local_epochs=1, batch_size=16,
        make_optimizer=lambda p: torch.optim.SGD(p, lr=0.0), loss_fn=F.mse_loss,
    )  # fmt: skip
    torch.testing.assert_close(net[1].running_mean, sum(expected) / sum(sizes), rtol=TOL, atol=TOL)
    assert net[1].num_batches_tracked.item() == 0  # a counter keeps the round's global value
