"""Level 0 loads build their optimizer states from the checkpoint's metadata, without torch's step on zero
gradients: the optimizer must end up exactly as `get_optimizer_state_dict` / `set_optimizer_state_dict`
(the path this replaced) leave it, replace states it already holds, and leave parameters without saved
states without."""

import torch
import torch.distributed.checkpoint as dcp
from checkpoint_cases import parallel_gpt, setup
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
from torch.distributed.tensor import DTensor

from loom.checkpoint import load_checkpoint, save_checkpoint
from loom.checkpoint.state import load_hyper_parameters
from loom.parallel import make_optimizer
from loom.train import Trainer

DP, TP = 1, 2  # tensor parallelism: states are sharded DTensors


def _sgd_setup(dp, tp, level):
    """`setup`'s GPT and data with SGD and momentum (a `momentum_buffer`, no `step`)."""
    model, data = parallel_gpt(dp, tp)
    optimizer = make_optimizer(model, torch.optim.SGD, level, lr=0.1, momentum=0.9)
    return model, Trainer(model, optimizer), data


SETUPS = {"adamw": setup, "sgd": _sgd_setup}


def _train(trainer, data, steps):
    for _ in range(steps):
        trainer.train_step([next(data)])


def _torch_path_load(path, model, optimizer):
    """The level 0 load this replaced: torch builds the template (a step on zero gradients), puts it back."""
    state = {"model": model.state_dict(), "optim": get_optimizer_state_dict(model, optimizer)}
    dcp.load(state, checkpoint_id=path / "dcp")
    model.load_state_dict(state["model"])
    set_optimizer_state_dict(model, optimizer, state["optim"])
    load_hyper_parameters(optimizer, torch.load(path / "train_state.pt", weights_only=True)["hyper"])


def _snapshot(optimizer):
    """The optimizer's state dict, every tensor described by its type, layout, dtype, device and values."""
    state_dict = optimizer.state_dict()
    states = {pid: {k: _describe(v) for k, v in s.items()} for pid, s in state_dict["state"].items()}
    return {"state": states, "param_groups": state_dict["param_groups"]}


def _describe(value):
    if isinstance(value, DTensor):
        local = value.to_local()
        return ("DTensor", value.placements, value.shape, local.dtype, local.device, local.clone())
    if torch.is_tensor(value):
        return ("Tensor", value.dtype, value.device, value.clone())
    return value


def _differences(got, want):
    """Where two snapshots differ (empty: bitwise the same)."""
    found = []
    if got["param_groups"] != want["param_groups"]:
        found.append("param_groups")
    if got["state"].keys() != want["state"].keys():
        found.append(f"parameters with states: {sorted(got['state'])} != {sorted(want['state'])}")
    for pid in got["state"].keys() & want["state"].keys():
        a, b = got["state"][pid], want["state"][pid]
        if a.keys() != b.keys():
            found.append(f"{pid}: states {sorted(a)} != {sorted(b)}")
        for key in a.keys() & b.keys():
            if not _same(a[key], b[key]):
                found.append(f"{pid}.{key}")
    return found


def _same(a, b):
    if not (isinstance(a, tuple) and isinstance(b, tuple)):
        return a == b
    *meta_a, values_a = a
    *meta_b, values_b = b
    return meta_a == meta_b and torch.equal(values_a, values_b)


def matches_torch_path_case(root, kind):
    """Loaded into a fresh optimizer and into one that has stepped: both as the torch path leaves a fresh one,
    and as the saving run held them."""
    build = SETUPS[kind]
    _, trainer, data = build(DP, TP, 0)
    _train(trainer, data, 2)
    path = save_checkpoint(root, trainer, data=data)
    saved = _snapshot(trainer.optimizer)
    model, trainer, _ = build(DP, TP, 0)
    _torch_path_load(path, model, trainer.optimizer)
    reference = _snapshot(trainer.optimizer)
    _, fresh, _ = build(DP, TP, 0)
    load_checkpoint(root, fresh)
    _, stepped, data = build(DP, TP, 0)
    _train(stepped, data, 1)  # states of its own, to be replaced
    load_checkpoint(root, stepped)
    return {
        "torch path vs saved": _differences(reference, saved),
        "fresh": _differences(_snapshot(fresh.optimizer), reference),
        "stepped": _differences(_snapshot(stepped.optimizer), reference),
        "states": len(reference["state"]),
    }


def test_level0_load_is_the_torch_path_adamw(dist_run, tmp_path):
    for result in dist_run(DP * TP, matches_torch_path_case, str(tmp_path), "adamw"):
        assert result.pop("states") > 0
        assert result == {"torch path vs saved": [], "fresh": [], "stepped": []}


def test_level0_load_is_the_torch_path_sgd(dist_run, tmp_path):
    for result in dist_run(DP * TP, matches_torch_path_case, str(tmp_path), "sgd"):
        assert result.pop("states") > 0
        assert result == {"torch path vs saved": [], "fresh": [], "stepped": []}


def unsaved_states_case(root):
    """A parameter saved without optimizer states (as one that never had a gradient) has none after a load,
    into a fresh optimizer or one that has states for it; the others' states are the saved ones."""
    model, trainer, data = setup(DP, TP, 0)
    _train(trainer, data, 2)
    first = next(iter(model.parameters()))
    del trainer.optimizer.state[first]
    save_checkpoint(root, trainer, data=data)
    saved = _snapshot(trainer.optimizer)
    _, fresh, _ = setup(DP, TP, 0)
    load_checkpoint(root, fresh)
    model, stepped, data = setup(DP, TP, 0)
    _train(stepped, data, 1)
    had_state = next(iter(model.parameters())) in stepped.optimizer.state
    load_checkpoint(root, stepped)
    return {
        "saved": len(saved["state"]),
        "fresh": _differences(_snapshot(fresh.optimizer), saved),
        "stepped": _differences(_snapshot(stepped.optimizer), saved),
        "had state": had_state,
    }


def test_level0_load_leaves_unsaved_parameters_without_states(dist_run, tmp_path):
    for result in dist_run(DP * TP, unsaved_states_case, str(tmp_path)):
        assert result["saved"] > 0 and result["had state"]
        assert result["fresh"] == [] and result["stepped"] == []
