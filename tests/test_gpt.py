"""Tier 2: the reference GPT issues Megatron's collectives per layer, and builds on the meta device."""

import pytest
import torch
from torch.distributed.tensor.debug import CommDebugMode

import loom
from loom.dist.comm import collective_counts
from loom.models.gpt import GPT, GPTConfig, Strategies


def forward_collectives(layers, sequence_parallel):
    loom.init({"dp": 2, "tp": 2})
    config = GPTConfig(vocab_size=64, d_model=32, n_layers=layers, n_heads=4, max_seq_len=16)
    model = GPT(config, Strategies(2, 2, sequence_parallel))
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    loom.parallelize(model, mode="semi_auto", example_inputs=(ids,))
    with CommDebugMode() as comm:
        model(ids)
    return collective_counts(comm)


@pytest.mark.parametrize(
    ("sequence_parallel", "per_layer"),
    [(False, {"all_reduce": 2}), (True, {"all_gather": 2, "reduce_scatter": 2})],
)
def test_collectives_per_layer_are_megatrons(dist_run, sequence_parallel, per_layer):
    one = dist_run(4, forward_collectives, 1, sequence_parallel)[0]
    three = dist_run(4, forward_collectives, 3, sequence_parallel)[0]
    extra = {kind: (three.get(kind, 0) - one.get(kind, 0)) / 2 for kind in set(one) | set(three)}
    assert {k: v for k, v in extra.items() if v} == per_layer, (one, three)


def meta_build_case():
    mesh = loom.init({"dp": 2, "tp": 2})
    config = GPTConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, max_seq_len=16, positions="rotary")
    reference = GPT(config)
    with torch.device("meta"):
        model = GPT(config, Strategies(2, 2, True))
    ids = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(0))
    rows = ids.chunk(2)[mesh.dp_rank()]
    loom.parallelize(model, mode="semi_auto", example_inputs=(rows, rows))
    model.loom.materialize(model)
    model.init_weights()
    errors = [
        (loom.full(p) - q).abs().max().item()
        for p, q in zip(model.parameters(), reference.parameters(), strict=True)
    ]
    model(rows, rows).backward()
    synced = all(not any(pl.is_partial() for pl in p.grad.placements) for p in model.parameters())
    return max(errors), synced


def test_meta_build_then_materialise_gives_the_same_model(dist_run):
    for error, synced in dist_run(4, meta_build_case):
        assert error == 0.0  # every shard is the slice of the same seeded draw
        assert synced  # gradient hooks survive materialisation
