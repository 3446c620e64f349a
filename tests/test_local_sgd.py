"""LocalSGD and DiLoCo (loom.parallel.local_sgd) on 2 gloo ranks, one replica each.

Exactness (fp32, inner SGD so that every comparison is Lipschitz in the inputs, rtol/atol 1e-6):
- DiLoCo with sync_every 1 and outer SGD(lr 1, no momentum) is synchronous data parallelism;
- DiLoCo with outer SGD(lr 1, no momentum) is LocalSGD's parameter averaging;
- one replica with that identity outer step is plain training;
- every option (Nesterov outer momentum, streaming fragments, delayed averages mixed in) equals a plain
  one-process simulation of the replicas written from the algorithm's definition.
Communication: all-reduces only at syncs, of the parameters' bytes (1/F of them per fragment sync, half in
bf16), and nothing else. A resumed run is bitwise the uninterrupted one (same machine), a delayed average in
flight included."""

import copy
from contextlib import contextmanager

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor.debug import CommDebugMode

from loom.dist.comm import collective_counts
from loom.parallel.local_sgd import DiLoCo, LocalSGD, fragments_of

STEPS, BATCH, TOL = 8, 4, 1e-6
IDENTITY = {"lr": 1.0, "momentum": 0.0}  # the outer step that takes the average as it is


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def batch(replica: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Replica `replica`'s data at `step` (the replicas' data differ)."""
    generator = torch.Generator().manual_seed(1000 * step + replica)
    return torch.randn(BATCH, 6, generator=generator), torch.randn(BATCH, 3, generator=generator)


def loss_of(net: nn.Module, data: tuple) -> torch.Tensor:
    x, y = data
    return nn.functional.mse_loss(net(x), y)


def params(net: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in net.parameters()]


@contextmanager
def all_reduce_bytes():
    """The bytes of each dist.all_reduce issued inside the block."""
    calls, original = [], dist.all_reduce

    def record(tensor, *args, **kwargs):
        calls.append(tensor.numel() * tensor.element_size())
        return original(tensor, *args, **kwargs)

    dist.all_reduce = record
    try:
        yield calls
    finally:
        dist.all_reduce = original


def train(make_optimizer, steps: int = STEPS, start: tuple | None = None) -> dict:
    """This rank's replica trained `steps` steps on its own data; per step the collectives issued."""
    net = model()
    optimizer = make_optimizer(net)
    if start is not None:
        net.load_state_dict(start[0])
        optimizer.load_state_dict(start[1])
    first = getattr(optimizer, "inner_steps", 0)
    per_step = []
    for step in range(first, first + steps):
        with CommDebugMode() as comm, all_reduce_bytes() as sizes:
            loss_of(net, batch(dist.get_rank(), step)).backward()
            optimizer.step()
            optimizer.zero_grad()
        per_step.append((collective_counts(comm), sizes))
    return {"params": params(net), "comm": per_step, "net": net, "optimizer": optimizer}


def diloco(sync_every: int, **options):
    return lambda net: DiLoCo(
        net.parameters(), torch.optim.SGD(net.parameters(), lr=0.1), sync_every=sync_every, **options
    )


def local_sgd(sync_every: int):
    return lambda net: LocalSGD(
        net.parameters(), torch.optim.SGD(net.parameters(), lr=0.1), sync_every=sync_every
    )


def close(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x, y, rtol=TOL, atol=TOL)


# ---- the one-process references ----------------------------------------------------------------------------
def synchronous_dp(replicas: int) -> list[torch.Tensor]:
    """Data parallelism: the mean loss over every replica's batch, one SGD step per step."""
    net = model()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    for step in range(STEPS):
        torch.stack([loss_of(net, batch(r, step)) for r in range(replicas)]).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return params(net)


def simulated_diloco(replicas, sync_every, lr, momentum, fragments=1, delay=0, mix=0.5):
    """DiLoCo written from its definition: each replica's own SGD steps; fragment f averages
    global - local at steps where step % H == (f + 1) * H // F % H, Nesterov SGD on the global weights,
    applied (mixed with the local weights when delayed) `delay` steps later."""
    nets = [model() for _ in range(replicas)]
    inner = [torch.optim.SGD(n.parameters(), lr=0.1) for n in nets]
    global_weights = params(nets[0])
    momenta = [torch.zeros_like(w) for w in global_weights]
    parts = fragments_of(list(nets[0].parameters()), fragments)
    landing = {}  # step -> [(fragment, averaged pseudo-gradient per parameter)]
    for step in range(1, STEPS + 1):
        for r, (net, optimizer) in enumerate(zip(nets, inner, strict=True)):
            loss_of(net, batch(r, step - 1)).backward()
            optimizer.step()
            optimizer.zero_grad()
        for f, part in enumerate(parts):
            for fragment, averaged in landing.pop(step, []) if f == 0 else []:
                apply(nets, global_weights, momenta, parts[fragment], averaged, lr, momentum, delay, mix)
            if step % sync_every == (f + 1) * sync_every // fragments % sync_every:
                averaged = {
                    i: torch.stack([global_weights[i] - list(n.parameters())[i].detach() for n in nets]).mean(
                        0
                    )
                    for i in part
                }
                if delay:
                    landing.setdefault(step + delay, []).append((f, averaged))
                else:
                    apply(nets, global_weights, momenta, part, averaged, lr, momentum, 0, mix)
    for step in sorted(landing):  # finish(): what is still in flight lands after the last step
        for fragment, averaged in landing[step]:
            apply(nets, global_weights, momenta, parts[fragment], averaged, lr, momentum, delay, mix)
    return [params(n) for n in nets]


def apply(nets, global_weights, momenta, part, averaged, lr, momentum, delay, mix):
    for i in part:
        momenta[i] = momentum * momenta[i] + averaged[i]
        step = averaged[i] + momentum * momenta[i] if momentum else averaged[i]
        global_weights[i] = global_weights[i] - lr * step
        for net in nets:
            local = list(net.parameters())[i]
            with torch.no_grad():
                local.copy_(mix * local + (1 - mix) * global_weights[i] if delay else global_weights[i])


# ---- worker bodies --------------------------------------------------------------------------------------------
def run_case(make, steps=STEPS):
    result = train(make, steps)
    in_flight = bool(getattr(result["optimizer"], "_pending", {}))
    result["optimizer"].finish()
    return {"params": params(result["net"]), "comm": result["comm"], "in_flight": in_flight}


def equivalences_case():
    return {
        "h1": train(diloco(1, outer_kwargs=IDENTITY))["params"],
        "diloco": train(diloco(3, outer_kwargs=IDENTITY))["params"],
        "local_sgd": train(local_sgd(3))["params"],
    }


def resume_case(make, split):
    whole = train(make)["params"]
    first = train(make, steps=split)
    in_flight = bool(getattr(first["optimizer"], "_pending", {}))
    start = (copy.deepcopy(first["net"].state_dict()), copy.deepcopy(first["optimizer"].state_dict()))
    torch.manual_seed(99)  # the resumed process draws nothing from the old generator states
    resumed = train(make, steps=STEPS - split, start=start)["params"]
    return in_flight, all(torch.equal(a, b) for a, b in zip(whole, resumed, strict=True))


# ---- tests -------------------------------------------------------------------------------------------------
def test_diloco_h1_is_data_parallelism_and_identity_outer_steps_are_local_sgd(dist_run):
    reference = synchronous_dp(2)
    for result in dist_run(2, equivalences_case):
        close(result["h1"], reference)
        close(result["diloco"], result["local_sgd"])


def test_one_replica_with_an_identity_outer_step_is_plain_training():
    net = model()
    optimizer = DiLoCo(
        net.parameters(), torch.optim.SGD(net.parameters(), lr=0.1), sync_every=2, outer_kwargs=IDENTITY
    )
    plain = model()
    plain_optimizer = torch.optim.SGD(plain.parameters(), lr=0.1)
    for step in range(STEPS):
        for n, o in ((net, optimizer), (plain, plain_optimizer)):
            loss_of(n, batch(0, step)).backward()
            o.step()
            o.zero_grad()
    close(params(net), params(plain))


OPTIONS = {
    "nesterov": dict(sync_every=4, lr=0.7, momentum=0.9, fragments=1, delay=0),
    "fragments": dict(sync_every=4, lr=0.7, momentum=0.9, fragments=2, delay=0),
    "delayed": dict(sync_every=4, lr=0.7, momentum=0.9, fragments=2, delay=1),
}


@pytest.mark.parametrize("name", OPTIONS)
def test_every_option_equals_the_algorithm_simulated_in_one_process(dist_run, name):
    o = OPTIONS[name]
    make = diloco(
        o["sync_every"], fragments=o["fragments"], fragment_delay=o["delay"],
        outer_kwargs={"lr": o["lr"], "momentum": o["momentum"], "nesterov": True},
    )  # fmt: skip
    expected = simulated_diloco(2, **{k: v for k, v in o.items()})
    results = dist_run(2, run_case, make)
    for rank, result in enumerate(results):
        close(result["params"], expected[rank])
        # the last fragment started at step 8: in flight when training ended, landed by finish()
        assert result["in_flight"] == (o["delay"] > 0)


def test_collectives_only_at_syncs_with_the_parameters_bytes(dist_run):
    net = model()
    total = sum(p.numel() * 4 for p in net.parameters())
    parts = fragments_of(list(net.parameters()), 2)
    part_bytes = [sum(list(net.parameters())[i].numel() * 4 for i in part) for part in parts]
    cases = {
        "local_sgd": (local_sgd(4), {4: [total], 8: [total]}),
        "diloco": (diloco(4), {4: [total], 8: [total]}),
        "bf16": (diloco(4, outer_dtype=torch.bfloat16), {4: [total // 2], 8: [total // 2]}),
        "fragments": (diloco(4, fragments=2), {2: [part_bytes[0]], 4: [part_bytes[1]], 6: [part_bytes[0]],
                                               8: [part_bytes[1]]}),
    }  # fmt: skip
    for name, (make, expected) in cases.items():
        for result in dist_run(2, run_case, make):
            for step, (counts, sizes) in enumerate(result["comm"], start=1):
                assert sizes == expected.get(step, []), (name, step)
                assert counts == ({"all_reduce": 1} if sizes else {}), (name, step)  # nothing else


@pytest.mark.parametrize("kind", ["local_sgd", "diloco-delayed"])
def test_a_resumed_run_is_bitwise_the_uninterrupted_one(dist_run, kind):
    # stopped after step 2: DiLoCo's fragment 0 started its average there and lands at step 3
    make = local_sgd(2) if kind == "local_sgd" else diloco(4, fragments=2, fragment_delay=1)
    for in_flight, same in dist_run(2, resume_case, make, 2):
        assert same and in_flight == (kind != "local_sgd")


def test_resuming_under_other_settings_is_refused():
    net = model()
    saved = diloco(4, fragments=2)(net).state_dict()
    other = diloco(8, fragments=2)(model())
    with pytest.raises(ValueError, match="sync_every = 4 saved, 8 now"):
        other.load_state_dict(saved)


def test_fragments_cut_by_bytes_in_order():
    tensors = [torch.zeros(n) for n in (10, 10, 40, 5, 35)]
    assert fragments_of(tensors, 1) == [[0, 1, 2, 3, 4]]
    assert fragments_of(tensors, 2) == [[0, 1, 2], [3, 4]]
    assert fragments_of(tensors, 5) == [[0], [1], [2], [3], [4]]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"sync_every": 0}, "sync_every = 0 must be a positive integer"),
        ({"sync_every": 2, "fragments": 3}, "fragments = 3 is more than sync_every = 2"),
        ({"sync_every": 4, "fragment_delay": 4}, "fragment_delay = 4 must be an integer in \\[0, sync_every"),
        ({"sync_every": 4, "mix": 1.5}, "mix = 1.5 must be in \\[0, 1\\]"),
        ({"sync_every": 4, "fragments": 9}, "fragments = 9 is more than"),
        ({"sync_every": 4, "outer_dtype": torch.float16}, "outer_dtype"),
    ],
)
def test_bad_settings_are_named(options, message):
    net = model()
    with pytest.raises(ValueError, match=message):
        DiLoCo(net.parameters(), torch.optim.SGD(net.parameters(), lr=0.1), **options)


def test_parameters_missing_from_the_inner_optimizer_are_named():
    net = model()
    inner = torch.optim.SGD(list(net.parameters())[:2], lr=0.1)
    with pytest.raises(ValueError, match="parameters \\[2, 3\\] are not in the inner optimizer"):
        LocalSGD(net.parameters(), inner, sync_every=2)


def test_the_default_outer_step_is_the_papers_nesterov_sgd():
    net = model()
    outer = DiLoCo(net.parameters(), torch.optim.SGD(net.parameters(), lr=0.1), sync_every=4).outer
    assert isinstance(outer, torch.optim.SGD)
    assert (outer.defaults["lr"], outer.defaults["momentum"], outer.defaults["nesterov"]) == (0.7, 0.9, True)


def tensor_parallel_replica_case():
    """Replicas of 2 ranks each (dp=2 x tp=2): the MLP's first linear cut by rows, the second by columns;
    DiLoCo meets over "dp" on each rank's local shards."""
    import loom
    from loom.parallel.parallelize import parallelize_part

    mesh = loom.init({"dp": 2, "tp": 2})
    net = model()
    megatron = {
        "0": {"parameter_plan": {"weight": ("tp", "None"), "bias": ("tp",)}},
        "2": {"parameter_plan": {"weight": ("None", "tp")}, "out_strategy": (("None", "None"),)},
    }
    parallelize_part(net, mesh.without("dp"), module_plan=megatron, root=net, batch_axes=())
    outer = {"lr": 0.7, "momentum": 0.9, "nesterov": True}
    optimizer = diloco(4, fragments=2, outer_kwargs=outer, group=mesh["dp"].get_group())(net)
    cut = [tuple(p.to_local().shape) != tuple(p.shape) for p in net.parameters()]
    for step in range(STEPS):
        x, y = batch(mesh.dp_rank(), step)
        nn.functional.mse_loss(net(x).full_tensor(), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    return mesh.dp_rank(), cut, [p.full_tensor().detach() for p in net.parameters()]


def test_replicas_sharded_by_tensor_parallelism_sync_their_shards(dist_run):
    expected = simulated_diloco(2, sync_every=4, lr=0.7, momentum=0.9, fragments=2)
    for replica, cut, result in dist_run(4, tensor_parallel_replica_case):
        assert cut == [True, True, True, False]  # the second bias stays whole
        close(result, expected[replica])
