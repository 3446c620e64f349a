"""Tier 2: what each optimizer level keeps per rank (states, gradients, parameters), measured on the GPT."""

import pytest
import torch

import loom
from loom.models.gpt import GPT, GPTConfig, Strategies
from loom.parallel import make_optimizer
from loom.train import Trainer

CONFIG = GPTConfig(vocab_size=64, d_model=32, n_layers=3, n_heads=4, max_seq_len=16)


def _bytes(tensors):
    return sum(t.untyped_storage().nbytes() for t in tensors)


def memory_case(level):
    mesh = loom.init({"dp": 4})
    model = GPT(CONFIG, Strategies(4, 1))
    ids = torch.randint(0, 64, (16, 17), generator=torch.Generator().manual_seed(0))
    rows = ids.chunk(4)[mesh.dp_rank()]
    batch = (rows[:, :-1], rows[:, 1:])
    loom.parallelize(model, mode="semi_auto", example_inputs=batch)
    total = sum(p.numel() for p in model.parameters()) * 4
    optimizer = make_optimizer(model, torch.optim.AdamW, level, lr=1e-3)
    trainer = Trainer(model, optimizer)
    seen = []  # as each block's forward starts: how many of the 3 blocks hold their parameters
    for block in model.blocks:
        block.register_forward_pre_hook(
            lambda *_: seen.append(
                sum(_bytes(p.to_local() for p in b.parameters()) > 0 for b in model.blocks)
            )
        )
    for _ in range(2):
        trainer.train_step([batch])
    inner = optimizer.inner if level else [optimizer]
    states = sum(
        _bytes(v for v in s.values() if torch.is_tensor(v) and v.ndim)
        for o in inner
        for s in o.state.values()
    )
    grads = _bytes(p.grad.to_local() for p in model.parameters() if p.grad is not None)
    model(*batch)  # leaves gradients of this forward pending: they are not read
    shard_grads = _bytes(b.shard_grad for b in model.loom.grad_sync.buckets if b.shard_grad is not None)
    resting = _bytes(p.to_local() for p in model.parameters())
    return {"params": total, "states": states, "resting": resting, "seen": seen[-3:], "grads": grads,
            "shard_grads": shard_grads}  # fmt: skip


def test_each_level_keeps_its_share(dist_run):
    results = {level: dist_run(4, memory_case, level)[0] for level in (0, 1, 2, 3)}
    params = results[0]["params"]
    assert results[0]["states"] == 2 * params  # Adam: two states per parameter
    for level in (1, 2, 3):
        # the states cover this rank's chunk: a quarter of the parameters, within the padding of the buckets
        assert abs(results[level]["states"] - 2 * params / 4) <= 2 * 4 * 4 * 8, results[level]
    assert results[1]["grads"] == 0 and results[2]["grads"] == 0  # zero_grad after the step
    assert results[0]["resting"] == params and results[2]["resting"] == params
    assert results[3]["resting"] == 0  # level 3: no parameter memory between uses
    assert results[3]["seen"] == [1, 1, 1]  # only the running block is gathered during forward
    assert results[2]["seen"] == [3, 3, 3]


def _gpt_on_two_ranks() -> tuple[GPT, tuple[torch.Tensor, torch.Tensor]]:
    """loom's GPT laid out over dp 2 (semi_auto) and one batch of (inputs, targets)."""
    loom.init({"dp": 2})
    model = GPT(CONFIG, Strategies(2, 1))
    ids = torch.randint(0, 64, (4, 17), generator=torch.Generator().manual_seed(0))
    batch = (ids[:, :-1], ids[:, 1:])
    loom.parallelize(model, mode="semi_auto", example_inputs=batch)
    return model, batch


def numpy_view_case():
    model, batch = _gpt_on_two_ranks()
    trainer = Trainer(model, make_optimizer(model, torch.optim.AdamW, 3, lr=1e-3))
    for _ in range(2):  # level 3 shards the parameters from the second step on
        trainer.train_step([batch])
    weight = model.blocks[0].mlp.w_up
    with model.loom.full_parameters():
        copy = loom.full(weight).detach().clone().numpy()  # the fix the error message gives: no error
    with pytest.raises(ValueError) as caught:
        with model.loom.full_parameters():
            view = weight.to_local().detach().numpy()  # shares the parameter's memory
    gathered = weight.to_local().untyped_storage().nbytes() > 0  # the pinned unit stays as it was
    others = _bytes(p.to_local() for p in model.blocks[1].parameters())  # the other units were released
    return {"message": str(caught.value), "shapes": [copy.shape, view.shape], "gathered": gathered,
            "others": others}  # fmt: skip


def test_numpy_view_of_a_level_3_parameter_is_a_clear_error(dist_run):
    result = dist_run(2, numpy_view_case)[0]
    message = result["message"]
    assert "release parameter 'blocks.0.mlp.w_up'" in message and "NumPy" in message
    assert ".detach().clone()" in message and "full_parameters()" in message
    assert result["shapes"] == [(CONFIG.d_model, 4 * CONFIG.d_model)] * 2
    assert result["gathered"] and result["others"] == 0


def state_exchange_case():
    """Each rank's own state loads back; another rank's (other chunks) is refused, naming them."""
    model, batch = _gpt_on_two_ranks()
    optimizer = make_optimizer(model, torch.optim.AdamW, 1, lr=1e-3)
    Trainer(model, optimizer).train_step([batch])
    states = [None, None]
    torch.distributed.all_gather_object(states, optimizer.state_dict())
    optimizer.load_state_dict(states[loom.rank()])
    with pytest.raises(ValueError) as caught:
        optimizer.load_state_dict(states[1 - loom.rank()])
    return str(caught.value)


def test_a_zero_state_loads_only_on_the_chunks_that_saved_it(dist_run):
    for message in dist_run(2, state_exchange_case):
        assert "the state's chunks (size, rank, group size per bucket)" in message, message
        assert "saved by another rank or with other buckets" in message
