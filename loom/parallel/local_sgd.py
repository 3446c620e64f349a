"""Training over slow links: replicas that step alone and meet every `sync_every` steps.

    inner = torch.optim.AdamW(model.parameters(), lr=3e-4)
    optimizer = DiLoCo(model.parameters(), inner, sync_every=50, group=replicas)   # or LocalSGD(...)
    for batch in data:                      # each replica its own batches; gradients are NOT synchronised
        model(*batch).backward()
        optimizer.step()                    # an inner step; every 50th also an outer step over `group`
        optimizer.zero_grad()
    optimizer.finish()                      # averages still in flight (fragment_delay > 0) land now

They are not `torch.optim.Optimizer`s: schedule the inner learning rate on `optimizer.inner`
(`LambdaLR(optimizer.inner, ...)`).

- **LocalSGD**: every `sync_every` inner steps the replicas replace their parameters by the average (one
  all-reduce of the parameters' bytes).
- **DiLoCo** (Douillard et al. 2023): each replica keeps the global weights of the last sync; at a sync
  the pseudo-gradient `global - local` is averaged over the replicas and fed to an outer optimizer (SGD with
  Nesterov momentum by default) that updates the global weights, which every replica then copies. With
  outer SGD at lr 1 and no momentum this is LocalSGD; with `sync_every = 1`, inner SGD and that outer step
  it is synchronous data parallelism.
- **Streaming** (`fragments = F`): the parameters are cut into F fragments of about equal bytes, in
  parameter order; fragment f meets at the inner steps `s` with `s % sync_every == (f + 1) * sync_every // F
  % sync_every`, so each fragment still syncs once per `sync_every` steps (the last one at the multiples of
  `sync_every`) and a sync moves 1/F of the bytes. With `fragment_delay = d > 0`
  the average is started asynchronously and applied `d` inner steps later, overlapped with them; the
  replica then mixes: `local = mix * local_now + (1 - mix) * global_new` (Streaming DiLoCo's alpha).
- `outer_dtype = torch.bfloat16` sends pseudo-gradients in bf16 (half the bytes); the outer step and the
  global weights stay fp32.

Replicas that come and go (`group` a `loom.dist.elastic.Membership`, replicas of one process): each sync
is a meeting of the replicas alive then, whose average divides by those that trained since the last sync;
a replacement replica enters with `join`, contributes nothing to its first sync, and takes the global
state of the lowest replica that trained (LocalSGD: the average; DiLoCo: the global weights and the outer
optimizer's state before the outer step, which it then takes as every replica does), with its inner
optimizer fresh. DiLoCo's fragments and delays are not elastic yet (one fragment, no delay).

Parameters may be DTensors (a replica sharded by tp): every operation here works on each rank's local
shard, so the sharding must be the same in every replica (rank r of each replica holds the same slice).
An inner optimizer that holds its own chunks of the parameters (`loom.parallel.zero.ZeroOptimizer`: a
replica that is data-parallel inside, at optimizer levels 1-3) is met on those chunks, its `held_tensors`,
and republishes them into the parameters after each sync (an all-gather inside the replica). Its chunks may
exist only once the first backward has found the gradient buckets: the meetings then start at the first
step (from the weights as they were before it), and a state loaded before it waits for them.
`group` is the process group of the replicas this rank meets (e.g. a mesh's "dp" axis); None means all
ranks. Nothing else communicates: a step between syncs issues no collective. The state (inner and outer
optimizer, global weights, step count) is in `state_dict()` and resumes exactly.
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

from loom.dist.elastic import Membership
from loom.dist.local import local_tensor

__all__ = ["DiLoCo", "LocalSGD", "Replicated", "fragments_of", "stepping_optimizer"]


def _held(params: list[torch.Tensor], inner: torch.optim.Optimizer) -> list[torch.Tensor] | None:
    """The tensors the syncs work on: the inner optimizer's own chunks when it holds them (`held_tensors`,
    optimizer levels 1-3; None until they exist), else this rank's shard of each parameter."""
    held = getattr(inner, "held_tensors", None)
    return held() if held is not None else [local_tensor(p) for p in params]


def fragments_of(params: list[torch.Tensor], count: int) -> list[list[int]]:
    """Indices of `params` cut into `count` consecutive fragments of about equal bytes (each non-empty)."""
    if not 1 <= count <= len(params):
        raise ValueError(
            f"fragments = {count} must be between 1 and the number of parameters ({len(params)})"
        )
    sizes = [local_tensor(p).numel() * local_tensor(p).element_size() for p in params]
    total, out, start, done = sum(sizes), [], 0, 0
    for f in range(count):
        target = total * (f + 1) / count
        end = start + 1  # at least one parameter per fragment
        done += sizes[start]
        while end < len(params) - (count - f - 1) and done + sizes[end] / 2 <= target:
            done += sizes[end]
            end += 1
        if f == count - 1:
            end = len(params)
        out.append(list(range(start, end)))
        start = end
    return out


def _flatten(tensors: list[torch.Tensor]) -> torch.Tensor:
    """One flat buffer of `tensors` (one collective for all of them)."""
    return torch.cat([t.reshape(-1) for t in tensors])


def _unflatten(flat: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    """`flat` cut back into tensors shaped as `like`."""
    pieces = torch.split(flat, [t.numel() for t in like])
    return [piece.view(t.shape) for piece, t in zip(pieces, like, strict=True)]


def _check_every(sync_every: object) -> int:
    if isinstance(sync_every, bool) or not isinstance(sync_every, int) or sync_every < 1:
        raise ValueError(
            f"sync_every = {sync_every!r} must be a positive integer (inner steps between syncs)"
        )
    return sync_every


def _all_reduce_sum(flat: torch.Tensor, group: dist.ProcessGroup | None, async_op: bool = False) -> Any:
    """Sum `flat` over `group` in place (the caller divides); returns the work handle when `async_op`."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return None
    return dist.all_reduce(flat, group=group, async_op=async_op)


def _replicas(group: dist.ProcessGroup | None) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def stepping_optimizer(optimizer: Any) -> Any:
    """The optimizer that steps a replica: the inner one of a `LocalSGD` / `DiLoCo`, else `optimizer`."""
    return optimizer.inner if isinstance(optimizer, Replicated) else optimizer


class Replicated:
    """What LocalSGD and DiLoCo share: the inner optimizer, the step count, the parameter list, the
    checkpoint state of this rank (`rank_state`)."""

    SYNC = ""  # the `[parallel] sync` this is: "local_sgd" or "diloco"

    def __init__(
        self,
        params: Iterable[torch.Tensor],
        inner: torch.optim.Optimizer,
        *,
        sync_every: int,
        group: dist.ProcessGroup | Membership | None = None,
    ) -> None:
        self.params = [p for p in params]
        if not self.params:
            raise ValueError("no parameters to synchronise")
        owned = {id(p) for g in inner.param_groups for p in g["params"]}
        missing = [i for i, p in enumerate(self.params) if id(p) not in owned]
        if missing:
            raise ValueError(
                f"parameters {missing[:5]} are not in the inner optimizer: give the same parameters to both"
            )
        self.inner = inner
        self.sync_every = _check_every(sync_every)
        # replicas that come and go meet through their membership, never over a process group
        self.membership = group if isinstance(group, Membership) else None
        self.group = None if self.membership is not None else group
        # whether this replica holds the replicas' state (a replacement does not, until it joins)
        self.holds_state = self.membership is None or not self.membership.joining
        self.inner_steps = 0
        # what the syncs average and save: this rank's shards (or the inner optimizer's chunks of them),
        # found by `_ready` (at the first step when the chunks wait for the gradient buckets)
        self.tensors: list[torch.Tensor] | None = None
        self._loaded: dict[str, Any] | None = None  # a state loaded before the tensors existed
        self._ready()

    def _ready(self) -> bool:
        """Find the tensors the syncs work on, start the meetings from them (`_begin`) and apply a state
        loaded meanwhile; False while an inner optimizer's chunks do not exist yet (before the first step)."""
        if self.tensors is not None:
            return True
        tensors = _held(self.params, self.inner)
        if tensors is None:
            return False
        self.tensors = tensors
        self._begin()
        if self._loaded is not None:
            state, self._loaded = self._loaded, None
            self._load_state(state)
        return True

    def _begin(self) -> None:
        """Start the meetings from `tensors` as they are (DiLoCo: the global weights)."""

    @property
    def param_groups(self) -> list[dict]:
        """The inner optimizer's groups (schedule the learning rate on `self.inner`)."""
        return self.inner.param_groups

    def finish(self) -> None:
        """Land what is still in flight at the end of training (nothing for LocalSGD)."""

    @torch.no_grad()
    def join(self, last_step: int) -> int | None:
        """A replacement replica's entry into a running job (elastic membership only): wait for the first
        sync (at most `last_step`) that counts it a member, meet there taking the global state, and return
        that sync's inner step (the step training continues from); None when no sync is left to join."""
        if self.membership is None or self.holds_state:
            raise ValueError("join() is for a replacement replica of an elastic membership")
        step = self.membership.join_at(self.sync_every, last_step)
        if step is not None:
            self.inner_steps = step
            self._sync_due()
        return step

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients (the inner optimizer's)."""
        self.inner.zero_grad(set_to_none=set_to_none)

    @torch.no_grad()
    def step(self) -> None:
        """One inner step, then the syncs due at it."""
        self._require_ready()  # before the inner step: the meetings start from the weights before it
        self.inner.step()
        self.skip()

    @torch.no_grad()
    def skip(self) -> None:
        """A step whose inner update is left out (a non-finite gradient on this replica): it still counts,
        and the syncs due at it still happen, so that every replica meets at the same steps."""
        self._require_ready()
        self.inner_steps += 1
        self._sync_due()

    def _require_ready(self) -> None:
        if not self._ready():
            raise RuntimeError(
                f"{type(self).__name__}: the inner optimizer's chunks do not exist at a step: run a backward "
                "pass (which finds the gradient buckets) before the step"
            )

    def _sync_due(self) -> None:
        """The syncs due after inner step `inner_steps`."""
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        raise NotImplementedError

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from `state_dict()` (checked at once; applied once the tensors exist, see `_ready`)."""
        self._check_state(state)
        self.inner_steps = int(state["inner_steps"])
        if self.tensors is None:
            self._loaded = state
        else:
            self._load_state(state)

    def _check_state(self, state: dict[str, Any]) -> None:
        """A ValueError when `state` cannot resume this optimizer (nothing to check here)."""

    def _load_state(self, state: dict[str, Any]) -> None:
        raise NotImplementedError

    @torch.no_grad()
    def adopt_params(self) -> None:
        """Start the meetings from the parameters as they are now (weights loaded after this was built,
        with no state of its own: the replicas' common starting point)."""
        recut = getattr(self.inner, "recut", None)  # an inner optimizer's chunks follow the parameters
        if recut is not None and self.tensors is not None:
            recut()

    def _written(self) -> None:
        """After the syncs wrote `tensors`: an inner optimizer that holds them republishes the parameters."""
        republish = getattr(self.inner, "republish", None)
        if republish is not None:
            republish()

    def settings(self) -> dict[str, Any]:
        """What a resumed run must share with the saved one, by `[parallel]` key: the sync and its settings."""
        return {"sync": self.SYNC, "sync_every": self.sync_every}

    def resume_mismatch(self, state: dict[str, Any], prefix: str = "") -> str | None:
        """Why `rank_state()`'s `state` cannot resume this rank (other settings, or another number of ranks
        or replicas), each key named with `prefix`; None when it can."""
        saved, now = state["settings"], self.settings()
        if saved["sync"] != now["sync"]:
            keys = ["sync"]  # the other settings differ in kind: name the sync alone
        else:
            keys = [k for k in {**saved, **now} if saved.get(k) != now.get(k)]
        if keys:
            described = ", ".join(f"{prefix}{k} = {saved.get(k)!r} saved, {now.get(k)!r} now" for k in keys)
            return f"{described}: resume with the settings the checkpoint was saved with"
        ranks, replicas = _world(), _replicas(self.group)
        if (state["world_size"], state["replicas"]) != (ranks, replicas):
            return (
                f"the checkpoint was saved by {state['world_size']} ranks in {state['replicas']} replicas; this "
                f"run has {ranks} ranks in {replicas}: each rank resumes its own replica, so resume on the mesh "
                "the checkpoint was saved with"
            )
        return None

    def rank_state(self) -> dict[str, Any]:
        """What a checkpoint keeps of this rank: `state_dict()` and the parameters as this rank holds them
        (its shards; between two syncs each replica's differ, so no rank can stand for another), with the
        settings, world size and replica count that `resume_mismatch` compares on load."""
        if self.tensors is None and self._loaded is not None:  # resumed, and no step since
            optimizer = self._loaded
        else:
            self._require_ready()
            optimizer = self.state_dict()
        gathered = getattr(self.inner, "gathered_parameters", contextlib.nullcontext)
        with gathered():  # optimizer level 3: the parameters whole on this rank while they are read
            params = [local_tensor(p).detach().clone() for p in self.params]
        return {
            "optimizer": optimizer,
            "params": params,
            "settings": self.settings(),
            "world_size": _world(),
            "replicas": _replicas(self.group),
        }

    @torch.no_grad()
    def load_rank_state(self, state: dict[str, Any]) -> None:
        """Resume this rank from `rank_state()`: the optimizer's state and the parameters; a `ValueError`
        when `resume_mismatch` finds one."""
        mismatch = self.resume_mismatch(state)
        if mismatch is not None:
            raise ValueError(f"{type(self).__name__}.load_rank_state: {mismatch}")
        saved = state["params"]
        if len(saved) != len(self.params):
            raise ValueError(
                f"the saved replica holds {len(saved)} parameters; this one has {len(self.params)}: the model "
                "differs from the saved run's"
            )
        for param, value in zip(self.params, saved, strict=True):
            local = local_tensor(param)
            if local.shape != value.shape:
                raise ValueError(
                    f"a saved parameter of shape {tuple(value.shape)} does not fit {tuple(local.shape)}: the "
                    "model or its sharding differs from the saved run's"
                )
            local.copy_(value)
        recut = getattr(self.inner, "recut", None)  # an inner optimizer's chunks, if built, follow them
        if recut is not None and self.tensors is not None:
            recut()
        self.load_state_dict(state["optimizer"])


class LocalSGD(Replicated):
    """Replicas step alone with `inner` and average their parameters every `sync_every` steps (see the
    module docstring)."""

    SYNC = "local_sgd"

    def _sync_due(self) -> None:
        """Every `sync_every`-th inner step averages the parameters over the replicas."""
        if self.inner_steps % self.sync_every == 0:
            self.average()

    @torch.no_grad()
    def average(self) -> None:
        """Replace every parameter by its mean over the replicas (one all-reduce)."""
        locals_ = self.tensors
        flat = _flatten(locals_)
        if self.membership is not None:  # the replicas alive; a replacement brings nothing
            contribution = flat if self.holds_state else torch.zeros_like(flat)
            meeting = self.membership.meet(self.inner_steps, contribution, self.holds_state, share=None)
            flat, self.holds_state = meeting.summed / len(meeting.trained), True
        else:
            _all_reduce_sum(flat, self.group)
            flat /= _replicas(self.group)
        for local, averaged in zip(locals_, _unflatten(flat, locals_), strict=True):
            local.copy_(averaged)
        self._written()

    def state_dict(self) -> dict[str, Any]:
        """The inner optimizer's state and the step count."""
        return {"inner": self.inner.state_dict(), "inner_steps": self.inner_steps}

    def _load_state(self, state: dict[str, Any]) -> None:
        self.inner.load_state_dict(state["inner"])


class DiLoCo(Replicated):
    """Inner steps alone, outer steps on the averaged pseudo-gradient (see the module docstring).

    `outer`: an optimizer class for the global weights (default `torch.optim.SGD`) built with
    `outer_kwargs` (default lr 0.7, momentum 0.9, Nesterov, as the DiLoCo paper trains)."""

    SYNC = "diloco"

    def __init__(
        self,
        params: Iterable[torch.Tensor],
        inner: torch.optim.Optimizer,
        *,
        sync_every: int,
        group: dist.ProcessGroup | Membership | None = None,
        outer: type[torch.optim.Optimizer] = torch.optim.SGD,
        outer_kwargs: dict[str, Any] | None = None,
        fragments: int = 1,
        fragment_delay: int = 0,
        mix: float = 0.5,
        outer_dtype: torch.dtype = torch.float32,
    ) -> None:
        sync_every = _check_every(sync_every)
        if fragments > sync_every:
            raise ValueError(
                f"fragments = {fragments} is more than sync_every = {sync_every}: each fragment syncs once "
                "per sync_every inner steps, at its own step; use at most sync_every fragments"
            )
        if (
            isinstance(fragment_delay, bool)
            or not isinstance(fragment_delay, int)
            or not (0 <= fragment_delay < sync_every)
        ):
            raise ValueError(
                f"fragment_delay = {fragment_delay!r} must be an integer in [0, sync_every = {sync_every}): a "
                "fragment's average must land before the fragment's next sync starts"
            )
        if not 0.0 <= mix <= 1.0:
            raise ValueError(f"mix = {mix} must be in [0, 1] (the share of the local weights kept)")
        if isinstance(group, Membership) and (fragments != 1 or fragment_delay != 0):
            raise ValueError(
                f"fragments = {fragments}, fragment_delay = {fragment_delay}: replicas that come and go meet "
                "with one fragment and no delay yet; set fragments = 1 and fragment_delay = 0"
            )
        if outer_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"outer_dtype = {outer_dtype} must be torch.float32 or torch.bfloat16")
        self.fragment_count, self.fragment_delay = fragments, fragment_delay
        self.mix, self.outer_dtype = mix, outer_dtype
        self.outer_class = outer
        self.outer_kwargs = (
            {"lr": 0.7, "momentum": 0.9, "nesterov": True} if outer_kwargs is None else dict(outer_kwargs)
        )
        self._pending: dict[int, tuple[int, Any, torch.Tensor]] = {}  # fragment -> (apply at, work, buffer)
        super().__init__(params, inner, sync_every=sync_every, group=group)

    def _begin(self) -> None:
        """The fragments, and the global weights (fp32 copies of `tensors`, updated by the outer optimizer
        only) with their outer optimizer."""
        self.fragments = fragments_of(self.tensors, self.fragment_count)
        self.global_weights = [tensor.detach().float().clone() for tensor in self.tensors]
        self.outer = self.outer_class(self.global_weights, **self.outer_kwargs)

    @torch.no_grad()
    def adopt_params(self) -> None:
        """The global weights become the parameters as they are now (see `Replicated.adopt_params`)."""
        super().adopt_params()
        if self.tensors is None:  # they will be taken from the parameters at the first step
            return
        for weight, tensor in zip(self.global_weights, self.tensors, strict=True):
            weight.copy_(tensor)

    def _offset(self, fragment: int) -> int:
        """The inner step (mod sync_every) at which `fragment` starts its sync."""
        return (fragment + 1) * self.sync_every // len(self.fragments) % self.sync_every

    def _sync_due(self) -> None:
        """The fragments whose turn it is: start (or finish) their outer step."""
        for fragment in range(len(self.fragments)):
            pending = self._pending.get(fragment)
            if pending is not None and pending[0] == self.inner_steps:
                self._finish(fragment, *pending[1:])
            if self.inner_steps % self.sync_every == self._offset(fragment):
                self._start(fragment)

    def _start(self, fragment: int) -> None:
        """Average the fragment's pseudo-gradients: at once, or asynchronously with a delay."""
        indices = self.fragments[fragment]
        pseudo = [self.global_weights[i] - self.tensors[i].float() for i in indices]
        flat = _flatten(pseudo).to(self.outer_dtype)
        if self.membership is not None:
            self._meet(flat)
            return
        delayed = self.fragment_delay > 0
        work = _all_reduce_sum(flat, self.group, async_op=delayed)
        if delayed:
            self._pending[fragment] = (self.inner_steps + self.fragment_delay, work, flat)
        else:
            self._finish(fragment, work, flat)

    def _finish(self, fragment: int, work: Any, flat: torch.Tensor) -> None:
        """The outer step of one fragment on its averaged pseudo-gradient; the replica takes the result."""
        self._pending.pop(fragment, None)
        if work is not None:
            work.wait()
        self._apply(fragment, flat.float() / _replicas(self.group))

    def _meet(self, flat: torch.Tensor) -> None:
        """The sync of replicas that come and go (one fragment, no delay): the average of those that
        trained; a replacement brings zeros and first takes the global state it is given."""
        contribution = flat if self.holds_state else torch.zeros_like(flat)
        meeting = self.membership.meet(self.inner_steps, contribution, self.holds_state, self._global_state)
        if not self.holds_state:
            self._take_global_state(meeting.shared)
            self.holds_state = True
        self._apply(0, meeting.summed.float() / len(meeting.trained))

    def _global_state(self) -> bytes:
        """The global weights and the outer optimizer's state, as a replacement takes them."""
        buffer = io.BytesIO()
        torch.save({"global_weights": self.global_weights, "outer": self.outer.state_dict()}, buffer)
        return buffer.getvalue()

    def _take_global_state(self, data: bytes) -> None:
        state = torch.load(io.BytesIO(data), weights_only=True)
        for weight, value in zip(self.global_weights, state["global_weights"], strict=True):
            weight.copy_(value)
        self.outer.load_state_dict(state["outer"])

    def _apply(self, fragment: int, averaged: torch.Tensor) -> None:
        """The outer step of one fragment on its averaged pseudo-gradient; the replica takes the result."""
        indices = self.fragments[fragment]
        weights = [self.global_weights[i] for i in indices]
        for weight, grad in zip(weights, _unflatten(averaged, weights), strict=True):
            weight.grad = grad
        self._outer_step(weights)
        for i, weight in zip(indices, weights, strict=True):
            local = self.tensors[i]
            if self.fragment_delay > 0:  # inner steps ran meanwhile: keep a share of their progress
                local.mul_(self.mix).add_(weight.to(local.dtype), alpha=1.0 - self.mix)
            else:
                local.copy_(weight)
        self._written()

    def _outer_step(self, weights: list[torch.Tensor]) -> None:
        """Step the outer optimizer on `weights` only (the other fragments keep their gradients at None)."""
        for weight in self.global_weights:
            if all(weight is not w for w in weights):
                weight.grad = None
        self.outer.step()
        for weight in weights:
            weight.grad = None

    @torch.no_grad()
    def finish(self) -> None:
        """Wait for and apply every average still in flight (with `fragment_delay > 0`, those started in the
        last steps): call it once training ends, before the weights are read or the process group goes."""
        for fragment, (_, work, flat) in sorted(self._pending.items()):
            self._finish(fragment, work, flat)

    def settings(self) -> dict[str, Any]:
        """`Replicated.settings` and the outer step's: its learning rate and momentum, the fragments, their
        delay and mix, the dtype the pseudo-gradients travel in."""
        outer = self.outer_kwargs
        return {
            **super().settings(),
            "outer_lr": outer.get("lr"),
            "outer_momentum": outer.get("momentum", 0),
            "fragments": self.fragment_count,
            "fragment_delay": self.fragment_delay,
            "mix": self.mix,
            "outer_dtype": {torch.float32: "fp32", torch.bfloat16: "bf16"}[self.outer_dtype],
        }

    def state_dict(self) -> dict[str, Any]:
        """Inner and outer optimizer states, the global weights, the step count, and the averages still in
        flight (waited for, kept with the step they land at: a resumed run applies them when the
        uninterrupted one would)."""
        pending = {}
        for fragment, (land_at, work, flat) in self._pending.items():
            if work is not None:
                work.wait()
            self._pending[fragment] = (land_at, None, flat)
            pending[fragment] = (land_at, flat.clone())
        return {
            "inner": self.inner.state_dict(),
            "outer": self.outer.state_dict(),
            "global_weights": [w.clone() for w in self.global_weights],
            "inner_steps": self.inner_steps,
            "pending": pending,
            "settings": self.settings(),
        }

    def _check_state(self, state: dict[str, Any]) -> None:
        """Resume only under the settings `state` was saved with."""
        changed = {
            k: (v, state["settings"].get(k))
            for k, v in self.settings().items()
            if state["settings"].get(k) != v
        }
        if changed:
            described = ", ".join(
                f"{k} = {saved!r} saved, {now!r} now" for k, (now, saved) in changed.items()
            )
            raise ValueError(
                f"DiLoCo.load_state_dict: {described}: resume with the settings of the saved run (the fragments "
                "and the averages in flight depend on them)"
            )

    def _load_state(self, state: dict[str, Any]) -> None:
        saved = state["global_weights"]
        if len(saved) != len(self.global_weights):
            raise ValueError(
                f"the state holds {len(saved)} global weights; this DiLoCo has {len(self.global_weights)}"
            )
        for weight, value in zip(self.global_weights, saved, strict=True):
            if weight.shape != value.shape:
                raise ValueError(
                    f"a saved global weight of shape {tuple(value.shape)} does not fit {tuple(weight.shape)}: "
                    "the model or its sharding differs from the saved run's"
                )
            weight.copy_(value)
        self.inner.load_state_dict(state["inner"])
        self.outer.load_state_dict(state["outer"])
        self._pending = {int(f): (int(at), None, flat.clone()) for f, (at, flat) in state["pending"].items()}
