"""Tier 2: expert parallelism (`loom.parallel.experts`) on 4 gloo ranks against one device.

Each rank routes its own tokens; the single-device reference runs the whole layer on each rank's tokens in
turn (so capacity drops the same pairs). Compared, fp32, rtol/atol 1e-5 (outputs and gradients are
Lipschitz in the inputs): the output, the input gradient, the auxiliary loss and the router gradient of this
rank's tokens, and each rank's expert-shard gradients against the matching slice of the reference's
gradient summed over the ep group's tokens. Cases at ep = 4 (the world) and ep = 2 (two groups): dropless
SwiGLU through the grouped matmul and GELU through the loop, a capacity factor that drops pairs, an expert
that receives no token, every token routed to one expert, a rank without tokens; and a layer sharded on the
meta device, materialised and reset, equal to the sharded one. The collectives of each call are counted
against `loom.cost.moe.moe_collectives`. Then 5 steps of a tiny embedding -> MoE -> head model at ep 2 x dp 4
against one device: losses, parameters, shards equal within an expert-dp group and different across it.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from loom.cost.moe import moe_collectives
from loom.dist.comm import Collective, CollectiveRecorder, summarize
from loom.models.moe import MoE, MoEConfig
from loom.parallel.experts import (
    expert_groups,
    expert_parallel,
    new_expert_groups,
    shard_range,
    sync_gradients,
)

WORLD, TOL, TOKENS, HIDDEN = 4, 1e-5, 6, 8
BASE = {"hidden": HIDDEN, "ffn_hidden": 12, "experts": 4, "top_k": 2, "z_loss_coef": 1e-3, "init_std": 0.5}
CASES = {
    "dropless swiglu grouped": {"grouped_mm": True},
    "dropless gelu loop": {"activation": "gelu", "grouped_mm": False, "experts": 8},
    "capacity by probability": {"capacity_factor": 0.75},
    "capacity by position": {"capacity_factor": 0.75, "drop_policy": "position", "score": "sigmoid"},
    "an idle expert": {"expert_bias": True, "bias": {3: -100.0}},
    "one expert takes all": {"expert_bias": True, "top_k": 1, "normalize_weights": False, "bias": {0: 100.0}},
    "a rank without tokens": {"no_tokens_on": 1},
}
NOT_CONFIG = ("bias", "no_tokens_on")  # case keys that set up the run, not the layer


def build(case: dict) -> MoE:
    fields = {k: v for k, v in {**BASE, **case}.items() if k not in NOT_CONFIG}
    torch.manual_seed(0)
    moe = MoE(MoEConfig(**fields))
    for expert, value in case.get("bias", {}).items():  # steers the choice only: forces the routing
        moe.expert_bias[expert] = value
    return moe


def data(rank: int, case: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank `rank`'s tokens [2, 3, hidden] (none on the case's `no_tokens_on`) and the output gradient its
    loss sends back."""
    generator = torch.Generator().manual_seed(100 + rank)
    if case.get("no_tokens_on") == rank:
        return torch.zeros(0, TOKENS // 2, HIDDEN), torch.zeros(0, TOKENS // 2, HIDDEN)
    shape = (2, TOKENS // 2, HIDDEN)
    return torch.randn(shape, generator=generator), torch.randn(shape, generator=generator)


def run(moe: MoE, x: torch.Tensor, g: torch.Tensor) -> dict:
    """Forward and backward of `(moe(x) * g).sum() + aux_loss`; what the comparison needs."""
    moe.zero_grad()
    x = x.clone().requires_grad_()
    y = moe(x)
    aux = moe.aux_loss
    ((y * g).sum() + aux).backward()
    grads = {name: p.grad.clone() for name, p in moe.named_parameters()}
    return {"y": y.detach(), "x_grad": x.grad, "aux": aux.detach(), "dropped": moe.dropped, "grads": grads}


def reference(case: dict, ranks: tuple[int, ...]) -> dict[int, dict]:
    """The single-device layer on each of `ranks`' tokens in turn."""
    moe = build(case)
    return {r: run(moe, *data(r, case)) for r in ranks}


def compare(case: dict, group: dist.ProcessGroup, ranks: tuple[int, ...]) -> list[str]:
    """Errors of the expert-parallel layer on `group` (global ranks `ranks`) against the reference."""
    me = dist.get_rank()
    moe = expert_parallel(build(case), group)
    x, g = data(me, case)
    with CollectiveRecorder() as recorder:
        got = run(moe, x, g)
    want = reference(case, ranks)
    errors = []

    def check(what: str, a: torch.Tensor, b: torch.Tensor) -> None:
        if not torch.allclose(a, b, rtol=TOL, atol=TOL):
            errors.append(f"{what}: max error {(a - b).abs().max().item():.3g}")

    mine = want[me]
    for key in ("y", "x_grad", "aux"):
        check(key, got[key], mine[key])
    if got["dropped"] != mine["dropped"]:
        errors.append(f"dropped {got['dropped']} != {mine['dropped']}")
    local = shard_range(moe.config.experts, len(ranks), ranks.index(me))
    for name, grad in got["grads"].items():
        if name.startswith("experts."):  # the shard's gradient sums every ep peer's tokens
            expected = sum(want[r]["grads"][name] for r in ranks)[local.start : local.stop]
        else:
            expected = mine["grads"][name]
        check(f"grad {name}", grad, expected)
    errors += check_collectives(moe, recorder, ranks)
    return errors


def check_collectives(moe: MoE, recorder: CollectiveRecorder, ranks: tuple[int, ...]) -> list[str]:
    """The recorded exchanges against the cost model's formula, for the rows this call moved."""
    experts = moe.experts
    expected = moe_collectives(
        experts=moe.config.experts, hidden=HIDDEN, sent_rows=experts.sent_rows,
        received_rows=experts.received_rows, element_bytes=4, ep=len(ranks),
    )  # fmt: skip
    want = summarize(Collective(c.kind, ranks, c.nbytes) for c in expected for _ in range(c.count))
    got = recorder.summary()
    return [] if got == want else [f"collectives {dict(got)} != {dict(want)}"]


def materialised_case() -> bool:
    """A layer sharded on the meta device, then materialised and reset, equals the sharded initialised one."""
    torch.manual_seed(0)
    with torch.device("meta"):
        meta = MoE(MoEConfig(**BASE))
    expert_parallel(meta, dist.group.WORLD)
    meta.to_empty(device="cpu")
    torch.manual_seed(0)
    meta.reset_parameters()
    built = expert_parallel(build({}), dist.group.WORLD)
    pairs = zip([*meta.parameters(), *meta.buffers()], [*built.parameters(), *built.buffers()], strict=True)
    return all(torch.equal(a, b) for a, b in pairs)


def ep_case() -> dict[str, list[str]]:
    """Every case at ep = 4 and ep = 2; the errors of each."""
    world = tuple(range(WORLD))
    ep2, _ = new_expert_groups(2)
    pair = expert_groups(WORLD, 2)[0][dist.get_rank() // 2]
    results = {}
    for name, case in CASES.items():
        results[f"{name}, ep 4"] = compare(case, dist.group.WORLD, world)
        results[f"{name}, ep 2"] = compare(case, ep2, pair)
    results["materialised from the meta device"] = [] if materialised_case() else ["parameters differ"]
    return results


def test_expert_parallel_layer_matches_one_device_and_issues_the_predicted_all_to_alls(dist_run):
    for rank, results in enumerate(dist_run(WORLD, ep_case)):
        failed = {name: errors for name, errors in results.items() if errors}
        assert not failed, f"rank {rank}: {failed}"


def test_group_arithmetic_and_uneven_splits_are_clear():
    assert expert_groups(8, 2) == ([(0, 1), (2, 3), (4, 5), (6, 7)], [(0, 2, 4, 6), (1, 3, 5, 7)])
    assert expert_groups(4, 4) == ([(0, 1, 2, 3)], [(0,), (1,), (2,), (3,)])
    assert expert_groups(4, 1) == ([(0,), (1,), (2,), (3,)], [(0, 1, 2, 3)])
    for world, ep in ((8, 2), (8, 4), (6, 3)):
        ep_groups, edp_groups = expert_groups(world, ep)
        for groups in (ep_groups, edp_groups):  # each a partition of the world
            assert sorted(r for g in groups for r in g) == list(range(world))
        # an ep group and an expert-dp group meet in exactly one rank; expert-dp peers hold the same experts
        assert all(len(set(a) & set(b)) == 1 for a in ep_groups for b in edp_groups)
        assert all(len({shard_range(ep * 2, ep, r % ep) for r in g}) == 1 for g in edp_groups)
    assert list(shard_range(8, 4, 2)) == [4, 5]
    with pytest.raises(ValueError, match="6 experts do not split over ep = 4"):
        shard_range(6, 4, 0)
    with pytest.raises(ValueError, match="ep = 3 must divide"):
        expert_groups(8, 3)


VOCAB, STEPS, LR = 16, 5, 0.1


class TinyMoEModel(nn.Module):
    """embedding -> MoE -> head, a residual around the MoE."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.moe = MoE(MoEConfig(**{**BASE, "expert_bias": True, "aux_loss_coef": 0.1}))
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        logits = self.head(x + self.moe(x))
        return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1)) + self.moe.aux_loss


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(VOCAB, (2, 4), generator=generator), torch.randint(
        VOCAB, (2, 4), generator=generator
    )


def reference_training() -> tuple[list[float], TinyMoEModel]:
    """One device: each step the mean of the ranks' losses, each on its own batch; SGD; bias update."""
    model = TinyMoEModel()
    losses = []
    for step in range(STEPS):
        model.zero_grad()
        total = sum(model(*batch(r, step)) for r in range(WORLD)) / WORLD
        total.backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= LR * p.grad
        model.moe.update_bias(0.01)
        losses.append(total.item())
    return losses, model


def training_case() -> list[str]:
    """ep 2 x dp 4: losses and parameters against one device; shards alike within expert-dp groups."""
    me, errors = dist.get_rank(), []
    ep_group, edp_group = new_expert_groups(2)
    model = TinyMoEModel()
    expert_parallel(model.moe, ep_group)
    losses = []
    for step in range(STEPS):
        model.zero_grad()
        loss = model(*batch(me, step))
        loss.backward()
        sync_gradients(model, None, edp_group)
        with torch.no_grad():
            for p in model.parameters():
                p -= LR * p.grad
        model.moe.update_bias(0.01, group=dist.group.WORLD)
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / WORLD)
    want_losses, want = reference_training()
    if not torch.allclose(torch.tensor(losses), torch.tensor(want_losses), rtol=TOL, atol=TOL):
        errors.append(f"losses {losses} != {want_losses}")
    local = shard_range(BASE["experts"], 2, me % 2)
    wanted = dict(want.named_parameters())
    for name, p in model.named_parameters():
        expected = wanted[name][local.start : local.stop] if name.startswith("moe.experts.") else wanted[name]
        if not torch.allclose(p, expected, rtol=TOL, atol=TOL):
            errors.append(f"{name}: max error {(p - expected).abs().max().item():.3g}")
    if not torch.equal(model.moe.expert_bias, want.moe.expert_bias):
        errors.append("expert bias differs")
    shard = model.moe.experts.down_proj.detach()
    peers = [torch.empty_like(shard) for _ in range(2)]
    dist.all_gather(peers, shard, group=edp_group)  # the rank holding the same experts in the other group
    if not torch.equal(peers[0], peers[1]):
        errors.append("expert shards differ within an expert-dp group")
    dist.all_gather(peers, shard, group=ep_group)  # the other experts of my group
    if torch.equal(peers[0], peers[1]):
        errors.append("expert shards equal across ep ranks")
    return errors


def test_five_steps_of_a_tiny_model_at_ep_2_by_dp_4_match_one_device(dist_run):
    for rank, errors in enumerate(dist_run(WORLD, training_case)):
        assert not errors, f"rank {rank}: {errors}"
