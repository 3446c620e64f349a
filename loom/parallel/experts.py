"""Expert parallelism: a mixture of experts whose experts are spread over an `ep` process group.

`expert_parallel(moe, group)` keeps on each rank of `group` the slice `[rank * E/ep, (rank + 1) * E/ep)` of
the stacked expert weights (a deterministic slice, so the same seed builds the same model at any ep) and
replaces the layer's experts by `ExpertParallelExperts`, which exchanges tokens around the local MLPs:

1. dispatch: one `all_to_all_single` of the per-expert counts (int64, `E` per rank), so that each rank
   knows how many rows it receives for each of its experts from each peer; then one `all_to_all_single` of
   the rows (already sorted by expert by the router, hence by owning rank);
2. the received rows, ordered by (source rank, local expert), are regrouped by local expert and go through
   the local experts' grouped matmul, then back into (source rank, local expert) order;
3. combine: one `all_to_all_single` returns each row to the rank its token lives on.

The row exchanges are autograd's functional all-to-all, whose backward is the reverse exchange: two
all-to-alls forward, two backward, plus the counts forward (`loom.cost.moe.moe_collectives`). Routing,
capacity and the auxiliary losses stay per rank, on the rank's own tokens, as in GShard (but see loom's
GPT below).

Gradients: the router and shared experts are replicated over every data-parallel rank, each expert shard
over the ranks that hold the same experts (the expert-data-parallel group). `expert_groups` gives both
partitions of a data-parallel world, and `sync_gradients` averages accordingly.

loom's GPT (`GPTConfig.experts`, `Strategies(ep=...)`) takes another road to the same exchange: its
stacked expert weights stay whole-shaped DTensors cut on the expert dim over the ep ranks, so that loom's
gradient buckets, optimizer levels and checkpoints treat them as any cut parameter, and `connect_experts`
gives each layer an `ExpertExchange` over the mesh dims of that cut (`loom.parallelize` calls it; see
docs/experts.md). There the balancing losses are the whole batch's (`MoE.reduce_sums`), not each rank's.

A Hugging Face model (Mixtral) takes the same road through a `Plan(ep=...)`: its family's recipe says how
its experts module holds and takes its experts (`loom.models.recipes.ExpertsRecipe`); `expert_module_plan`
cuts the stacked weights over the plan's "ep" ranks and `connect_experts` replaces each experts module's
forward by the routing, exchange and combination above, on each rank's own tokens (`run_expert_parallel`).
The model's own router stays replicated and chooses the experts.
"""

from __future__ import annotations

from collections.abc import Mapping
from fnmatch import fnmatchcase
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from loom.dist._torch_private import all_to_all_autograd
from loom.dist.mesh import Mesh
from loom.layout.placements import row_placements
from loom.models.moe import (
    GroupedExperts,
    MoE,
    MoEConfig,
    check_expert_split,
    chosen_routing,
    combine,
    expert_mlp,
    local_parameter,
    moe_layers,
)
from loom.models.recipes import RECIPES, ExpertsRecipe, known_recipe
from loom.parallel.local_region import contiguous_strides

__all__ = [
    "connect_experts",
    "ExpertExchange",
    "ExpertParallelExperts",
    "expert_groups",
    "expert_module_plan",
    "expert_parallel",
    "expert_parameters",
    "new_expert_groups",
    "run_expert_parallel",
    "shard_range",
    "sync_gradients",
]


def shard_range(experts: int, ep: int, ep_rank: int) -> range:
    """The experts rank `ep_rank` of an expert-parallel group of `ep` holds (a contiguous block)."""
    if ep < 1 or experts % ep:
        raise ValueError(
            f"expert parallelism: {experts} experts do not split over ep = {ep}; choose an ep that divides "
            f"the number of experts"
        )
    if not 0 <= ep_rank < ep:
        raise ValueError(f"expert parallelism: rank {ep_rank} is outside a group of ep = {ep}")
    local = experts // ep
    return range(ep_rank * local, (ep_rank + 1) * local)


class ExpertExchange:
    """The exchange around the local experts of one rank of `group` (a `GroupedExperts.exchange`):
    `(rows, counts, weights, config)` takes this rank's rows sorted by global expert, `counts` per global
    expert and this rank's slice of the stacked weights, and returns the rows' outputs in the same order
    (see the module's docstring). After a call, `sent_rows` and `received_rows` say how many rows it sent
    and received (what `loom.cost.moe.moe_collectives` takes)."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.ep = dist.get_world_size(group)
        self.sent_rows = self.received_rows = 0

    def __deepcopy__(self, memo: dict) -> ExpertExchange:
        # a handle on the ranks' process group, which cannot be copied: a copy of the model (one gathered
        # whole, `whole_model`) shares it
        return self

    def __call__(
        self, rows: torch.Tensor, counts: torch.Tensor, weights: list[torch.Tensor], config: MoEConfig
    ) -> torch.Tensor:
        send_counts = counts.reshape(self.ep, -1)  # [destination rank, its local expert]
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=self.group)  # [source rank, local expert]
        send = send_counts.sum(1).tolist()
        recv = recv_counts.sum(1).tolist()
        self.sent_rows, self.received_rows = sum(send), sum(recv)
        arrived = all_to_all_autograd(rows, recv, send, self.group)
        order = _by_local_expert(recv_counts)
        local = expert_mlp(arrived[order], recv_counts.sum(0), weights, config)
        back = torch.empty_like(local).index_copy(0, order, local)  # undo the regrouping
        return all_to_all_autograd(back, send, recv, self.group)


class ExpertParallelExperts(GroupedExperts):
    """The local slice of a `GroupedExperts` on one rank of `group`, its rows exchanged by an
    `ExpertExchange` (`sent_rows` and `received_rows` after a call)."""

    def __init__(self, experts: GroupedExperts, group: dist.ProcessGroup) -> None:
        nn.Module.__init__(self)
        self.config = experts.config
        self.group = group
        self.exchange = ExpertExchange(group)
        self.ep = self.exchange.ep
        self.global_experts = experts.num_experts
        self.local = shard_range(self.global_experts, self.ep, dist.get_rank(group))
        for name, weight in zip(experts.weight_names(), experts.weights(), strict=True):
            piece = weight.detach()[self.local.start : self.local.stop].clone()
            setattr(self, name, nn.Parameter(piece, requires_grad=weight.requires_grad))

    @property
    def sent_rows(self) -> int:
        """Rows the last call sent to the group."""
        return self.exchange.sent_rows

    @property
    def received_rows(self) -> int:
        """Rows the last call received from the group."""
        return self.exchange.received_rows

    def reset_parameters(self) -> None:
        """Draw the whole stack as `GroupedExperts` does and keep this rank's slice: the same RNG state gives
        the same model at any ep (for layers made on the meta device and materialised after sharding)."""
        for weight in self.weights():
            full = torch.empty(
                (self.global_experts, *weight.shape[1:]), dtype=weight.dtype, device=weight.device
            )
            nn.init.normal_(full, std=self.config.init_std)
            with torch.no_grad():
                weight.copy_(full[self.local.start : self.local.stop])


def _by_local_expert(recv_counts: torch.Tensor) -> torch.Tensor:
    """Permutation that regroups rows ordered by (source rank, local expert) by local expert, source rank
    order kept within each expert (a stable sort)."""
    ep, local = recv_counts.shape
    expert = torch.arange(local, device=recv_counts.device).repeat(ep)
    return torch.argsort(torch.repeat_interleave(expert, recv_counts.reshape(-1)), stable=True)


def expert_parallel(moe: MoE, group: dist.ProcessGroup) -> MoE:
    """Make `moe` expert-parallel over `group` in place (each rank keeps experts/ep of the stacked weights,
    see `shard_range`); returns it. Call it on every rank of `group` with the same initialised layer."""
    if isinstance(moe.experts, ExpertParallelExperts):
        raise ValueError("expert_parallel: the layer is already expert-parallel")
    moe.experts = ExpertParallelExperts(moe.experts, group)
    return moe


def expert_parameters(model: nn.Module) -> set[nn.Parameter]:
    """The parameters of every expert-parallel shard in `model` (their gradients sync over expert-dp)."""
    return {p for m in model.modules() if isinstance(m, ExpertParallelExperts) for p in m.parameters()}


def expert_groups(world: int, ep: int) -> tuple[list[tuple[int, ...]], list[tuple[int, ...]]]:
    """(ep groups, expert-dp groups) of a data-parallel world of `world` ranks cut by `ep`.

    ep groups are blocks of `ep` consecutive ranks (the experts split inside, where links are fastest); the
    expert-dp group of a rank gathers the ranks at the same place in every block, which hold the same
    experts. With world 8 and ep 2: ep groups (0, 1), (2, 3), ...; expert-dp groups (0, 2, 4, 6) and
    (1, 3, 5, 7).
    """
    if ep < 1 or world % ep:
        raise ValueError(
            f"expert parallelism: ep = {ep} must divide the data-parallel world of {world} ranks"
        )
    ep_groups = [tuple(range(start, start + ep)) for start in range(0, world, ep)]
    edp_groups = [tuple(range(offset, world, ep)) for offset in range(ep)]
    return ep_groups, edp_groups


def new_expert_groups(ep: int, group: dist.ProcessGroup | None = None) -> tuple:
    """This rank's (ep group, expert-dp group) over the data-parallel `group` (the world by default), made
    with `dist.new_group`: every rank of `group` must call it (each group is made everywhere, in order)."""
    members = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
    me = members.index(dist.get_rank())
    ep_groups, edp_groups = expert_groups(len(members), ep)
    mine = []
    for partition in (ep_groups, edp_groups):
        made = [dist.new_group([members[i] for i in ranks]) for ranks in partition]
        mine.append(next(g for g, ranks in zip(made, partition, strict=True) if me in ranks))
    return mine[0], mine[1]


def sync_gradients(
    model: nn.Module, dp_group: dist.ProcessGroup | None, edp_group: dist.ProcessGroup
) -> None:
    """Average gradients for a loss that is the mean over data-parallel ranks of each rank's loss: dense
    gradients over all of `dp_group`; expert shards' gradients, which already sum the contributions of
    the ep peers' tokens, are summed over `edp_group` and divided by the whole dp world."""
    world = dist.get_world_size(dp_group)
    experts = expert_parameters(model)
    for param in model.parameters():
        if param.grad is None:
            continue
        dist.all_reduce(param.grad, group=edp_group if param in experts else dp_group)
        param.grad.div_(world)


def connect_experts(model: nn.Module, mesh: Mesh, experts: ExpertsRecipe | None = None) -> int:
    """Give every mixture of experts in `model` whose stacked expert weights are DTensors cut on their
    expert dim the exchange over the ranks that cut them: the mesh dims of that cut, one flattened sub-mesh
    of `mesh`, make its ep group (no collective: the sub-meshes exist). That is loom's GPT laid out with
    `Strategies(ep=...)`, and, with `experts` (a family's recipe), each experts module it names laid out by
    `expert_module_plan` (`run_expert_parallel`). `loom.parallelize` calls it once the parameters are laid
    out; returns ep (1: no layer's experts are cut, nothing to connect)."""
    ep = 1
    for moe in moe_layers(model):
        group = _ep_group(moe.experts.up_proj, mesh)
        if group is not None:
            moe.experts.exchange = ExpertExchange(group)
            ep = moe.experts.exchange.ep
    for _, module in _experts_modules(model, experts):
        group = _ep_group(getattr(module, experts.stacked[0]), mesh)
        if group is not None:
            run_expert_parallel(module, experts, ExpertExchange(group))
            ep = module.loom_exchange.ep
    return ep


def _ep_group(weight: torch.Tensor, mesh: Mesh) -> dist.ProcessGroup | None:
    """The group of the ranks that cut `weight` on its expert dim (None: it is not cut)."""
    if not isinstance(weight, DTensor):
        return None
    dims = tuple(i for i, p in enumerate(weight.placements) if p == Shard(0))
    return mesh.sub_mesh(dims).get_group() if dims else None


def _experts_modules(model: nn.Module, experts: ExpertsRecipe | None) -> list[tuple[str, nn.Module]]:
    """(path, module) of every module of `model` that `experts.modules` matches (none without a recipe)."""
    if experts is None:
        return []
    names = [name for name, _ in model.named_modules() if name]
    matched = [name for name in names if fnmatchcase(name, experts.modules)]
    return [(name, model.get_submodule(name)) for name in matched]


def expert_module_plan(
    model: nn.Module, module_plan: Mapping[str, Any], mesh: Mesh, ep: int, root: nn.Module | None = None
) -> tuple[dict[str, Any], ExpertsRecipe | None]:
    """`module_plan` with the experts of `model` cut over `ep` ranks, and the recipe that says how (None
    for a model without one). With `ep > 1` the family's `ExpertsRecipe.module_plan` comes last, so that it
    takes the experts modules from any earlier entry (a tensor plan's local region). loom's GPT, whose
    experts its own `Strategies(ep=...)` lays out, passes through. A ValueError, naming the fix, for
    experts that `ep` does not divide, an `ep` that is not made of the innermost factors of the mesh's dp,
    and a model with no experts loom recognises. `model` may be a part of `root` (a pipeline stage): the
    recipe is `root`'s."""
    recipe = known_recipe(root if root is not None else model)
    experts = recipe.experts if recipe is not None else None
    plan = dict(module_plan)
    if ep == 1 or any(True for _ in moe_layers(model)):
        return plan, experts
    modules = _experts_modules(model, experts)
    if not modules:
        known = sorted(name for name, r in RECIPES.items() if getattr(r, "experts", None) is not None)
        raise ValueError(
            f"ep = {ep}: {type(model).__name__} has no experts module loom recognises (families with experts: "
            f"{known}, and loom's GPT with GPTConfig.experts); set ep = 1, or give its family a Recipe with "
            f"experts=ExpertsRecipe(...) in loom.models.recipes.RECIPES"
        )
    for path, module in modules:
        count = experts.config(module).experts
        check_expert_split(ep, count, mesh.dp_size, ep_name="ep", experts_name=f"the experts of {path}")
    entry = experts.module_plan()
    plan = {pattern: data for pattern, data in plan.items() if pattern not in entry} | entry
    return plan, experts


def run_expert_parallel(module: nn.Module, experts: ExpertsRecipe, exchange: ExpertExchange) -> None:
    """Make `module`, an experts module whose stacked weights (`experts.stacked`) are cut on their expert
    dim over the ranks of `exchange`, compute on each rank's own tokens: its forward's token rows, chosen
    experts and weights (`experts.inputs`) are routed (`chosen_routing`), exchanged with the ranks holding
    the chosen experts, run through their MLPs (`experts.weights`) and summed back per token (`combine`).
    Its output is a DTensor with the rows' placements. `module.loom_exchange` holds `exchange` (the rows
    it moved); like a local region (`loom_local`), a copy gathered whole runs the class's own forward."""
    config = experts.config(module)

    def forward(*args: Any, **kwargs: Any) -> torch.Tensor:
        x, chosen, weight = experts.inputs(*args, **kwargs)
        if not isinstance(x, DTensor):
            raise ValueError(
                f"{type(module).__name__}: its experts are cut over {exchange.ep} ranks, so it runs inside the "
                f"parallelized model's forward, on DTensors; gather a whole copy to run it alone"
            )
        mesh, rows = x.device_mesh, row_placements(x.placements)
        cut = [p.is_shard() for p in rows]
        local = lambda t: t.redistribute(mesh, rows).to_local() if isinstance(t, DTensor) else t  # noqa: E731
        tokens = local(x)
        stacked = {name: local_parameter(getattr(module, name), cut) for name in experts.stacked}
        weights = experts.weights(module, stacked)
        routing = chosen_routing(local(chosen), local(weight), config.experts)
        out = combine(tokens, routing, lambda r, counts: exchange(r, counts, weights, config))
        shape = x.shape
        return DTensor.from_local(
            out, mesh, rows, run_check=False, shape=shape, stride=contiguous_strides(shape)
        )

    module.forward = forward
    module.loom_local = True
    module.loom_exchange = exchange
