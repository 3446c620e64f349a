"""Tier 2: unedited Hugging Face causal LMs trained with their sequences cut over cp equal one device.

3 SGD steps of a tiny Llama (grouped-query attention: 4 heads, 2 key/value heads; sequence 16) on 4 ranks
under `loom.parallelize(model, plan=Plan(cp=2, ...))`, cp = 2 x dp = 2 with ring and with Ulysses attention,
cp = 2 x tp = 2 (Megatron layouts) with Ulysses; GPT-2 (learned positions) and Mixtral (experts over ep = 2) once. Each rank brings its
replica's whole sequences, as one device does; the model cuts them. The same losses and first gradients
(rtol `RTOL`, atol `GRAD_ATOL`) and parameters after SGD (`assert_params_close`, tests/equivalence.py); the
second step's exchanges over the cp group are those `loom.cost.context` prices, layer by layer. Then the
refusals: heads Ulysses cannot cut, a sequence that does not cut, a padding mask, a model loom cannot cut, a
GPT built without the plan's cp.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.distributed as dist
from equivalence import GRAD_ATOL, RTOL, assert_params_close
from hf_models import batches, build
from test_context_parallel_training import _refusal
from torch import nn
from torch.distributed.tensor import Replicate, distribute_tensor

import loom
from loom.cost.context import ring_collectives, ulysses_collectives
from loom.cost.traffic import summary
from loom.dist.comm import CollectiveRecorder, mesh_axes
from loom.models.gpt import GPT, GPTConfig
from loom.models.recipes import tensor_plan
from loom.plan import Plan

LR, SEQ, ROWS = 0.1, 16, 4
ATTENTION_KINDS = {"ulysses": {"all_to_all"}, "ring": {"send", "recv"}}


def _train(model, data, local=lambda t: t, watch=None):
    """SGD steps on `model(input_ids=ids, labels=ids)`; `watch` (a context manager) around the second step's
    forward and backward: the losses, the first step's gradients and the last parameters, whole."""
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses, grads = [], None
    for step, ids in enumerate(data):
        optimizer.zero_grad()
        with watch if watch is not None and step == 1 else contextlib.nullcontext():
            loss = model(input_ids=local(ids), labels=local(ids)).loss
            loss.backward()
        if step == 0:
            grads = {name: loom.full(p.grad).clone() for name, p in model.named_parameters()}
        optimizer.step()
        losses.append(loom.full(loss).item())
    params = {name: loom.full(p).detach().clone() for name, p in model.named_parameters()}
    return losses, grads, params


def train_case(family, dp, tp, attention, ep=1):
    """One device's run and this rank's run on a dp x cp x tp mesh (cp = 2), and the second step's
    attention exchanges over cp (kind, axis, bytes)."""
    reference = build(family)
    model = copy.deepcopy(reference)
    data = batches(rows=ROWS, seq=SEQ)
    expected = _train(reference, data)
    sizes = {"dp": dp, "cp": 2} | ({"tp": tp} if tp > 1 else {})
    mesh = loom.init(sizes)
    strategies = tensor_plan(model) if tp > 1 or ep > 1 else {}
    plan = Plan(dp=dp, cp=2, tp=tp, ep=ep, attention=attention, strategies=strategies)
    loom.parallelize(model, plan=plan)
    recorder = CollectiveRecorder()
    actual = _train(model, data, lambda t: t.chunk(dp)[mesh.dp_rank()], recorder)
    recorded = recorder.summary(mesh_axes(("dp", "cp", "tp"), (dp, 2, tp), dist.get_rank()))
    exchanges = {
        key: n for key, n in recorded.items() if key[1] == "cp" and key[0] in ATTENTION_KINDS[attention]
    }
    return expected, actual, exchanges


def _predicted(model, dp, tp, attention):
    """`loom.cost.context`'s exchanges of one step: one attention call per layer, on each rank's rows and
    heads (tp cuts the heads), fp32."""
    config = model.config
    heads, kv_heads = config.num_attention_heads, getattr(config, "num_key_value_heads", None)
    kv_heads = kv_heads or heads
    formula = ulysses_collectives if attention == "ulysses" else ring_collectives
    layer = formula(batch=ROWS // dp, seq=SEQ, heads=heads // tp, kv_heads=max(kv_heads // tp, 1),
                    head_dim=config.hidden_size // heads, cp=2, dtype_bytes=4)  # fmt: skip
    return summary(layer * config.num_hidden_layers)


def _assert_equivalent(expected, actual):
    (ref_losses, ref_grads, ref_params), (losses, grads, params) = expected, actual
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=RTOL, atol=0)
    for name, grad in ref_grads.items():
        torch.testing.assert_close(
            grads[name], grad, rtol=RTOL, atol=GRAD_ATOL, msg=lambda m, n=name: f"{n}: {m}"
        )
    assert_params_close(params, ref_params, lr=LR, steps=len(losses), eps=1.0)


def refusal_case():
    """What a sequence cut over cp cannot run, refused on every rank before any exchange."""
    from transformers import LlamaConfig, LlamaForCausalLM

    loom.init({"cp": 2, "tp": 2})
    two_heads = LlamaForCausalLM(
        LlamaConfig(num_hidden_layers=1, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                    num_key_value_heads=2, vocab_size=128, max_position_embeddings=64, use_cache=False)
    )  # fmt: skip
    refusals = [
        _refusal(lambda: loom.parallelize(two_heads, plan=Plan(dp=1, cp=2, tp=2, attention="ulysses")))
    ]
    loom.init({"dp": 2, "cp": 2})
    model = loom.parallelize(build("llama"), plan=Plan(dp=2, cp=2, attention="ring"))
    ids = batches(count=1, rows=2, seq=14)[0]
    refusals.append(_refusal(lambda: model(input_ids=ids, labels=ids)))  # 14 tokens: not 4 head-tail chunks
    ids = ids[:, :12]
    refusals.append(_refusal(lambda: model(input_ids=ids, attention_mask=torch.ones_like(ids))))
    other_rows = (ids + loom.current_mesh().axis_rank("cp")) % 128  # each cp rank its own rows: refused
    refusals.append(_refusal(lambda: model(input_ids=other_rows, labels=other_rows)))
    whole = distribute_tensor(ids, loom.current_mesh().device_mesh, [Replicate()] * 2)
    refusals.append(_refusal(lambda: model(input_ids=whole)))
    refusals.append(_refusal(lambda: copy.deepcopy(model)(input_ids=ids)))  # a copy runs on the cp group
    plan = Plan(dp=2, cp=2)
    refusals.append(_refusal(lambda: loom.parallelize(nn.Sequential(nn.Linear(4, 4)), plan=plan)))
    gpt = GPT(GPTConfig(vocab_size=16, d_model=16, n_layers=1, n_heads=2, max_seq_len=8))
    refusals.append(_refusal(lambda: loom.parallelize(gpt, plan=plan)))
    return refusals


def cases_body(cases):
    return [train_case(*case) for case in cases], refusal_case()


def _check(per_rank, cases):
    for (family, dp, tp, attention, *_), (expected, actual, exchanges) in zip(cases, per_rank, strict=True):
        _assert_equivalent(expected, actual)
        predicted = _predicted(build(family), dp, tp, attention)
        assert exchanges == predicted, (family, dp, tp, attention, exchanges, predicted)


def test_llama_with_its_sequences_cut_over_cp_by_ring_attention_matches_one_device(dist_run):
    """cp = 2 x dp = 2, ring attention (head-tail cut: rank 0 holds positions 0-3 and 12-15)."""
    cases = [("llama", 2, 1, "ring")]
    for per_rank, refusals in dist_run(4, cases_body, cases):
        _check(per_rank, cases)
        assert "tp x cp = 4 must divide num_attention_heads = 2" in refusals[0], refusals[0]
        assert "use attention = 'ring'" in refusals[0]
        assert "input_ids: a sequence of 14 tokens does not cut over cp = 2" in refusals[1], refusals[1]
        assert "pad the sequences to a multiple of 4" in refusals[1]
        assert "drop attention_mask" in refusals[2], refusals[2]
        assert "loom knows no attention modules of Sequential" in refusals[6], refusals[6]
        assert "'LlamaForCausalLM'" in refusals[6]
        assert "built with Strategies(cp=1, attention='ulysses')" in refusals[7], refusals[7]
        assert "input_ids, labels differ across the cp ranks of one replica" in refusals[3], refusals[3]
        assert "input_ids is a DTensor: with cp > 1 pass plain tensors" in refusals[4], refusals[4]
        assert refusals[5] == "no error"


SLOW_CASES = [
    ("llama", 2, 1, "ulysses"),
    ("llama", 1, 2, "ulysses"),
    ("gpt2", 2, 1, "ring"),
    ("mixtral", 2, 1, "ring", 2),
]


def slow_body(cases):
    return [train_case(*case) for case in cases]


@pytest.mark.slow
def test_hugging_face_models_under_cp_with_ulysses_tensor_parallelism_and_learned_positions(dist_run):
    """Llama cp = 2 x dp = 2 and cp = 2 x tp = 2 with Ulysses (the key/value heads repeated to cp), GPT-2 (learned
    positions looked up by global position) and Mixtral (its experts cut over ep = 2 of the dp ranks) with ring
    attention."""
    for per_rank in dist_run(4, slow_body, SLOW_CASES):
        _check(per_rank, SLOW_CASES)
