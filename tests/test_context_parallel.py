"""Context parallelism (`loom.parallel.context`, `loom.parallel.ring`) equals one-device attention.

Tier 1: the sequence layouts and their balance, the input checks, the communication formulas worked out by
hand, and both attentions without a group. Tier 2: on cp = 2 and cp = 4 ranks (and cp = 2 inside a dp x cp
mesh), Ulysses and ring attention, on both layouts, causal or not, multi-head and grouped-query, against
`F.scaled_dot_product_attention` over the whole sequence on one device: this rank's output and the gradients
of its q, k, v shards (fp32; atol 1e-5, rtol 1e-4: attention and its gradients are Lipschitz in the inputs,
and the merge order of the blocks changes only the rounding). The collectives each call issues, recorded by
`CollectiveRecorder`, equal `loom.cost.context`'s formulas: kind, bytes and count.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.nn.functional as F

import loom
from loom.cost.collectives import collective_time, group_span
from loom.cost.context import attention_flops, communication_time, ring_collectives, ulysses_collectives
from loom.cost.hardware import get_cluster
from loom.cost.traffic import summary
from loom.dist.comm import CollectiveRecorder, mesh_axes
from loom.parallel.context import (
    causal_work,
    check_attention_inputs,
    chunk_pairs,
    sequence_chunks,
    shard_sequence,
    ulysses_attention,
    unshard_sequence,
)
from loom.parallel.ring import ring_attention

BATCH, HEADS, SEQ, HEAD_DIM = 2, 4, 16, 8
ATOL, RTOL = 1e-5, 1e-4
ATTENTIONS = {"ulysses": (ulysses_attention, ulysses_collectives), "ring": (ring_attention, ring_collectives)}


# ---- Tier 1 -------------------------------------------------------------------------------------------


def test_head_tail_layout_gives_each_rank_an_early_and_a_late_chunk():
    assert [sequence_chunks(r, 4, "head_tail") for r in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    assert [sequence_chunks(r, 2, "contiguous") for r in range(2)] == [(0,), (1,)]
    with pytest.raises(ValueError, match="unknown sequence layout"):
        sequence_chunks(0, 2, "zigzag")


def test_under_a_causal_mask_the_head_tail_cut_balances_the_work():
    """Half chunk pairs per rank at cp = 4. Contiguous: rank r's chunk sees r whole chunks and half its own,
    2r + 1. Head-tail, 8 chunks: chunk r costs 2r + 1 and chunk 7 - r costs 15 - 2r, 16 on every rank."""
    assert [causal_work(r, 4, "contiguous") for r in range(4)] == [1, 3, 5, 7]
    assert [causal_work(r, 4, "head_tail") for r in range(4)] == [16] * 4
    assert chunk_pairs(0, 0, 2, "head_tail", causal=True) == [(0, 0, True), (1, 0, False), (1, 1, True)]
    assert len(chunk_pairs(0, 1, 2, "head_tail", causal=False)) == 4


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_the_cost_model_prices_the_busiest_rank_as_ring_attention_works(cp):
    """`attention_flops` against the chunk pairs ring attention computes (`causal_work`): the busiest rank's
    share of all causal scores."""
    sizes = {"batch": 1, "seq": 64 * cp, "heads": 8, "head_dim": 16, "cp": cp, "causal": True}
    every_score = 8 * (64 * cp) ** 2 / 2 * 16 * 4  # forward FLOPs of all causal scores, one device
    for layout in ("contiguous", "head_tail"):
        work = [causal_work(r, cp, layout) for r in range(cp)]
        forward, backward = attention_flops(kind="ring", layout=layout, **sizes)
        assert forward == pytest.approx(every_score * max(work) / sum(work))
        assert backward == pytest.approx(forward * 10 / 4)
    assert attention_flops(kind="ulysses", layout="contiguous", **sizes)[0] == pytest.approx(every_score / cp)


def test_bad_shards_are_refused_with_the_dim_and_the_fix():
    q, kv = torch.zeros(2, 4, 8, 8), torch.zeros(2, 4, 6, 8)
    with pytest.raises(ValueError, match=r"q holds 8 positions \(dim 2\), k and v 6.*same shard_sequence"):
        check_attention_inputs(q, kv, kv, cp=2, layout="contiguous", where="ring_attention")
    with pytest.raises(ValueError, match=r"4 heads \(dim 1\), not a multiple of k and v's 3"):
        check_attention_inputs(q, q[:, :3], q[:, :3], cp=2, layout="contiguous", where="ring_attention")
    with pytest.raises(ValueError, match="holds 2 chunks per rank.*7 positions"):
        check_attention_inputs(q[:, :, :7], q[:, :, :7], q[:, :, :7], cp=2, layout="head_tail", where="x")
    with pytest.raises(ValueError, match=r"must be \[batch, heads, seq / cp, head_dim\]"):
        check_attention_inputs(q[0], q[0], q[0], cp=2, layout="contiguous", where="x")


def test_ulysses_traffic_by_hand():
    """b=2, s=16 over cp=4 (4 positions per rank), d=8, fp32: one head over the rank's positions is
    2*4*8*4 = 256 bytes. 4 query heads and 2 kv heads, repeated to lcm(2, 4) = 4 for the all-to-all:
    q,k,v 12 heads = 3072 bytes, the output 4 heads = 1024 bytes, each once forward and once backward."""
    got = summary(ulysses_collectives(batch=2, seq=16, heads=4, kv_heads=2, head_dim=8, cp=4, dtype_bytes=4))
    assert got == Counter({("all_to_all", "cp", 3072): 2, ("all_to_all", "cp", 1024): 2})
    assert ulysses_collectives(batch=2, seq=16, heads=4, kv_heads=2, head_dim=8, cp=1, dtype_bytes=4) == []


def test_ring_traffic_by_hand():
    """The same sizes in bf16: keys and values of 2 kv heads, 2*2*2*4*8 = 256 elements = 512 bytes; forward
    3 exchanges, backward 3 more and 4 of the fp32 gradients (1024 bytes)."""
    got = summary(ring_collectives(batch=2, seq=16, heads=4, kv_heads=2, head_dim=8, cp=4, dtype_bytes=2))
    assert got == Counter(
        {("send", "cp", 512): 6, ("recv", "cp", 512): 6, ("send", "cp", 1024): 4, ("recv", "cp", 1024): 4}
    )


@pytest.mark.parametrize("name", ["ulysses", "ring"])
def test_without_a_group_both_attentions_are_one_device_attention(name):
    """group=None: one rank. Ring attention still cuts the head-tail chunks and skips hidden pairs. A scale
    other than 1 / sqrt(head_dim), as SDPA takes it."""
    inputs, out, grads = _reference(kv_heads=2, causal=True, scale=0.3)
    q, k, v = (t.clone().requires_grad_() for t in inputs[:3])
    got = ATTENTIONS[name][0](q, k, v, group=None, causal=True, scale=0.3, layout="head_tail")
    (got * inputs[3]).sum().backward()
    for g, w in zip((got, q.grad, k.grad, v.grad), (out, *grads), strict=True):
        assert _errors(g, w) <= ATOL


def test_communication_time_prices_each_exchange_once():
    """Ring at cp = 8 inside one node: 7 + 7 exchanges of k,v and 8 of their gradients, each priced as one
    send/receive; Ulysses: four all-to-alls."""
    cluster, span = get_cluster("a100-80gb", gpus=8), group_span(8, 1, 8)
    sizes = {"batch": 1, "seq": 8192, "heads": 32, "kv_heads": 8, "head_dim": 128, "cp": 8, "dtype_bytes": 2}
    kv = 2 * 8 * 1024 * 128
    ring = 14 * collective_time("send_recv", kv * 2, span, cluster) + 8 * collective_time(
        "send_recv", kv * 4, span, cluster
    )
    assert communication_time(ring_collectives(**sizes), span, cluster) == pytest.approx(ring)
    qkv, out = (32 + 16) * 1024 * 128 * 2, 32 * 1024 * 128 * 2
    ulysses = 2 * collective_time("all_to_all", qkv, span, cluster) + 2 * collective_time(
        "all_to_all", out, span, cluster
    )
    assert communication_time(ulysses_collectives(**sizes), span, cluster) == pytest.approx(ulysses)


# ---- Tier 2 -------------------------------------------------------------------------------------------


def _reference(
    kv_heads: int, causal: bool, scale: float | None = None
) -> tuple[list[torch.Tensor], torch.Tensor, list[torch.Tensor]]:
    """The whole q, k, v, a random output weight (loss = sum(out * weight)) and one device's output and
    gradients: [q, k, v, weight], out, [grad q, grad k, grad v]."""
    generator = torch.Generator().manual_seed(kv_heads + 10 * causal)
    shapes = [(BATCH, HEADS, SEQ, HEAD_DIM), *2 * [(BATCH, kv_heads, SEQ, HEAD_DIM)]]
    q, k, v = (torch.randn(shape, generator=generator, requires_grad=True) for shape in shapes)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=kv_heads != HEADS)
    weight = torch.randn(out.shape, generator=generator)
    (out * weight).sum().backward()
    return [q.detach(), k.detach(), v.detach(), weight], out.detach(), [q.grad, k.grad, v.grad]


def _errors(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| - rtol |want|: <= atol when the tensors match at the stated tolerances."""
    return ((got - want).abs() - RTOL * want.abs()).max().item()


def _case(name: str, layout: str, causal: bool, kv_heads: int, group, axes: dict) -> tuple[float, bool]:  # noqa: ANN001
    """One attention on this rank's shards: its worst error (`_errors`) over the output and the gradients of
    q, k, v, and whether the collectives it issued equal the formula."""
    attention, formula = ATTENTIONS[name]
    inputs, out, grads = _reference(kv_heads, causal)
    q, k, v, weight = (shard_sequence(t, 2, group, layout=layout) for t in inputs)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    tiles = {"tile": 3} if name == "ring" else {}  # ring: score tiles of 3 query rows, the last one short
    with CollectiveRecorder() as recorder:
        got = attention(q, k, v, group=group, causal=causal, layout=layout, **tiles)
        (got * weight).sum().backward()
    wants = [shard_sequence(t, 2, group, layout=layout) for t in (out, *grads)]
    error = max(_errors(g, w) for g, w in zip((got, q.grad, k.grad, v.grad), wants, strict=True))
    cp = torch.distributed.get_world_size(group)
    expected = formula(
        batch=BATCH, seq=SEQ, heads=HEADS, kv_heads=kv_heads, head_dim=HEAD_DIM, cp=cp, dtype_bytes=4
    )
    return error, recorder.summary(axes) == summary(expected)


def equivalence_case() -> dict[str, tuple[float, bool]]:
    """Every attention, layout, mask and head count on this cp group (see `_case`), and `unshard_sequence`
    undoing `shard_sequence`."""
    cp = torch.distributed.get_world_size()
    mesh = loom.init({"cp": cp})
    group = mesh.axis_group("cp")
    axes = mesh_axes(("cp",), (cp,), mesh.axis_rank("cp"))
    results = {}
    for name in ATTENTIONS:
        for layout in ("contiguous", "head_tail"):
            for causal in (False, True):
                for kv_heads in (
                    HEADS,
                    1,
                ):  # multi-head; grouped-query with one kv head, which cp does not divide
                    case = f"{name} {layout} causal={causal} kv_heads={kv_heads}"
                    results[case] = _case(name, layout, causal, kv_heads, group, axes)
    x = torch.arange(SEQ * 3.0).reshape(1, 3, SEQ)
    shard = shard_sequence(x, 2, group, layout="head_tail")
    results["unshard"] = (unshard_sequence(shard, 2, group, layout="head_tail") - x).abs().max().item(), True
    return results


@pytest.mark.parametrize("cp", [2, 4])
def test_ulysses_and_ring_attention_match_one_device(dist_run, cp):
    for results in dist_run(cp, equivalence_case):
        for case, (error, same_collectives) in results.items():
            assert error <= ATOL, f"{case}: error {error}"
            assert same_collectives, f"{case}: the recorded collectives differ from loom.cost.context's"


def sub_group_case() -> dict[str, tuple[float, bool]]:
    """cp = 2 inside a dp = 2 x cp = 2 mesh: the cp group is not the world, nor ranks 0..1 for every rank."""
    mesh = loom.init({"dp": 2, "cp": 2})
    group = mesh.axis_group("cp")
    axes = {tuple(torch.distributed.get_process_group_ranks(group)): "cp"}
    return {name: _case(name, "head_tail", True, 2, group, axes) for name in ATTENTIONS}


def test_attention_over_a_cp_axis_of_a_two_axis_mesh(dist_run):
    for results in dist_run(4, sub_group_case):
        for case, (error, same_collectives) in results.items():
            assert error <= ATOL and same_collectives, (case, error, same_collectives)


def refusal_case() -> list[str]:
    """The errors of shards that differ between the ranks (checked with `check_shards=True`), and of a
    head count that cp does not divide for Ulysses."""
    group = loom.init({"cp": 2}).axis_group("cp")
    positions = 4 if torch.distributed.get_rank(group) == 0 else 6
    q = torch.zeros(BATCH, HEADS, positions, HEAD_DIM)
    messages = []
    for attention in (ulysses_attention, ring_attention):
        with pytest.raises(ValueError) as error:
            attention(q, q, q, group=group, causal=True, layout="contiguous", check_shards=True)
        messages.append(str(error.value))
    with pytest.raises(ValueError) as error:
        ulysses_attention(q[:, :3], q[:, :3], q[:, :3], group=group, causal=True)
    return [*messages, str(error.value)]


def test_bad_shards_on_the_group_are_refused_on_every_rank(dist_run):
    for uneven_ulysses, uneven_ring, heads in dist_run(2, refusal_case):
        for message in (uneven_ulysses, uneven_ring):
            assert "hold shards of different shapes (q, k, v)" in message, message
            assert "rank 0: q (2, 4, 4, 8)" in message and "rank 1: q (2, 4, 6, 8)" in message, message
        assert "3 heads (dim 1), not divisible by the 2 ranks of the cp group" in heads, heads
