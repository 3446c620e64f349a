"""The collectives of one pipeline training step, predicted from a Plan (`loom.cost.traffic`), equal what
runs on every rank: kind, mesh axes, bytes and count, sends and receives between the stages included.

Tier 1: a tp=2 x pp=2 Llama step worked out by hand. Tier 2: one body per world size runs a `Trainer` step of
each pipeline, records the second step with `loom.dist.comm.CollectiveRecorder` (the first learns the buckets
and, at level 3, shards the parameters) and compares each rank with the prediction for its pipeline rank:
on 2 ranks loom's GPT at pp=2 (a tied table whose copies sit on both ranks, summed over pp); on 4 ranks a
Hugging Face Llama (rotary positions) at tp=2 x pp=2; a Hugging Face GPT-2 (its head tied to the token
table: copies on both pipeline ranks) at dp=2 x pp=2, optimizer level 3; loom's GPT (tied table, learned
positions, sequence parallelism) at tp=2 x pp=2, optimizer level 2, and at dp=2 x pp=2 with interleaved
stages (two per pipeline rank), optimizer level 3; Llama at tp=2 x pp=2 under the zero-bubble schedule,
and loom's GPT at dp=2 x pp=2 under zbv (the tied table's two users on rank 0), optimizer level 3, a step
of two pipeline runs (gradient accumulation).
"""

from __future__ import annotations

from collections import Counter

import hf_models
import pytest
import torch
import torch.distributed as dist

import loom
from loom.cost.traffic import summary
from loom.cost.transformer import TransformerConfig, hf_transformer_config, transformer_config
from loom.dist.comm import CollectiveRecorder, mesh_axes
from loom.dist.context import unsharded
from loom.models.gpt import GPT, GPTConfig, Strategies
from loom.parallel import make_optimizer
from loom.parallel.pipeline import gpt_pipeline, model_pipeline
from loom.plan import Plan
from loom.train.trainer import Trainer

pytest.importorskip("transformers")

ROWS, SEQ, MICRO_BATCHES = 4, 16, 2  # the global batch, cut into 2 micro-batches per replica
GPT_CONFIG = GPTConfig(vocab_size=64, d_model=32, n_layers=4, n_heads=4, max_seq_len=SEQ, tie_embeddings=True)

# (name, what runs, Plan): pipelines of 2 pipeline ranks (Hugging Face models: 2 layers)
CASES = [
    ("gpt-alone", "gpt", Plan(dp=1, pp=2, micro_batches=MICRO_BATCHES)),  # a stage per rank, tied copies
    ("llama", "llama", Plan(dp=1, tp=2, pp=2, micro_batches=MICRO_BATCHES)),
    ("gpt2-level3", "gpt2", Plan(dp=2, pp=2, micro_batches=MICRO_BATCHES, optimizer_level=3)),
    (
        "gpt-sequence-parallel-level2",
        "gpt",
        Plan(dp=1, tp=2, pp=2, micro_batches=MICRO_BATCHES, optimizer_level=2, sequence_parallel=True),
    ),
    (
        "gpt-interleaved-level3",
        "gpt",
        Plan(
            dp=2,
            pp=2,
            schedule="interleaved",
            virtual_stages=2,
            micro_batches=MICRO_BATCHES,
            optimizer_level=3,
        ),
    ),
    # zero-bubble schedules (weight passes apart; zbv's V puts the first and the last stage on rank 0)
    (
        "llama-zero-bubble",
        "llama",
        Plan(dp=1, tp=2, pp=2, schedule="zero_bubble", micro_batches=MICRO_BATCHES),
    ),
    (
        "gpt-zbv-level3-accumulating",
        "gpt",
        Plan(dp=2, pp=2, schedule="zbv", virtual_stages=2, micro_batches=MICRO_BATCHES, optimizer_level=3),
    ),
]
PLANS = {name: plan for name, _, plan in CASES}
ACCUMULATION = {"gpt-zbv-level3-accumulating": 2}  # Trainer micro-batches, each a pipeline run


def _description(family: str) -> tuple[TransformerConfig, bool]:
    """The model description the prediction reads, and whether its loss is a mean over counted targets."""
    if family == "gpt":
        return transformer_config(GPT_CONFIG), False
    return hf_transformer_config(hf_models.build(family).config), True


def predicted(family: str, plan: Plan, pp_rank: int, accumulation: int = 1) -> Counter:
    """The Plan's prediction for a rank of pipeline rank `pp_rank`, a step of `accumulation` runs of the
    batch."""
    model, counted = _description(family)
    return summary(
        plan.predicted_collectives(
            model, global_batch=ROWS * accumulation, seq=SEQ, counted_loss=counted, pp_rank=pp_rank,
            accumulation=accumulation,
        )
    )  # fmt: skip


# ---- Tier 1 -------------------------------------------------------------------------------------------


def test_llama_pipeline_step_by_hand():
    """Llama (2 layers, h=64) at tp=2 x pp=2, fp32: 2 micro-batches of 2 rows x 16 tokens, a stream of
    2*16*64*4 = 8192 bytes. Per micro-batch the first stage sums the embedding's and its layer's two
    row-parallel outputs over tp (3) and its layer's two column-parallel input gradients (2), the last
    stage its layer's (2 + 2), the head's input gradient (1) and cross entropy's three per-row numbers (32
    rows x 4 bytes). Each sends and receives the stream once a micro-batch each way. Gradients: only the
    norms are pending (over tp: 2 x 64 floats on the first stage, 3 x 64 on the last); flags for 10 and 11
    parameters; the step's loss and gradient norm over the world."""
    step = {("all_reduce", "pp+tp", 4): 1, ("all_reduce", "pp+tp", 8): 1}
    first = {("all_reduce", "tp", 8192): 2 * 5, ("all_reduce", "tp", 512): 1, ("all_reduce", "tp", 320): 1}
    last = {
        ("all_reduce", "tp", 8192): 2 * 5, ("all_reduce", "tp", 128): 2 * 3,
        ("all_reduce", "tp", 768): 1, ("all_reduce", "tp", 352): 1,
    }  # fmt: skip
    p2p = {("send", "pp", 8192): 2, ("recv", "pp", 8192): 2}
    plan = PLANS["llama"]
    assert predicted("llama", plan, 0) == Counter(first | p2p | step)
    assert predicted("llama", plan, 1) == Counter(last | p2p | step)


def test_level_3_gathers_a_stage_around_each_piece_of_work_and_a_tied_table_once():
    plan = PLANS["gpt2-level3"]
    for pp_rank in (0, 1):
        counts = predicted("gpt2", plan, pp_rank)
        stage = [key for key in counts if key[:2] == ("reduce_scatter", "dp")]
        assert len(stage) == 1, "one unit per stage, in one bucket"
        assert counts[("all_gather", "dp", stage[0][2])] == 2 * MICRO_BATCHES  # forward, backward
        table = hf_models.VOCAB * 64 * 4
        assert counts[("all_gather", "pp+dp", table)] == counts[("reduce_scatter", "pp+dp", table)] == 1


# ---- Tier 2 -------------------------------------------------------------------------------------------


def _pipeline(family: str, plan: Plan, mesh):
    """This rank's pipeline of `family` under `plan`, and this replica's rows of the batch."""
    if family == "gpt":
        with torch.device("meta"):  # tensor-parallel GPT stages are laid out from the meta device
            model = GPT(GPT_CONFIG, Strategies(plan.dp, plan.tp, plan.sequence_parallel))
        pipe = gpt_pipeline(
            model, mesh, schedule=plan.schedule, microbatches=plan.micro_batches, virtual=plan.virtual_stages
        )
        ids = torch.randint(0, GPT_CONFIG.vocab_size, (ROWS, SEQ), generator=torch.Generator().manual_seed(0))
    else:
        with unsharded():
            model = hf_models.build(family)
        pipe = model_pipeline(
            model, mesh, schedule=plan.schedule, microbatches=plan.micro_batches, virtual=plan.virtual_stages
        )
        ids = hf_models.batches(rows=ROWS, seq=SEQ)[0]
    return pipe, ids.chunk(plan.dp)[mesh.dp_rank()]


def _cases(world: int) -> list[tuple[str, str, Plan]]:
    return [case for case in CASES if case[2].world_size == world]


def recorded_steps(world: int) -> list[Counter]:
    """Each case of `world` ranks: its second `Trainer` step on this rank, as (kind, mesh axes, bytes) ->
    calls."""
    results = []
    for name, family, plan in _cases(world):
        mesh = loom.init(plan.mesh_sizes())
        pipe, rows = _pipeline(family, plan, mesh)
        trainer = Trainer(pipe, make_optimizer(pipe, torch.optim.SGD, plan.optimizer_level, lr=0.01))
        for _ in range(2):
            with CollectiveRecorder() as rec:
                trainer.train_step([(rows, rows)] * ACCUMULATION.get(name, 1))
        sizes = {axis: size for axis, size in plan.mesh_sizes().items() if size > 1}
        results.append(rec.summary(mesh_axes(tuple(sizes), tuple(sizes.values()), dist.get_rank())))
    return results


@pytest.mark.parametrize("world", [2, 4])
def test_one_pipeline_step_issues_the_predicted_collectives(dist_run, world):
    for rank, cases in enumerate(dist_run(world, recorded_steps, world)):
        for (name, family, plan), recorded in zip(_cases(world), cases, strict=True):
            expected = predicted(family, plan, rank // (plan.dp * plan.tp), ACCUMULATION.get(name, 1))
            assert recorded == expected, (name, rank, recorded - expected, expected - recorded)
