"""Ring attention: key/value blocks travel around the ranks of a `cp` group, partials merge by log-sum-exp.

At step s (0 <= s < cp) rank r holds the key/value block of rank (r - s) mod cp; while it attends to that
block it already sends it to rank r + 1 and receives the next one from rank r - 1, so the forward makes
cp - 1 exchanges. Attention to each block is computed in fp32 with explicit matmuls and its log-sum-exp,
and the running output is rescaled as blocks arrive (the merge of flash attention), so no rank ever holds
more than two key/value blocks.

The backward (a custom `torch.autograd.Function`, as flash attention's) recomputes the probabilities of each
block from the saved log-sum-exp, rotating the key/value blocks around the ring again (cp - 1 exchanges);
the gradients of a block's keys and values are summed in an fp32 buffer that travels with the block and
reaches its owner after cp exchanges.

Under a causal mask the work is balanced by the "head_tail" layout (`loom.parallel.context`): every rank
holds an early and a late chunk, and chunk pairs that the mask hides entirely are skipped, not computed.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from loom.parallel.context import (
    _size_and_rank,
    check_attention_inputs,
    check_shards_agree,
    chunk_pairs,
    sequence_chunks,
)

__all__ = ["ring_attention"]


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group: dist.ProcessGroup | None,
    causal: bool,
    scale: float | None = None,
    layout: str = "head_tail",
    check_shards: bool = False,
    tile: int = 512,
) -> torch.Tensor:
    """Attention over the whole sequence from this rank's sequence shards, by rotating key/value blocks.

    q: [batch, heads, seq / cp, head_dim]; k, v: [batch, kv_heads, seq / cp, head_dim] (kv_heads dividing
    heads: grouped-query attention, only kv_heads travel), cut along the sequence by
    `shard_sequence(..., layout=layout)` over the cp `group` (None: one rank). Returns this rank's shard of
    the output, equal to cutting `F.scaled_dot_product_attention` on the whole sequence. Differentiable.

    Communication per call (`loom.cost.context.ring_collectives`): forward cp - 1 exchanges (one send and one
    receive each) of k and v together; backward cp - 1 such exchanges and cp of their fp32 gradients.
    `check_shards`: first check that every rank's shards have the same shape (`check_shards_agree`).
    `tile`: query rows whose scores are held at once; a block costs tile x (chunk of keys) scores per query
    head of memory, not chunk x chunk.
    """
    cp, _ = _size_and_rank(group)
    check_attention_inputs(q, k, v, cp=cp, layout=layout, where="ring_attention")
    if tile < 1:
        raise ValueError(f"ring_attention: tile must be a positive number of query rows, got {tile}")
    if check_shards:
        check_shards_agree(group, "ring_attention", q=q, k=k, v=v)
    scale = q.size(-1) ** -0.5 if scale is None else float(scale)
    return _RingAttention.apply(q, k, v, group, causal, scale, layout, tile)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, causal, scale, layout, tile):  # noqa: ANN001, ANN205
        ring = _Ring(group, causal, layout, q.size(2), tile)
        grouped_q = _grouped(q.float(), k.size(1))
        kv = torch.stack([k, v])  # keys and values: one message per exchange
        outs: list = [None] * ring.per_rank
        lses: list = [None] * ring.per_rank
        for step in range(ring.size):
            pending = ring.start(kv) if step < ring.size - 1 else None
            for pair in ring.pairs(step):
                block_out, block_lse = _block_forward(
                    grouped_q[..., ring.rows(pair.q), :],
                    *ring.keys(kv, pair.k),
                    pair.diagonal,
                    scale,
                    ring.tile,
                )
                outs[pair.q], lses[pair.q] = _merge(outs[pair.q], lses[pair.q], block_out, block_lse)
            if pending is not None:
                kv = ring.finish(pending)
        out, lse = torch.cat(outs, dim=-2), torch.cat(lses, dim=-1)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring, ctx.scale = ring, scale
        return out.reshape(q.shape).to(q.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):  # noqa: ANN001, ANN205
        q, k, v, out, lse = ctx.saved_tensors
        ring, scale = ctx.ring, ctx.scale
        grouped_q = _grouped(q.float(), k.size(1))
        grad_out = _grouped(grad_out.float(), k.size(1))
        delta = (grad_out * out).sum(-1)  # rowsum(dO * O), the softmax backward's correction
        grad_q = torch.zeros_like(grouped_q)
        kv = torch.stack([k, v])
        grad_kv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
        for step in range(ring.size):
            pending = ring.start(kv) if step < ring.size - 1 else None
            for pair in ring.pairs(step):
                rows, keys = ring.rows(pair.q), ring.rows(pair.k)
                dq, dk, dv = _block_backward(
                    grouped_q[..., rows, :], *ring.keys(kv, pair.k), grad_out[..., rows, :], lse[..., rows],
                    delta[..., rows], pair.diagonal, scale, ring.tile,
                )  # fmt: skip
                grad_q[..., rows, :] += dq
                grad_kv[0, :, :, keys] += dk
                grad_kv[1, :, :, keys] += dv
            if pending is not None:
                kv = ring.finish(pending)
            if ring.size > 1:  # the buffer follows its block around; the last exchange brings it home
                grad_kv = ring.finish(ring.start(grad_kv))
        grad_q = grad_q.reshape(q.shape).to(q.dtype)
        return grad_q, grad_kv[0].to(k.dtype), grad_kv[1].to(v.dtype), None, None, None, None, None


class _Pair(NamedTuple):
    """A (query chunk, key chunk) pair of one step, by local chunk index; `diagonal`: the same global chunk,
    which the causal mask cuts along its diagonal (other computed pairs it leaves whole)."""

    q: int
    k: int
    diagonal: bool


class _Ring:
    """The cp group as a ring: the exchanges with the neighbours, and the chunk pairs each step computes."""

    def __init__(
        self, group: dist.ProcessGroup | None, causal: bool, layout: str, length: int, tile: int
    ) -> None:
        self.group, self.causal, self.layout, self.tile = group, causal, layout, tile
        self.size, self.rank = _size_and_rank(group)
        self.per_rank = len(sequence_chunks(0, self.size, layout))
        self.chunk = length // self.per_rank  # positions per chunk

    def pairs(self, step: int) -> list[_Pair]:
        """The chunk pairs to compute at `step`: all of them, or under a causal mask those it does not hide."""
        source = (self.rank - step) % self.size
        return [
            _Pair(*pair)
            for pair in chunk_pairs(self.rank, source, self.size, self.layout, causal=self.causal)
        ]

    def rows(self, chunk: int) -> slice:
        """The positions of local chunk `chunk` in a shard."""
        return slice(chunk * self.chunk, (chunk + 1) * self.chunk)

    def keys(self, kv: torch.Tensor, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of local chunk `chunk` of a [2, b, kv_heads, s, d] block, in fp32, shaped
        [b, kv_heads, 1, chunk, d] to broadcast over each key/value head's query heads."""
        piece = kv[:, :, :, None, self.rows(chunk)].float()
        return piece[0], piece[1]

    def start(self, buffer: torch.Tensor) -> tuple[torch.Tensor, list]:
        """Send `buffer` to the next rank and receive the previous rank's; (receive buffer, works)."""
        received = torch.empty_like(buffer)
        ops = [
            dist.P2POp(dist.isend, buffer, group=self.group, group_peer=(self.rank + 1) % self.size),
            dist.P2POp(dist.irecv, received, group=self.group, group_peer=(self.rank - 1) % self.size),
        ]
        return received, dist.batch_isend_irecv(ops)

    @staticmethod
    def finish(pending: tuple[torch.Tensor, list]) -> torch.Tensor:
        """Wait for an exchange that `start` began; the received buffer."""
        received, works = pending
        for work in works:
            work.wait()
        return received


def _grouped(x: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[b, h, s, d] -> [b, kv_heads, h / kv_heads, s, d]: query head i uses key/value head i // (h / kv)."""
    b, h, s, d = x.shape
    return x.reshape(b, kv_heads, h // kv_heads, s, d)


def _scores(q: torch.Tensor, k: torch.Tensor, first_row: int | None, scale: float) -> torch.Tensor:
    """Scaled scores of query rows against a key chunk. `first_row`: None for a pair the mask leaves whole;
    for a query chunk against itself, the index in the chunk of the first query row (row i sees keys 0..i)."""
    scores = (q * scale) @ k.transpose(-1, -2)
    if first_row is not None:
        hidden = torch.ones(scores.shape[-2:], dtype=torch.bool, device=scores.device).triu(1 + first_row)
        scores.masked_fill_(hidden, float("-inf"))
    return scores


def _tiles(length: int, diagonal: bool, tile: int):  # noqa: ANN202
    """(query rows, keys they see, index of the first row if the pair is on the diagonal, else None) per
    `tile` query rows. On the diagonal, rows up to i see keys up to i only: the keys past the tile's last row
    are neither computed nor masked."""
    for start in range(0, length, tile):
        stop = min(start + tile, length)
        yield slice(start, stop), slice(0, stop if diagonal else length), start if diagonal else None


def _block_forward(q, k, v, diagonal: bool, scale: float, tile: int) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: ANN001
    """Attention of a query chunk to one key chunk: (output, log-sum-exp of the scores per query)."""
    outs, lses = [], []
    for rows, keys, first_row in _tiles(q.size(-2), diagonal, tile):
        scores = _scores(q[..., rows, :], k[..., keys, :], first_row, scale)
        lse = torch.logsumexp(scores, dim=-1)
        outs.append(scores.sub_(lse.unsqueeze(-1)).exp_() @ v[..., keys, :])
        lses.append(lse)
    return torch.cat(outs, dim=-2), torch.cat(lses, dim=-1)


def _merge(out, lse, block_out: torch.Tensor, block_lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: ANN001
    """The attention over the union of two disjoint key sets from each one's output and log-sum-exp."""
    if out is None:
        return block_out, block_lse
    merged = torch.logaddexp(lse, block_lse)
    return (
        out * torch.exp(lse - merged).unsqueeze(-1) + block_out * torch.exp(block_lse - merged).unsqueeze(-1),
        merged,
    )


def _block_backward(q, k, v, grad_out, lse, delta, diagonal: bool, scale: float, tile: int):  # noqa: ANN001, ANN202
    """Gradients of q, k, v from one block, its probabilities recomputed from the final log-sum-exp."""
    grad_q = torch.empty_like(q)
    grad_k = torch.zeros(k.shape[:2] + k.shape[3:], dtype=k.dtype, device=k.device)
    grad_v = torch.zeros_like(grad_k)
    for rows, keys, first_row in _tiles(q.size(-2), diagonal, tile):
        k_tile, v_tile, out_tile = k[..., keys, :], v[..., keys, :], grad_out[..., rows, :]
        probs = _scores(q[..., rows, :], k_tile, first_row, scale).sub_(lse[..., rows, None]).exp_()
        # summed over the query heads that share a key/value head
        grad_v[..., keys, :] += (probs.transpose(-1, -2) @ out_tile).sum(2)
        grad_scores = (out_tile @ v_tile.transpose(-1, -2)).sub_(delta[..., rows, None]).mul_(probs)
        grad_q[..., rows, :] = (grad_scores @ k_tile) * scale
        grad_k[..., keys, :] += (grad_scores.transpose(-1, -2) @ q[..., rows, :]).sum(2) * scale
    return grad_q, grad_k, grad_v
