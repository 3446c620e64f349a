"""The consistency check: ranks that must agree compare fingerprints, so that nothing goes wrong in silence.

loom's global semantics rest on promises the ranks cannot see broken on their own: every rank gives an
operator the same strategy, and a plain tensor taken as a global tensor is the same on every rank (with
`full_batch=True`, the whole batch; in `semi_auto`, the local batch on the ranks that read the same rows).
When a promise is broken the collectives still run and the result is garbage. So loom fingerprints what must
agree (a strategy's compiled layouts as text, a tensor's shape, dtype and bytes) and gathers one small vector
per rank: `[key, count, digest, peer count, peer digest]`, five int64 (40 bytes) per rank, one all-gather per
check, whatever the number of tensors and operators checked. Only when the vectors differ (the error path)
do the ranks exchange their descriptions, to name what differs and which ranks disagree.

When (see docs/consistency.md): on the first call of each `loom.ops` primitive and `loom.shard` function or
module, once when `loom.parallelize(mode="semi_auto")` lays out a model, and on that model's first forward;
`LOOM_CHECK=1` checks every call, `LOOM_CHECK=0` never. The check's collective runs outside any
`TorchDispatchMode`, so a `CommDebugMode` counts only the computation's own collectives; `stats()` counts
the checks.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from loom.dist._torch_private import without_dispatch_modes
from loom.dist.mesh import Mesh

ENV = "LOOM_CHECK"
HOW_TO_TURN_OFF = f"{ENV}=0 turns this check off, {ENV}=1 checks every call"
_MASK = (1 << 63) - 1
_CHUNK = 1 << 22  # 16-bit words per chunk: weighted sums stay below 2**53, exact in int64
_stats = {"checks": 0, "bytes_sent": 0, "bytes_received": 0, "tensors": 0, "tensor_bytes": 0}


def setting() -> str:
    """`"first"` (the default: first call of each operator, first forward of each model), `"always"`
    (`LOOM_CHECK=1`) or `"off"` (`LOOM_CHECK=0`)."""
    value = os.environ.get(ENV, "").strip().lower()
    if value in ("", "first"):
        return "first"
    if value in ("1", "always", "true", "on"):
        return "always"
    if value in ("0", "off", "false", "never"):
        return "off"
    raise ValueError(
        f"{ENV}={os.environ[ENV]!r} is not a setting: use {ENV}=1 (check every call), {ENV}=0 (never) or "
        f"leave it unset (check the first call of each operator and the first forward of each model)"
    )


def stats() -> dict[str, int]:
    """What the checks of this process cost so far: checks (= all-gathers), bytes sent and received by them,
    tensors fingerprinted and their bytes."""
    return dict(_stats)


@dataclass
class FirstCall:
    """Whether a check is due for one operator instance, function or model (first call, or every call)."""

    done: bool = False

    def due(self) -> bool:
        mode = setting()
        return mode == "always" or (mode == "first" and not self.done)


@dataclass(frozen=True)
class Claim:
    """One thing the ranks must agree on: `what` names it, `digest` fingerprints it, `detail()` describes
    this rank's version (called on the error path only), `fix` says what to do. `peers`: only the ranks
    that read the same rows of the batch must agree (a local batch), not every rank."""

    what: str
    digest: int
    detail: Callable[[], str]
    fix: str
    peers: bool = False


def text_digest(text: str) -> int:
    """A 63-bit fingerprint of a string."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") & _MASK


def tensor_digest(tensor: torch.Tensor) -> int:
    """A 63-bit fingerprint of a tensor's shape, dtype and bytes, computed where the tensor is.

    Its bytes are read as 16-bit words, each weighted by two position-dependent weights and summed in int64
    (exact: no overflow), per chunk; the chunks' sums are hashed. A changed, inserted or swapped value changes
    it (an accident, not an attacker, is what this guards against)."""
    t = tensor.detach()
    head = f"{tuple(t.shape)}|{t.dtype}"
    _stats["tensors"] += 1
    if t.numel() == 0:
        return text_digest(head)
    data = t.contiguous().reshape(-1)
    if data.is_complex():
        data = torch.view_as_real(data).reshape(-1)
    data = data.view(torch.uint8)
    _stats["tensor_bytes"] += data.numel()
    if data.numel() % 2:
        data = torch.cat([data, data.new_zeros(1)])
    words = data.view(torch.int16)
    sums = []
    for start in range(0, words.numel(), _CHUNK):
        chunk = words[start : start + _CHUNK].to(torch.int64)
        position = torch.arange(chunk.numel(), device=chunk.device, dtype=torch.int64)
        sums.append((chunk * (position % 65521 + 1)).sum())
        sums.append((chunk * ((position * 7919) % 65519 + 1)).sum())
    values = torch.stack(sums).tolist()
    return text_digest(head + "|" + ",".join(map(str, values)))


def describe_tensor(tensor: torch.Tensor) -> str:
    """Shape, dtype, fingerprint and first values (for the error message)."""
    t = tensor.detach()
    first = t.reshape(-1)[:3].tolist() if t.numel() else []
    if t.is_floating_point():
        first = [round(v, 4) for v in first]
    more = ", ..." if t.numel() > 3 else ""
    return (
        f"shape {tuple(t.shape)} {str(t.dtype).removeprefix('torch.')} starting "
        f"{str(first)[:-1]}{more}] (fingerprint {tensor_digest(t):016x})"
    )


def tensor_claim(what: str, tensor: torch.Tensor, fix: str, peers: bool = False) -> Claim:
    """A plain tensor that must be the same on the ranks that agree."""
    return Claim(what, tensor_digest(tensor), lambda: describe_tensor(tensor), fix, peers)


def text_claim(what: str, text: str, fix: str) -> Claim:
    """A description (a strategy, a plan) that every rank must give alike."""
    return Claim(what, text_digest(text), lambda: text, fix)


REPLICATED_FIX = (
    "a plain tensor is taken as the same global tensor on every rank: create it the same way everywhere "
    "(seed with torch.manual_seed(n) before drawing it, or dist.broadcast it from rank 0), or pass each "
    "rank's part as a DTensor"
)
STRATEGY_FIX = (
    "every rank must give the operator the same strategy: compute strategies from values every rank "
    "shares (the mesh sizes), never from the rank itself"
)


def checkable(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether a check can run now: not while tracing (meta or fake tensors, torch.compile), and only on
    dense tensors (a sparse or quantized input is not fingerprinted)."""
    if torch.compiler.is_compiling():
        return False
    return not any(
        t.is_meta or type(t).__name__ == "FakeTensor" or t.layout != torch.strided or t.is_quantized
        for t in tensors
    )


# A parallelized model's forward collects the claims of the operators it runs into one check at its end.
@dataclass
class Scope:
    """Inside a parallelized model's forward: `collect` (its first forward) gathers the operators' claims
    for the model's one check; otherwise the operators inside skip their own (the model checked them)."""

    collect: bool
    claims: list[Claim] = field(default_factory=list)


_scope: ContextVar[Scope | None] = ContextVar("loom_consistency_scope", default=None)


def current_scope() -> Scope | None:
    return _scope.get()


def enter_scope(collect: bool) -> tuple[Scope, object]:
    """`scope` for hooks that open and close it in two calls: returns the scope and a token for
    `exit_scope`."""
    value = Scope(collect)
    return value, _scope.set(value)


def exit_scope(token: object) -> None:
    _scope.reset(token)  # type: ignore[arg-type]


def mesh_group(mesh: Mesh) -> tuple[dist.ProcessGroup, str]:
    """The process group of all the ranks of `mesh`, and the device type its collectives use."""
    return mesh.sub_mesh(tuple(range(mesh.ndim))).get_group(), mesh.device_mesh.device_type


def submit(claims: Sequence[Claim], mesh: Mesh, context: str) -> None:
    """Check `claims` now on every rank of `mesh`, or hand them to the enclosing model's first forward (one
    check for all its operators)."""
    current = _scope.get()
    if current is not None:
        if current.collect:
            current.claims.extend(claims)
        return
    group, device = mesh_group(mesh)
    agree(claims, group, context, device=device)


def agree(
    claims: Sequence[Claim],
    group: dist.ProcessGroup | None,
    context: str,
    *,
    key: int = 0,
    device: str = "cpu",
) -> None:
    """Every rank of `group` must hold the same claims (those with `peers`: the ranks with the same `key`),
    or every rank raises a ValueError naming the first claim that differs and the ranks on each side.

    A collective: every rank of `group` calls it, in the same order. One all-gather of 40 bytes per rank.
    """
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return
    everyone = [c for c in claims if not c.peers]
    peers = [c for c in claims if c.peers]
    vector = torch.tensor(
        [key, len(everyone), _combined(everyone), len(peers), _combined(peers)], dtype=torch.int64, device=device
    )
    size = dist.get_world_size(group)
    gathered = [torch.empty_like(vector) for _ in range(size)]
    with without_dispatch_modes():
        dist.all_gather(gathered, vector, group=group)
    _stats["checks"] += 1
    _stats["bytes_sent"] += vector.numel() * 8
    _stats["bytes_received"] += vector.numel() * 8 * size
    rows = [row.tolist() for row in gathered]
    same_all = all(row[1:3] == rows[0][1:3] for row in rows)
    by_key: dict[int, list[int]] = {}
    for row in rows:
        by_key.setdefault(row[0], row[3:5])
    same_peers = all(row[3:5] == by_key[row[0]] for row in rows)
    if same_all and same_peers:
        return
    _refuse(claims, group, context, [row[0] for row in rows], device)


def _combined(claims: Sequence[Claim]) -> int:
    return text_digest("\n".join(f"{c.what}\t{c.digest}" for c in claims))


def _refuse(claims: Sequence[Claim], group: dist.ProcessGroup | None, context: str, keys: list[int], device: str):
    """The error path: the ranks exchange their claims' descriptions and raise the same error everywhere."""
    mine = [[c.what, c.digest, c.detail(), c.fix, c.peers] for c in claims]
    every = _all_gather_json(mine, group, device)
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
    names = list(dict.fromkeys(entry[0] for rank_claims in every for entry in rank_claims))
    for name in names:
        versions = [next((e for e in rank_claims if e[0] == name), None) for rank_claims in every]
        known = next(v for v in versions if v is not None)
        classes = [keys[i] if known[4] else 0 for i in range(len(ranks))]
        for cls in dict.fromkeys(classes):
            members = [i for i, c in enumerate(classes) if c == cls]
            digests = {None if versions[i] is None else versions[i][1] for i in members}
            if len(digests) > 1:
                raise ValueError(_message(context, name, known, [(ranks[i], versions[i]) for i in members]))
    raise ValueError(
        f"loom consistency check ({context}): the ranks hold different checks (a different number of operators "
        f"or tensors); every rank must run the same code on the same kinds of inputs ({HOW_TO_TURN_OFF})"
    )


def _message(context: str, name: str, known: list, members: list[tuple[int, list | None]]) -> str:
    sides: dict[object, list[int]] = {}
    detail: dict[object, str] = {}
    for rank, version in members:
        digest = None if version is None else version[1]
        sides.setdefault(digest, []).append(rank)
        detail[digest] = "nothing (no such call)" if version is None else version[2]
    parts = "; ".join(
        f"rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))}: {detail[d]}" for d, r in sides.items()
    )
    who = "ranks that read the same rows of the batch (they must agree)" if known[4] else "ranks that must agree"
    return (
        f"loom consistency check ({context}): {name} differs across {who}: {parts}. "
        f"{known[3][:1].upper()}{known[3][1:]} ({HOW_TO_TURN_OFF})"
    )


def _all_gather_json(value: object, group: dist.ProcessGroup | None, device: str) -> list:
    """Every rank's JSON-able `value` (no pickle: the ranks exchange text only)."""
    data = torch.tensor(list(json.dumps(value).encode()), dtype=torch.uint8, device=device)
    size = dist.get_world_size(group)
    length = torch.tensor([data.numel()], dtype=torch.int64, device=device)
    lengths = [torch.empty_like(length) for _ in range(size)]
    with without_dispatch_modes():
        dist.all_gather(lengths, length, group=group)
        longest = max(int(n) for n in lengths)
        padded = torch.zeros(longest, dtype=torch.uint8, device=device)
        padded[: data.numel()] = data
        gathered = [torch.empty_like(padded) for _ in range(size)]
        dist.all_gather(gathered, padded, group=group)
    return [json.loads(bytes(g[: int(n)].tolist()).decode()) for g, n in zip(gathered, lengths, strict=True)]
