"""Context parallelism: attention over a sequence cut across the ranks of a `cp` process group.

Each rank holds a shard of the sequence of q, k and v, shaped [batch, heads, seq / cp, head_dim]. Two ways
to attend over the whole sequence:

- `ulysses_attention` (DeepSpeed-Ulysses): one all-to-all turns the sequence cut into a head cut (every rank
  gets the whole sequence for heads / cp heads), attention runs locally, a second all-to-all turns the head
  cut back. Traffic per rank is its own shards (it shrinks as 1 / cp), but cp must divide the head count.
- `ring_attention` (`loom.parallel.ring`): key/value blocks travel around the ranks (cp - 1 exchanges),
  partial results are merged by their log-sum-exp. Any head count; traffic per rank is about the whole
  sequence's keys and values, whatever cp is, but it overlaps with the attention of the block in hand.

How the sequence is cut (`shard_sequence`): "contiguous" gives rank r the r-th of cp equal pieces;
"head_tail" cuts the sequence into 2 * cp chunks and gives rank r chunks r and 2 * cp - 1 - r, so that under
a causal mask every rank does the same amount of work (an early chunk sees little, a late chunk much).
Position ids and rotary tables must be cut the same way as the tokens: `shard_sequence` takes any tensor.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

__all__ = [
    "LAYOUTS",
    "check_attention_inputs",
    "causal_work",
    "check_shards_agree",
    "chunk_pairs",
    "chunk_count",
    "sequence_chunks",
    "sequence_layout",
    "shard_sequence",
    "ulysses_attention",
    "ulysses_kv_repeat",
    "unshard_sequence",
]

LAYOUTS = ("contiguous", "head_tail")


def sequence_layout(attention: str) -> str:
    """How a sequence is cut over cp for `attention`: "head_tail" balances ring attention's causal work;
    Ulysses gathers the whole sequence per head, so a plain "contiguous" cut serves it."""
    if attention not in ("ulysses", "ring"):
        raise ValueError(f"attention {attention!r} is not one of ['ring', 'ulysses']")
    return "head_tail" if attention == "ring" else "contiguous"


# ---- how the sequence is cut --------------------------------------------------------------------------


def chunk_count(cp: int, layout: str) -> int:
    """How many equal chunks the global sequence is cut into: cp ("contiguous") or 2 * cp ("head_tail")."""
    _check_layout(layout)
    return cp if layout == "contiguous" else 2 * cp


def sequence_chunks(rank: int, cp: int, layout: str) -> tuple[int, ...]:
    """The global chunk indices that `rank` of `cp` holds, in the order it holds them."""
    if not 0 <= rank < cp:
        raise ValueError(f"rank {rank} is not in a cp group of {cp} ranks")
    if chunk_count(cp, layout) == cp:
        return (rank,)
    return (rank, 2 * cp - 1 - rank)


def chunk_pairs(rank: int, source: int, cp: int, layout: str, *, causal: bool) -> list[tuple[int, int, bool]]:
    """The (query chunk, key chunk, on the diagonal) pairs, by local chunk index, that `rank` computes against
    the keys `source` holds: under a causal mask only the pairs it does not hide entirely, and "on the
    diagonal" (the same global chunk, cut along its diagonal) for those it hides half of."""
    pairs = []
    for i, qc in enumerate(sequence_chunks(rank, cp, layout)):
        for j, kc in enumerate(sequence_chunks(source, cp, layout)):
            if not causal or kc < qc:
                pairs.append((i, j, False))
            elif kc == qc:
                pairs.append((i, j, True))
    return pairs


def causal_work(rank: int, cp: int, layout: str) -> int:
    """The attention scores `rank` computes under a causal mask, over all key blocks, in half chunk pairs
    (a pair on the diagonal is half): equal on every rank for "head_tail", growing with the rank for
    "contiguous"."""
    return sum(
        1 if diagonal else 2
        for source in range(cp)
        for _, _, diagonal in chunk_pairs(rank, source, cp, layout, causal=True)
    )


def shard_sequence(
    x: torch.Tensor, dim: int, group: dist.ProcessGroup | None, *, layout: str
) -> torch.Tensor:
    """This rank's shard of `x` (the whole sequence on every rank) along `dim`, cut as `layout` says.

    Use it on every per-token tensor of the model's input alike (token ids, labels, position ids, the rows
    of a rotary table indexed by position), so that a token keeps its position on whichever rank holds it.
    """
    cp, rank = _size_and_rank(group)
    chunks = chunk_count(cp, layout)
    if x.size(dim) % chunks:
        raise ValueError(
            f"shard_sequence: dim {dim} of size {x.size(dim)} does not cut into {chunks} equal chunks "
            f"({layout!r} layout over {cp} ranks): pad the sequence to a multiple of {chunks}"
        )
    pieces = x.chunk(chunks, dim)
    return torch.cat([pieces[i] for i in sequence_chunks(rank, cp, layout)], dim)


def unshard_sequence(
    x: torch.Tensor, dim: int, group: dist.ProcessGroup | None, *, layout: str
) -> torch.Tensor:
    """The whole sequence from every rank's shard `x` (the inverse of `shard_sequence`), on every rank.

    Not differentiable: it is for looking at outputs. A loss should be computed on the shards and its sum
    (or its token count and sum) reduced over the group.
    """
    cp, _ = _size_and_rank(group)
    gathered = [torch.empty_like(x) for _ in range(cp)]
    dist.all_gather(gathered, x.detach().contiguous(), group=group)
    per_rank = chunk_count(cp, layout) // cp
    pieces: dict[int, torch.Tensor] = {}
    for rank, shard in enumerate(gathered):
        for index, piece in zip(sequence_chunks(rank, cp, layout), shard.chunk(per_rank, dim), strict=True):
            pieces[index] = piece
    return torch.cat([pieces[i] for i in sorted(pieces)], dim)


def _check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"unknown sequence layout {layout!r}; known: {LAYOUTS}")


def _size_and_rank(group: dist.ProcessGroup | None) -> tuple[int, int]:
    """The size of `group` and this rank's index in it; None stands for no cp group (one rank)."""
    if group is None:
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


# ---- checks shared by both attentions -----------------------------------------------------------------


def check_attention_inputs(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, cp: int, layout: str, where: str
) -> tuple[int, int]:
    """Check this rank's shards of q, k, v; return (query heads, key/value heads).

    q is [batch, heads, seq / cp, head_dim]; k and v are [batch, kv_heads, seq / cp, head_dim] with kv_heads
    dividing heads (grouped-query attention). The shards' sizes must be the same on every rank (what
    `shard_sequence` gives); that is not checked here, as it would cost a collective per call.
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(
                f"{where}: {name} must be [batch, heads, seq / cp, head_dim], got shape {tuple(t.shape)}; "
                "move the head dim before the sequence dim (x.transpose(1, 2))"
            )
    if k.shape != v.shape:
        raise ValueError(f"{where}: k {tuple(k.shape)} and v {tuple(v.shape)} must have the same shape")
    if (q.size(0), q.size(3)) != (k.size(0), k.size(3)):
        raise ValueError(
            f"{where}: q {tuple(q.shape)} and k {tuple(k.shape)} differ in batch (dim 0) or head_dim (dim 3)"
        )
    if q.size(2) != k.size(2):
        raise ValueError(
            f"{where}: sequence shards differ: q holds {q.size(2)} positions (dim 2), k and v {k.size(2)}; "
            "cut q, k and v with the same shard_sequence call"
        )
    heads, kv_heads = q.size(1), k.size(1)
    if heads % kv_heads:
        raise ValueError(
            f"{where}: q has {heads} heads (dim 1), not a multiple of k and v's {kv_heads} heads: grouped-query "
            "attention needs kv_heads to divide heads"
        )
    per_rank = chunk_count(cp, layout) // cp
    if q.size(2) % per_rank:
        raise ValueError(
            f"{where}: the {layout!r} layout holds {per_rank} chunks per rank, but the sequence shard (dim 2) "
            f"has {q.size(2)} positions; cut the sequence with shard_sequence(..., layout={layout!r})"
        )
    return heads, kv_heads


def check_shards_agree(group: dist.ProcessGroup | None, where: str, **tensors: torch.Tensor) -> None:
    """Raise a `ValueError` on every rank when the ranks' `tensors` differ in shape.

    Costs one small all-gather (and, on a GPU, a wait for it): the attentions call it only when asked
    (`check_shards=True`), e.g. on the first step. Unchecked, shards of different sizes make the exchanges
    fail inside the communication library, which aborts the process instead of raising.
    """
    cp, _ = _size_and_rank(group)
    if cp == 1:
        return
    device = next(iter(tensors.values())).device
    shapes = torch.tensor(
        [size for t in tensors.values() for size in t.shape], dtype=torch.int64, device=device
    )
    gathered = [torch.empty_like(shapes) for _ in range(cp)]
    dist.all_gather(gathered, shapes, group=group)
    per_rank = [g.tolist() for g in gathered]
    if any(shape != per_rank[0] for shape in per_rank):
        names = ", ".join(tensors)
        listed = "; ".join(f"rank {r}: {_shapes(tensors, shape)}" for r, shape in enumerate(per_rank))
        raise ValueError(
            f"{where}: the ranks of the cp group hold shards of different shapes ({names}) -- {listed}; "
            "every rank needs the same number of positions: cut the whole sequence with shard_sequence"
        )


def _shapes(tensors: dict[str, torch.Tensor], flat: list[int]) -> str:
    parts, start = [], 0
    for name, t in tensors.items():
        parts.append(f"{name} {tuple(flat[start : start + t.dim()])}")
        start += t.dim()
    return " ".join(parts)


# ---- Ulysses --------------------------------------------------------------------------------------------


class _AllToAll(torch.autograd.Function):
    """All-to-all of a [cp, ...] buffer, row j to rank j; its backward is the same all-to-all of the
    gradient (with equal pieces the exchange is its own transpose)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:  # noqa: ANN001
        ctx.group = group
        return _all_to_all(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # noqa: ANN001
        return _all_to_all(grad, ctx.group), None


def _all_to_all(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    x = x.contiguous()
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group)
    return out


def _seq_to_heads(tensors: list[torch.Tensor], group: dist.ProcessGroup, cp: int) -> list[torch.Tensor]:
    """[b, h, s/cp, d] sequence shards -> [b, h/cp, s, d] head shards, all tensors in one all-to-all (one
    message per peer instead of three)."""
    rows = []
    for t in tensors:
        b, h, s, d = t.shape
        rows.append(t.reshape(b, cp, h // cp, s, d).transpose(0, 1).reshape(cp, -1))
    received = _AllToAll.apply(torch.cat(rows, dim=1), group)  # row j: rank j's sequence shard
    out, start = [], 0
    for t in tensors:
        b, h, s, d = t.shape
        width = b * (h // cp) * s * d
        piece = received[:, start : start + width].reshape(cp, b, h // cp, s, d)
        out.append(piece.permute(1, 2, 0, 3, 4).reshape(b, h // cp, cp * s, d))
        start += width
    return out


def _heads_to_seq(x: torch.Tensor, group: dist.ProcessGroup, cp: int) -> torch.Tensor:
    """[b, h/cp, s, d] head shards -> [b, h, s/cp, d] sequence shards."""
    b, h, s, d = x.shape
    rows = x.reshape(b, h, cp, s // cp, d).permute(2, 0, 1, 3, 4)  # row j: rank j's sequence shard
    received = _AllToAll.apply(rows.reshape(cp, -1), group)  # row j: rank j's heads
    return received.reshape(cp, b, h, s // cp, d).transpose(0, 1).reshape(b, cp * h, s // cp, d)


def _global_order(cp: int, layout: str) -> list[int]:
    """order[i]: which gathered chunk (rank-major, as the ranks hold them) is global chunk i."""
    held = [index for rank in range(cp) for index in sequence_chunks(rank, cp, layout)]
    return sorted(range(len(held)), key=held.__getitem__)


def _reorder_chunks(x: torch.Tensor, order: list[int]) -> torch.Tensor:
    """Chunks of dim 2 of `x` taken in `order`."""
    if order == sorted(order):
        return x
    pieces = x.chunk(len(order), dim=2)
    return torch.cat([pieces[i] for i in order], dim=2)


def ulysses_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group: dist.ProcessGroup | None,
    causal: bool,
    scale: float | None = None,
    layout: str = "contiguous",
    check_shards: bool = False,
) -> torch.Tensor:
    """Attention over the whole sequence from this rank's sequence shards, by head-cut all-to-alls.

    q: [batch, heads, seq / cp, head_dim]; k, v: [batch, kv_heads, seq / cp, head_dim], cut along the
    sequence by `shard_sequence(..., layout=layout)` over the cp `group` (None: one rank). Returns this rank's
    shard of the output, [batch, heads, seq / cp, head_dim], the same as cutting
    `F.scaled_dot_product_attention` on the whole sequence. Differentiable.

    Communication per call: forward one all-to-all of q, k and v together and one of the output; backward the
    same two (`loom.cost.context.ulysses_collectives`). cp must divide heads; when it does not divide
    kv_heads, k and v heads are repeated (to the least common multiple of kv_heads and cp) before sending.
    `check_shards`: first check that every rank's shards have the same shape (`check_shards_agree`).
    """
    cp, _ = _size_and_rank(group)
    heads, kv_heads = check_attention_inputs(q, k, v, cp=cp, layout=layout, where="ulysses_attention")
    if check_shards:
        check_shards_agree(group, "ulysses_attention", q=q, k=k, v=v)
    if heads % cp:
        raise ValueError(
            f"ulysses_attention: q has {heads} heads (dim 1), not divisible by the {cp} ranks of the cp group: "
            f"use a cp size dividing {heads}, or ring_attention, which takes any head count"
        )
    if cp == 1:
        return F.scaled_dot_product_attention(
            q, k, v, is_causal=causal, scale=scale, enable_gqa=heads != kv_heads
        )
    repeat = ulysses_kv_repeat(kv_heads, cp)
    if repeat > 1:  # every rank needs whole kv heads; repeat_interleave keeps query head h on kv head h // g
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
    q, k, v = _seq_to_heads([q, k, v], group, cp)
    order = _global_order(cp, layout)
    q, k, v = (_reorder_chunks(t, order) for t in (q, k, v))
    out = F.scaled_dot_product_attention(
        q, k, v, is_causal=causal, scale=scale, enable_gqa=q.size(1) != k.size(1)
    )
    inverse = sorted(range(len(order)), key=order.__getitem__)
    return _heads_to_seq(_reorder_chunks(out, inverse), group, cp)


def ulysses_kv_repeat(kv_heads: int, cp: int) -> int:
    """How many times Ulysses repeats each key/value head so that cp divides their count."""
    return cp // math.gcd(kv_heads, cp)
