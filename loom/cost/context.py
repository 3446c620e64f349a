"""The collectives and compute of one context-parallel attention call (`loom.parallel.context`, `.ring`).

Per rank and per call, for q [batch, heads, seq / cp, head_dim] and k, v [batch, kv_heads, seq / cp,
head_dim] over a cp group, with `loom.dist.comm`'s byte convention (all-to-all: the rank's send buffer;
send and receive: the buffer):

- Ulysses: forward one all-to-all of q, k and v together (k and v with their heads repeated up to the least
  common multiple of kv_heads and cp) and one of the output; backward the same two, transposed. Bytes per
  rank are the rank's shards, which shrink as 1 / cp.
- Ring: forward cp - 1 exchanges (a send to the next rank and a receive from the previous one) of the
  rank's keys and values; backward cp - 1 such exchanges again, and cp of their fp32 gradients (the last
  brings each block's gradients home). Bytes per rank stay near the whole sequence's keys and values
  ((cp - 1) blocks of seq / cp) whatever cp is.
- Megatron's p2p ("megatron_p2p", Transformer Engine's `AttnFuncWithCPAndKVP2P`): forward as the ring;
  backward cp exchanges of one double buffer in the training dtype, keys and values stacked with their
  gradients so far: the first sends the keys and values alone, the last the gradients alone (home), the
  cp - 2 between both. Each exchange starts before a step's block and is waited on before the next, as the
  forward's.

`communication_time` prices the lists; `exposed_time` prices what of one phase's list the attention's own
compute leaves uncovered (the simulator charges that per layer); `attention_flops` gives the busiest rank's matmul work, which the
causal mask makes uneven on the contiguous cut. Entries are `loom.cost.traffic.StepCollective`s over axis
"cp", so `loom.cost.traffic.summary` and `CollectiveRecorder.summary(mesh_axes(...))` compare directly.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from loom.cost.collectives import GroupSpan, collective_time
from loom.cost.hardware import Cluster
from loom.cost.traffic import StepCollective

__all__ = [
    "BACKWARD_FLOPS_PER_SCORE",
    "FORWARD_FLOPS_PER_SCORE",
    "GRAD_BYTES",
    "RING_GRADS",
    "RING_KV",
    "attention_flops",
    "communication_time",
    "exposed_time",
    "megatron_p2p_collectives",
    "ring_collectives",
    "ulysses_collectives",
]

CP = "cp"
RING_KV, RING_GRADS = "ring k,v", "ring grad k,v"  # the sources of ring attention's two kinds of exchange
P2P_KV_GRADS = "p2p k,v+grad"  # Megatron p2p's backward exchanges: keys, values and their gradients
HIDDEN_SOURCES = (RING_KV, P2P_KV_GRADS)  # exchanges that run beside one ring step's block
GRAD_BYTES = 4  # ring attention sums key/value gradients in fp32 buffers, which travel as they are
# per score (one query head, one query, one key), in units of head_dim: forward q.k and p.v (2 each);
# backward recomputes q.k, then dv, dp, dq and dk (as flash attention's backward does)
FORWARD_FLOPS_PER_SCORE, BACKWARD_FLOPS_PER_SCORE = 4, 10


def _check(batch: int, seq: int, heads: int, kv_heads: int, head_dim: int, cp: int) -> int:
    """Positions per rank, after checking the sizes."""
    if min(batch, seq, heads, kv_heads, head_dim, cp) < 1:
        raise ValueError("context attention sizes must be >= 1")
    if seq % cp:
        raise ValueError(f"seq {seq} does not cut into {cp} equal shards")
    if heads % kv_heads:
        raise ValueError(f"kv_heads {kv_heads} must divide heads {heads}")
    return seq // cp


def ulysses_collectives(
    *, batch: int, seq: int, heads: int, kv_heads: int, head_dim: int, cp: int, dtype_bytes: int
) -> list[StepCollective]:
    """The all-to-alls of one `ulysses_attention` call, forward and backward (none for cp = 1)."""
    local = _check(batch, seq, heads, kv_heads, head_dim, cp)
    if cp == 1:
        return []
    if heads % cp:
        raise ValueError(f"Ulysses needs cp {cp} to divide heads {heads}")
    sent_kv_heads = math.lcm(kv_heads, cp)
    token = batch * local * head_dim * dtype_bytes  # bytes of one head over the rank's positions
    qkv = (heads + 2 * sent_kv_heads) * token
    out = heads * token
    return [
        StepCollective(
            kind="all_to_all", axis=CP, nbytes=qkv, count=1, phase="forward", source="ulysses q,k,v"
        ),
        StepCollective(
            kind="all_to_all", axis=CP, nbytes=out, count=1, phase="forward", source="ulysses out"
        ),
        StepCollective(
            kind="all_to_all", axis=CP, nbytes=out, count=1, phase="backward", source="ulysses grad out"
        ),
        StepCollective(
            kind="all_to_all", axis=CP, nbytes=qkv, count=1, phase="backward", source="ulysses grad q,k,v"
        ),
    ]


def ring_collectives(
    *, batch: int, seq: int, heads: int, kv_heads: int, head_dim: int, cp: int, dtype_bytes: int
) -> list[StepCollective]:
    """The sends and receives of one `ring_attention` call, forward and backward (none for cp = 1)."""
    local = _check(batch, seq, heads, kv_heads, head_dim, cp)
    if cp == 1:
        return []
    elements = 2 * batch * kv_heads * local * head_dim  # keys and values, one message
    kv, grads = elements * dtype_bytes, elements * GRAD_BYTES
    out = []
    for kind in ("send", "recv"):
        out += [
            StepCollective(kind=kind, axis=CP, nbytes=kv, count=cp - 1, phase="forward", source=RING_KV),
            StepCollective(kind=kind, axis=CP, nbytes=kv, count=cp - 1, phase="backward", source=RING_KV),
            StepCollective(kind=kind, axis=CP, nbytes=grads, count=cp, phase="backward", source=RING_GRADS),
        ]
    return out


def megatron_p2p_collectives(
    *, batch: int, seq: int, heads: int, kv_heads: int, head_dim: int, cp: int, dtype_bytes: int
) -> list[StepCollective]:
    """The sends and receives of one Megatron-Core p2p context-parallel attention call (Transformer Engine's
    `AttnFuncWithCPAndKVP2P`), forward and backward (none for cp = 1). Forward: cp - 1 exchanges of the
    rank's keys and values, as the ring. Backward: cp exchanges of a buffer in the training dtype
    (`p2p_comm_buffers`, `torch.empty((2, *kv.shape), dtype=kv.dtype)`): step 0 sends the keys and values,
    steps 1 to cp - 2 keys, values and their gradients so far, step cp - 1 the gradients alone, so
    2 (cp - 1) blocks in all."""
    local = _check(batch, seq, heads, kv_heads, head_dim, cp)
    if cp == 1:
        return []
    kv = 2 * batch * kv_heads * local * head_dim * dtype_bytes
    out = []
    for kind in ("send", "recv"):
        out += [
            StepCollective(kind=kind, axis=CP, nbytes=kv, count=cp - 1, phase="forward", source=RING_KV),
            StepCollective(kind=kind, axis=CP, nbytes=kv, count=2, phase="backward", source=P2P_KV_GRADS),
        ]
        if cp > 2:
            out.append(
                StepCollective(
                    kind=kind, axis=CP, nbytes=2 * kv, count=cp - 2, phase="backward", source=P2P_KV_GRADS
                )
            )
    return out


def communication_time(collectives: Iterable[StepCollective], span: GroupSpan, cluster: Cluster) -> float:
    """Seconds of communication of `collectives` on a cp group placed as `span`, none of it hidden behind
    compute (ring attention overlaps its key/value exchanges with the blocks' attention; this is the upper
    bound). An exchange is priced once, as a send/receive: each rank sends to its successor while it
    receives from its predecessor, so every link carries one message at a time."""
    return sum(c.count * _priced(c, span, cluster) for c in collectives)


def exposed_time(
    collectives: Iterable[StepCollective], span: GroupSpan, cluster: Cluster, *, phase: str, step_s: float
) -> float:
    """Seconds of `phase`'s communication in `collectives` that compute leaves exposed on one rank, when
    one ring step's block of attention takes `step_s`. Ulysses' all-to-alls are waited on where they are
    issued: wholly exposed. Ring attention starts each key/value exchange before computing a step's block
    and waits for it after (`loom.parallel.ring`): hidden up to `step_s`, the remainder exposed; the
    gradients' exchanges are waited on as soon as they start: exposed. Megatron's p2p backward exchanges
    (keys, values and gradients) run beside a step's block as the forward's do: hidden up to `step_s`. With `step_s = 0` the sum over both
    phases is `communication_time`."""
    seconds = 0.0
    for c in collectives:
        if c.phase == phase:
            hidden = step_s if c.source in HIDDEN_SOURCES else 0.0
            seconds += c.count * max(0.0, _priced(c, span, cluster) - hidden)
    return seconds


def _priced(c: StepCollective, span: GroupSpan, cluster: Cluster) -> float:
    """Seconds of one of `c`'s calls; a receive is free, the other half of an exchange priced with its send."""
    if c.kind == "recv":
        return 0.0
    kind = "send_recv" if c.kind == "send" else c.kind
    return collective_time(kind, c.nbytes, span, cluster)


def attention_flops(
    *, batch: int, seq: int, heads: int, head_dim: int, cp: int, kind: str, layout: str, causal: bool
) -> tuple[float, float]:
    """Matmul FLOPs of one attention call on the busiest rank of the cp group: (forward, backward).

    Ulysses ("ulysses") attends whole sequences for heads / cp heads on every rank. Ring attention ("ring")
    attends the rank's queries to every key block; under a causal mask it skips the chunk pairs the mask hides
    and half-computes those on its diagonal, so the busiest rank of the "contiguous" cut (the last) does
    (2 cp - 1) / cp times the average, and every rank of the "head_tail" cut the average.
    """
    _check(batch, seq, heads, heads, head_dim, cp)
    if kind == "ulysses":
        scores = heads / cp * seq * seq * (0.5 if causal else 1.0)
    elif kind == "ring" and not causal:
        scores = heads * seq / cp * seq
    elif kind == "ring" and layout == "contiguous":
        scores = heads * (2 * cp - 1) * (seq / cp) ** 2 / 2  # r whole chunks and half its own, r = cp - 1
    elif kind == "ring" and layout == "head_tail":
        scores = heads * seq * seq / (2 * cp)
    else:
        raise ValueError(
            f"unknown attention {kind!r} or layout {layout!r}: ulysses or ring, contiguous or head_tail"
        )
    per_score = batch * head_dim * scores
    return FORWARD_FLOPS_PER_SCORE * per_score, BACKWARD_FLOPS_PER_SCORE * per_score
