"""Optimizer states reshard: a checkpoint of any optimizer level resumes at any level, on any mesh.

Each case trains the reference GPT under one plan (dp x tp, level) on one world size, saves, resumes under
other plans (other mesh, level and number of processes) and trains on; the losses must follow the run that
never stopped (fp32, relative 1e-5: the meshes sum in other orders), and the optimizer states each run loads
must equal, bitwise, those the previous run saved.
"""

import pytest
import torch
from checkpoint_cases import setup, whole_states

import loom
from loom.checkpoint import CheckpointError, load_checkpoint, load_from, save_checkpoint
from loom.parallel.zero import ZeroOptimizer


def _when_loaded(optimizer, callback):
    """Call `callback` once the loaded states are in place: at once at level 0; at levels 1-3 when the
    optimizer builds its chunks (at the first step, after the checkpoint's own callback, before updating)."""
    if isinstance(optimizer, ZeroOptimizer):
        optimizer.on_build(callback)
    else:
        callback()


def train_case(root, plan, steps, resume, save):
    """Under `plan` (dp, tp, level): resume from `root` if `resume`, train `steps` steps, save if `save`.
    Returns the losses, the states loaded and the states saved (whole tensors)."""
    model, trainer, data = setup(*plan)
    loaded, saved = {}, {}
    if resume:
        load_checkpoint(root, trainer, data=data)
        _when_loaded(trainer.optimizer, lambda: loaded.update(whole_states(model, trainer.optimizer)))
    losses = [trainer.train_step([next(data)]).loss for _ in range(steps)]
    if save:
        save_checkpoint(root, trainer, data=data)
        saved = whole_states(model, trainer.optimizer)
    return {"losses": losses, "loaded": loaded, "saved": saved, "step": trainer.step}


def _world(plan):
    dp, tp, _ = plan
    return dp * tp


def _assert_same_states(loaded, saved):
    assert loaded.keys() == saved.keys() and saved
    for name, states in saved.items():
        assert loaded[name].keys() == states.keys(), name
        for key, value in states.items():
            assert torch.equal(loaded[name][key], value), (name, key)


CHAINS = {
    # level 1 on dp=4 -> level 2 on dp=2 x tp=2 -> level 0 on one process
    "1:dp4 > 2:dp2tp2 > 0:one": [(4, 1, 1), (2, 2, 2), (1, 1, 0)],
    # level 3 -> level 1 on 2 processes (dp=1: every parameter updated whole) -> level 2 on dp=2 (chunks)
    "3:dp2tp2 > 1:tp2 > 2:dp2": [(2, 2, 3), (1, 2, 1), (2, 1, 2)],
    # level 0 on 2 processes -> level 3 on dp=2 x tp=2
    "0:dp2 > 3:dp2tp2": [(2, 1, 0), (2, 2, 3)],
}


@pytest.mark.parametrize("chain", sorted(CHAINS))
def test_resume_on_other_levels_and_meshes(dist_run, tmp_path, chain):
    plans, per_run = CHAINS[chain], 2
    first = plans[0]
    expected = dist_run(_world(first), train_case, None, first, per_run * len(plans), False, False)[0]
    losses, saved = [], None
    for index, plan in enumerate(plans):
        last = index == len(plans) - 1
        result = dist_run(_world(plan), train_case, str(tmp_path), plan, per_run, index > 0, not last)[0]
        assert result["step"] == per_run * (index + 1)
        if saved is not None:
            _assert_same_states(result["loaded"], saved)
        losses += result["losses"]
        saved = result["saved"]
    assert losses == pytest.approx(expected["losses"], rel=1e-5)


def before_first_step_case(root):
    """Saved at level 2 before any step: no optimizer states, and level 0 resumes with fresh ones. A level
    1-3 checkpoint of an earlier loom (states in the rank files) is refused, not resumed with fresh states."""
    _, trainer, data = setup(2, 1, 2)
    path = save_checkpoint(root, trainer, data=data)
    _, trainer, data = setup(2, 1, 0)
    step = load_checkpoint(root, trainer, data=data)
    fresh = len(trainer.optimizer.state)
    if loom.rank() == 0:
        rank_file = torch.load(path / "rank_00000.pt")
        torch.save({**rank_file, "zero": {"level": 2, "inner": []}}, path / "rank_00000.pt")
    torch.distributed.barrier()
    try:
        load_from(path, trainer)
    except CheckpointError as error:
        return step, fresh, str(error)
    return step, fresh, None


def test_no_states_before_the_first_step_and_old_rank_files_refused(dist_run, tmp_path):
    for step, fresh, error in dist_run(2, before_first_step_case, str(tmp_path)):
        assert (step, fresh) == (0, 0)
        assert error is not None and "earlier loom" in error
