"""Random generators derived per step and rank (`Trainer(seed=...)`, loom/dist/rng.py): tensor-parallel peers
draw alike, data-parallel replicas differently, and a resumed run draws, on the same mesh or on another world
size, what a fresh run on that mesh draws at that step."""

import random

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import loom
from loom.checkpoint import load_checkpoint, save_checkpoint
from loom.dist.rng import StepSeeds
from loom.train import Trainer

SAVED_AT, STEPS = 2, 4


class _Noisy(nn.Module):
    """A regression with dropout that records what each forward draws: the dropout mask, and a number from
    torch, `random` and NumPy each."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.draws: list[list[float]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = F.dropout(self.linear(x), 0.5, training=True)
        mask = (hidden != 0).flatten().tolist()
        self.draws.append([*mask, torch.rand(()).item(), random.random(), float(np.random.rand())])
        return (hidden**2).mean()


def _trainer(mesh: loom.Mesh) -> Trainer:
    torch.manual_seed(0)  # the same initial parameters everywhere; the steps' draws come from the seed
    model = _Noisy()
    return Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), seed=7, mesh=mesh)


def _train(trainer: Trainer, steps: int) -> list[list[float]]:
    batch = (torch.ones(2, 4),)
    for _ in range(steps):
        trainer.train_step([batch])
    return trainer.model.draws


def saving_run(root: str) -> dict:
    """dp=2 x tp=2: the uninterrupted run, and one stopped at SAVED_AT that resumes on the same mesh."""
    mesh = loom.init({"dp": 2, "tp": 2})
    uninterrupted = _train(_trainer(mesh), STEPS)
    stopped = _trainer(mesh)
    _train(stopped, SAVED_AT)
    save_checkpoint(root, stopped)
    torch.manual_seed(1234)  # the resumed process starts with other generator states
    resumed = _trainer(mesh)
    load_checkpoint(root, resumed)
    return {
        "dp": mesh.dp_rank(),
        "uninterrupted": uninterrupted,
        "resumed": _train(resumed, STEPS - SAVED_AT),
    }


def resuming_run(root: str) -> dict:
    """dp=2 on 2 ranks: a fresh run, and one resumed from the checkpoint of 4 ranks."""
    mesh = loom.init({"dp": 2})
    fresh = _train(_trainer(mesh), STEPS)
    resumed = _trainer(mesh)
    step = load_checkpoint(root, resumed)
    return {"dp": mesh.dp_rank(), "step": step, "fresh": fresh, "resumed": _train(resumed, STEPS - SAVED_AT)}


def test_resume_on_another_world_size_draws_what_a_fresh_run_would(dist_run, tmp_path):
    four = dist_run(4, saving_run, str(tmp_path))
    for rank in four:  # on the same mesh: bitwise what the uninterrupted run drew
        assert rank["resumed"] == rank["uninterrupted"][SAVED_AT:]
    by_dp = {rank["dp"]: rank["uninterrupted"] for rank in four}
    assert all(rank["uninterrupted"] == by_dp[rank["dp"]] for rank in four)  # tp peers alike
    assert by_dp[0] != by_dp[1]  # data-parallel replicas draw independently
    assert len({str(step) for step in by_dp[0]}) == STEPS  # and every step afresh
    two = dist_run(2, resuming_run, str(tmp_path))
    for rank in two:
        assert rank["step"] == SAVED_AT
        assert rank["resumed"] == rank["fresh"][SAVED_AT:]  # another world size: what a fresh run draws
        assert rank["fresh"] == by_dp[rank["dp"]]  # the tp size does not change what a dp rank draws


def test_which_coordinates_each_generator_counts():
    seeds = StepSeeds(7, (("dp", 1), ("tp", 0)))
    assert seeds.host_seed(3) == StepSeeds(7, (("dp", 1), ("tp", 1))).host_seed(3)  # tp peers
    assert seeds.host_seed(3) != StepSeeds(7, (("dp", 0), ("tp", 0))).host_seed(3)  # dp replicas
    assert seeds.host_seed(3) != seeds.host_seed(4)
    assert seeds.device_seed(3) == StepSeeds(7).device_seed(3)  # one device state across dp and tp
    assert StepSeeds(7, (("pp", 1),)).device_seed(3) != StepSeeds(7).device_seed(3)  # a seed per stage
    assert StepSeeds.on_mesh(7, None) == StepSeeds(7)  # one process: a mesh of one
