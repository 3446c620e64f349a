"""The collectives of one training step, predicted from a Plan (`loom.cost.traffic`), equal what runs.

Tier 1: the recorder's byte convention, the bucket rule, and `step_collectives` against numbers worked out
by hand. Tier 2: one training step (forward, backward, optimizer step) on 4 ranks, dp=2 x tp=2 with
Megatron's layouts, recorded by `loom.dist.comm.CollectiveRecorder` and compared with the prediction
exactly: kind, mesh axes, bytes and count of every collective. The recorded step is the second one: the
first learns the gradient buckets, checks the ranks' agreement and, at level 3, shards the parameters.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest
import torch
import torch.distributed as dist
from hf_models import batches, build

import loom
from loom.cost.buckets import assign_buckets
from loom.cost.plan import ParallelPlan
from loom.cost.traffic import step_collectives, summary
from loom.cost.transformer import TransformerConfig, hf_transformer_config, transformer_config
from loom.dist.comm import CollectiveRecorder, mesh_axes
from loom.models.gpt import GPT, GPTConfig, Strategies
from loom.models.recipes import tensor_plan
from loom.parallel.zero import make_optimizer
from loom.plan import Plan

ROWS, SEQ = 4, 16  # the global batch: 2 rows per data-parallel replica
GPT_CONFIG = GPTConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, max_seq_len=SEQ)


# ---- Tier 1 -------------------------------------------------------------------------------------------


def test_bucket_rule_opens_a_bucket_per_key_and_when_one_is_full():
    items = [("a", 10), ("a", 10), ("b", 5), ("a", 1), ("b", 20), ("b", 1)]
    assert assign_buckets(items, 15) == [[0, 1], [2, 4], [3], [5]]
    assert assign_buckets(items, 100) == [[0, 1, 3], [2, 4, 5]]


LLAMA = TransformerConfig(
    name="llama", layers=2, hidden=64, heads=4, kv_heads=2, vocab=128, ffn_hidden=128, gated_mlp=True,
    norm="rmsnorm", biases=False, dropout=False, tied_embeddings=False,
)  # fmt: skip


def _plan(level: int, sequence_parallel: bool = False) -> ParallelPlan:
    return ParallelPlan(
        dp=2, tp=2, micro_batch=2, global_batch=ROWS, seq=SEQ, optimizer_level=level, dtype="fp32",
        sequence_parallel=sequence_parallel,
    )  # fmt: skip


def test_llama_step_by_hand():
    """Llama, 2 layers, h=64, 32 tokens per replica, fp32: the stream is 32*64*4 = 8192 bytes. Tensor-cut
    weights per layer: (64*64 + 2*64*32 + 64*64 + 3*64*128) / 2 = 18432 elements; with the embedding and
    the head (128*64/2 each): 45056 elements, 180224 bytes over dp. Norms (5 x 64) over dp+tp. 21
    parameters: 672 bytes of flags."""
    expected = {
        ("all_reduce", "dp+tp", 16): 1,  # even-batch check of (ids, labels)
        ("all_reduce", "tp", 8192): 5 + 5,  # embedding + 2 per layer; backward: 2 per layer + head
        ("all_reduce", "tp", 128): 3,  # cross entropy per row: max, sum of exponentials, target
        ("all_reduce", "dp", 4): 1,  # the count of targets
        ("all_reduce", "dp", 180224): 1,
        ("all_reduce", "dp+tp", 1280): 1,
        ("all_reduce", "dp+tp", 672): 1,
    }
    assert summary(step_collectives(LLAMA, _plan(0))) == Counter(expected)
    level2 = summary(step_collectives(LLAMA, _plan(2)))
    assert level2[("reduce_scatter", "dp", 180224)] == level2[("all_gather", "dp", 180224)] == 1
    assert level2[("all_gather", "dp+tp", 1280)] == 1 and ("all_reduce", "dp", 180224) not in level2


def test_level3_gathers_each_unit_twice_and_buckets_never_span_units():
    level3 = summary(step_collectives(LLAMA, _plan(3)))
    per_layer = 18432 * 4
    assert level3[("all_gather", "dp", per_layer)] == 2 * 2  # two layers, forward and backward
    assert level3[("reduce_scatter", "dp", per_layer)] == 2
    assert level3[("all_gather", "dp", 128 * 64 // 2 * 4)] == 2 * 2  # the embedding and the head alone
    assert level3[("reduce_scatter", "dp+tp", 2 * 64 * 4)] == 2  # each layer's two norms
    assert level3[("reduce_scatter", "dp+tp", 64 * 4)] == 1  # the final norm


def test_smaller_buckets_split_the_same_gradients():
    whole = summary(step_collectives(LLAMA, _plan(0)))
    split = summary(step_collectives(LLAMA, _plan(0), bucket_mb=0.05))  # 52428 bytes
    dp_bytes = [(nbytes, n) for (kind, axis, nbytes), n in split.items() if axis == "dp" and nbytes > 4]
    assert sum(nbytes * n for nbytes, n in dp_bytes) == 180224 and sum(n for _, n in dp_bytes) > 1
    assert whole[("all_reduce", "dp", 180224)] == 1


def test_sequence_parallel_swaps_all_reduces_for_gathers_and_scatters():
    plain = summary(step_collectives(LLAMA, _plan(0)))
    sp = summary(step_collectives(LLAMA, _plan(0, sequence_parallel=True)))
    assert ("all_reduce", "tp", 8192) not in sp and plain[("all_reduce", "tp", 8192)] == 10
    # forward: 2 gathers per layer and one before the head, 2 scatters per layer and one after the
    # embedding; backward: the conjugates
    assert sp[("all_gather", "tp", 8192)] == sp[("reduce_scatter", "tp", 8192)] == 2 * (2 * 2 + 1)


def test_hf_description_reads_gpt2s_biases_and_fused_projection():
    gpt2 = hf_transformer_config(build("gpt2").config)
    llama = hf_transformer_config(build("llama").config)
    assert (gpt2.biases, gpt2.fused_qkv, gpt2.tied_embeddings, gpt2.learned_positions) == (
        True,
        True,
        True,
        64,
    )
    assert (llama.biases, llama.fused_qkv, llama.kv, llama.gated_mlp, llama.norm) == (
        False, False, 2, True, "rmsnorm",
    )  # fmt: skip
    assert gpt2.parameter_count() == sum(p.numel() for p in build("gpt2").parameters())
    assert llama.parameter_count() == sum(p.numel() for p in build("llama").parameters())


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_the_simulator_prices_the_predicted_collectives(sequence_parallel):
    """One source of truth: each piece's tp_comm is the predicted list priced collective by collective."""
    from loom.cost.collectives import collective_time, group_span
    from loom.cost.hardware import get_cluster
    from loom.cost.layer import piece_costs
    from loom.cost.traffic import embedding_collectives, head_collectives, layer_collectives

    cluster, plan = get_cluster("a100-80gb", gpus=4), _plan(0, sequence_parallel)
    pieces = piece_costs(LLAMA, plan, cluster)

    def priced(collectives, phase):
        span = {"tp": group_span(2, 1, cluster.gpus_per_node), "dp": group_span(2, 2, cluster.gpus_per_node)}
        return sum(
            c.count * collective_time(c.kind, c.nbytes, span[c.axis], cluster)
            for c in collectives
            if c.phase == phase
        )

    head = head_collectives(LLAMA, plan, counted_loss=False)
    assert pieces.layer_fwd["tp_comm"] == priced(layer_collectives(LLAMA, plan), "forward") > 0
    assert pieces.layer_bwd["tp_comm"] == priced(layer_collectives(LLAMA, plan), "backward") > 0
    assert pieces.embed_fwd["tp_comm"] == priced(embedding_collectives(LLAMA, plan), "forward") > 0
    assert pieces.embed_bwd["tp_comm"] == priced(embedding_collectives(LLAMA, plan), "backward")
    assert pieces.head_fwd["tp_comm"] == priced(head, "forward") > 0
    assert pieces.head_bwd["tp_comm"] == priced(head, "backward") > 0


def test_unsupported_plans_are_refused():
    with pytest.raises(ValueError, match="tp > 1"):
        step_collectives(LLAMA, _plan(0).replace(tp=1))
    with pytest.raises(ValueError, match="ep"):
        step_collectives(LLAMA, _plan(0).replace(ep=2))
    with pytest.raises(ValueError, match="pp_rank 2"):
        step_collectives(LLAMA, _plan(0).replace(dp=1, pp=2), pp_rank=2)
    with pytest.raises(ValueError, match="do not split evenly"):
        step_collectives(dataclasses.replace(LLAMA, layers=3), _plan(0).replace(dp=1, pp=2))


# ---- Tier 2: the recorder ------------------------------------------------------------------------------


def recorder_case():
    from loom.dist.collectives import all_gather_flat, reduce_scatter_flat

    mesh = loom.init({"dp": 2, "tp": 2})
    tp = mesh.axis_group("tp")
    with CollectiveRecorder() as rec:
        buffer = torch.ones(4)
        dist.all_reduce(buffer)  # the world: 16 bytes
        gathered = torch.empty(8)
        all_gather_flat(gathered, buffer[:4], group=tp)  # output: 32 bytes
        reduce_scatter_flat(torch.empty(2), buffer, group=tp)  # input: 16 bytes
        first = dist.get_rank() - mesh.axis_rank("tp")  # the tp group's first rank (tp is innermost)
        dist.broadcast(buffer, src=first, group=tp)  # 16 bytes
        dist.reduce(buffer, dst=first, group=tp)  # 16 bytes
        cut = torch.distributed.tensor.distribute_tensor(  # scattered from the first rank: 16 bytes each
            torch.arange(8.0), mesh["tp"], [torch.distributed.tensor.Shard(0)]
        )
        cut.full_tensor()  # DTensor's functional all-gather: 32 bytes gathered
    axes = mesh_axes(("dp", "tp"), (2, 2), dist.get_rank())
    return rec.summary(axes)


def test_recorder_sizes_each_kind_by_its_convention(dist_run):
    for recorded in dist_run(4, recorder_case):
        assert recorded == Counter(
            {
                ("all_reduce", "dp+tp", 16): 1,
                ("all_gather", "tp", 32): 2,
                ("reduce_scatter", "tp", 16): 1,
                ("broadcast", "tp", 16): 1,
                ("reduce", "tp", 16): 1,
                ("scatter", "tp", 16): 1,
            }
        )


# ---- Tier 2: one step, predicted and recorded ----------------------------------------------------------


def _build(family: str, mesh, level: int, sequence_parallel: bool, bucket_mb: float):
    """The model made parallel under a Plan, and a function that runs its forward on this replica's rows."""
    if family == "gpt":
        model = GPT(GPT_CONFIG, Strategies(2, 2, sequence_parallel))
        ids = torch.randint(0, GPT_CONFIG.vocab_size, (ROWS, SEQ), generator=torch.Generator().manual_seed(0))
        rows = ids.chunk(2)[mesh.dp_rank()]
        plan = Plan(dp=2, tp=2, optimizer_level=level, sequence_parallel=sequence_parallel)
        loom.parallelize(model, plan=plan, example_inputs=(rows, rows), bucket_mb=bucket_mb)
        return model, lambda: model(rows, rows)
    model = build(family)
    plan = Plan(dp=2, tp=2, optimizer_level=level, strategies=tensor_plan(model))
    loom.parallelize(model, plan=plan, bucket_mb=bucket_mb)
    ids = batches(rows=ROWS, seq=SEQ)[0].chunk(2)[mesh.dp_rank()]
    return model, lambda: model(input_ids=ids, labels=ids).loss


def step_case(family: str, level: int, sequence_parallel: bool = False, bucket_mb: float = 25.0):
    mesh = loom.init({"dp": 2, "tp": 2})
    model, forward = _build(family, mesh, level, sequence_parallel, bucket_mb)
    optimizer = make_optimizer(model, torch.optim.SGD, level, lr=0.01)
    for _ in range(2):
        with CollectiveRecorder() as rec:
            forward().backward()
            optimizer.step()
            optimizer.zero_grad()
    return rec.summary(mesh_axes(("dp", "tp"), (2, 2), dist.get_rank()))


def _predicted(family: str, level: int, sequence_parallel: bool = False, bucket_mb: float = 25.0) -> Counter:
    plan = Plan(dp=2, tp=2, optimizer_level=level, sequence_parallel=sequence_parallel)
    if family == "gpt":
        model, counted = transformer_config(GPT_CONFIG), False
    else:
        model, counted = hf_transformer_config(build(family).config), True
    predicted = plan.predicted_collectives(
        model, global_batch=ROWS, seq=SEQ, bucket_mb=bucket_mb, counted_loss=counted
    )
    return summary(predicted)


def _check(dist_run, family, level, sequence_parallel=False, bucket_mb=25.0):
    expected = _predicted(family, level, sequence_parallel, bucket_mb)
    for rank, recorded in enumerate(dist_run(4, step_case, family, level, sequence_parallel, bucket_mb)):
        assert recorded == expected, (rank, recorded - expected, expected - recorded)


@pytest.mark.parametrize(
    ("family", "level", "sequence_parallel"),
    [("llama", 0, False), ("llama", 3, False), ("gpt2", 1, False), ("gpt", 2, False)],
)
def test_one_step_issues_the_predicted_collectives(dist_run, family, level, sequence_parallel):
    _check(dist_run, family, level, sequence_parallel)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("family", "level", "sequence_parallel", "bucket_mb"),
    [
        ("gpt", 2, True, 25.0),
        ("gpt", 0, True, 25.0),
        ("llama", 1, False, 25.0),
        ("llama", 2, False, 25.0),
        ("gpt2", 0, False, 25.0),
        ("gpt2", 2, False, 25.0),
        ("gpt2", 3, False, 25.0),
        ("gpt", 1, False, 25.0),
        ("gpt", 3, False, 25.0),
        ("llama", 0, False, 0.05),
    ],
)
def test_more_steps_issue_the_predicted_collectives(dist_run, family, level, sequence_parallel, bucket_mb):
    _check(dist_run, family, level, sequence_parallel, bucket_mb)
