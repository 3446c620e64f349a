"""Checkpoint save and load: loom's distributed checkpoints against a plain `torch.save` / `torch.load`.

    .venv/bin/python benchmarks/checkpoint.py            # 97.6M-parameter GPT, 4-7 minutes on 2 cores
    .venv/bin/python benchmarks/checkpoint.py --small    # 4.2M parameters, a smoke run of about two minutes

The reference GPT (`loom.models.gpt`; d_model 768, 12 layers, 12 heads, vocabulary 16384, sequence 64:
97,605,120 parameters, so 1.1 GiB of parameters and AdamW moments in fp32), with AdamW states:
- loom, on 4 CPU ranks (gloo): a `loom.Trainer` laid out as `loom.train.job.build_model` lays it out (built
  on the meta device, `loom.parallelize(mode="semi_auto")`, only this rank's shards materialised), each
  data-parallel rank training two steps on its rows of the same global batch; by default dp=4 at optimizer
  level 0, dp=2 x tp=2 at level 1 and dp=4 at level 3 (`--cases`). Saved with
  `loom.checkpoint.save_checkpoint` (DCP files, each rank writing what it holds and checksumming it as it
  writes, per-rank files, a manifest, renamed into place) and loaded with `loom.checkpoint.load_checkpoint`
  (the ranks share the checksum checks, then each reads its part) into a freshly built trainer. At levels
  1-3 the optimizer states are read into the optimizer's chunks when it builds them, inside the first
  training step of the target: that step is run (untimed) and the read is timed on its own, between two
  barriers in the build (max over ranks), and added to the load.
- the torch reference, in the same launch, on rank 0 while the other ranks wait idle at a barrier: the plain
  model with AdamW after one step (random gradients: the same bytes, no training needed), saved as
  `torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()})`, then fsynced, loaded
  with `torch.load` and both `load_state_dict`s into a fresh model and AdamW. Its saves follow loom's and
  its loads alternate with loom's: both sides are measured under the same load of a shared machine.
- a second load reference for replicated state: every rank `torch.load`s that same file at once into its own
  plain model and AdamW (timed between barriers), as a data-parallel job without sharded checkpoints
  resumes. At level 0 every data-parallel replica holds the whole state, so on 4 ranks sharing 2 cores a
  load copies four times the bytes of the single-process reference; this is the like-for-like comparison.

Each case runs in a `loom.launch` of its own (fresh processes: the ranks share the machine's memory, and
memory that one case's allocator kept must not add to the next one's): train, save `--repeats` times (each
into a new directory, the previous one removed untimed), the reference likewise, then load the last save
`--repeats` times each, each into a new target, as a restarted job does. Each loom save and load is timed
between two barriers, so a loom time is the collective's wall time; medians (of rank 0's times) are
reported. The targets start from zeroed parameters, and after each load every rank's sha256 of its local
parameters and of its optimizer states (at levels 1-3: its chunks' states, as the build put them in place)
must equal the one taken after training (the reference's too): the benchmark fails rather than time a
broken load. Bytes on disk are what `du` counts (allocated blocks) of the checkpoint directory or the file.

Peak memory (Linux): each rank's peak resident set (VmHWM, reset before each measured span) during the
second training step and during each save; printed as save peak / step peak (max over ranks).

Prints save and load seconds, bytes, and the ratios against the reference: save / (torch.save + fsync:
DCP's writer fsyncs its files, torch.save does not) and load / torch.load (goals: at most 1.0 and 1.2),
and load / every rank's torch.load.
Files are written to and read back from the page cache (nothing is dropped between a save and its loads).
Checkpoints go into a temporary directory, removed at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import hashlib
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import loom
from loom.checkpoint import load_checkpoint, save_checkpoint
from loom.models.gpt import GPT, GPTConfig, Strategies
from loom.parallel import make_optimizer
from loom.parallel.zero import ZeroOptimizer
from loom.train import Trainer

TORCH = "torch"
RANKS = 4


@dataclass(frozen=True)
class Case:
    """One loom layout: a dp x tp mesh and an optimizer level."""

    dp: int
    tp: int
    level: int

    @property
    def name(self) -> str:
        mesh = f"dp{self.dp}" if self.tp == 1 else f"dp{self.dp}xtp{self.tp}"
        return f"loom {mesh} L{self.level}"

    @property
    def mesh(self) -> dict[str, int]:
        return {"dp": self.dp, "tp": self.tp}


CASES = {
    "dp4-l0": Case(4, 1, 0),
    "dp2xtp2-l1": Case(2, 2, 1),
    "dp4-l3": Case(4, 1, 3),
    "dp2xtp2-l0": Case(2, 2, 0),
}
DEFAULT_CASES = ["dp4-l0", "dp2xtp2-l1", "dp4-l3"]
FULL = {"vocab_size": 16384, "d_model": 768, "n_layers": 12, "n_heads": 12}
SMALL = {"vocab_size": 4096, "d_model": 256, "n_layers": 4, "n_heads": 8}


# ---- building the subjects ------------------------------------------------------------------------------------


def global_batch(config: GPTConfig, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and next-token targets, the same on every rank."""
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, config.vocab_size, (rows, config.max_seq_len + 1), generator=generator)
    return ids[:, :-1], ids[:, 1:]


def torch_source(config: GPTConfig) -> tuple[GPT, torch.optim.Optimizer]:
    """The plain model (initialised as loom's copies are, from (seed 0, name)) and AdamW after one step: the
    same bytes as the loom subjects' state (the gradients are random: this reference times saving and
    loading, not training, so it runs no forward pass)."""
    model = GPT(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    torch_step(model, optimizer)
    return model, optimizer


def torch_step(model: GPT, optimizer: torch.optim.Optimizer) -> None:
    generator = torch.Generator().manual_seed(2)
    for param in model.parameters():
        param.grad = torch.randn(param.shape, generator=generator)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def torch_target(config: GPTConfig) -> tuple[GPT, torch.optim.Optimizer]:
    """A fresh model with zeroed parameters (allocated without the initialisation's random draws) and a
    fresh AdamW: what a restarted process loads into."""
    with torch.device("meta"):
        model = GPT(config)
    model.to_empty(device="cpu")
    _zero(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def loom_trainer(config: GPTConfig, case: Case, batch: tuple, trained: bool) -> tuple[Trainer, tuple]:
    """A trainer laid out as `loom.train.job.build_model` lays it out, and this rank's rows of `batch`;
    `trained`: initialised and after one step on them, else zeroed parameters and no step (a load target)."""
    mesh = loom.init(case.mesh)
    rows = batch[0].shape[0] // case.dp
    local = tuple(t[mesh.dp_rank() * rows : (mesh.dp_rank() + 1) * rows] for t in batch)
    with torch.device("meta"):
        model = GPT(config, Strategies(case.dp, case.tp))
    loom.parallelize(model, mode="semi_auto", example_inputs=local)
    model.loom.materialize(model, "cpu")
    model.init_weights(0)  # buffers too, as a restarted job initialises them
    if not trained:
        _zero(model)  # so that a load which writes nothing cannot match the saved digest
    optimizer = make_optimizer(model, torch.optim.AdamW, case.level, lr=1e-3)
    trainer = Trainer(model, optimizer)
    if trained:
        trainer.train_step([local])
    return trainer, local


@torch.no_grad()
def _zero(model: torch.nn.Module) -> None:
    for param in model.parameters():
        param.zero_()


# ---- digests ----------------------------------------------------------------------------------------------------


def digest(tensors: Iterable[torch.Tensor]) -> str:
    """sha256 of the bytes of this rank's part of every tensor, in order (a DTensor counts its shard)."""
    hasher = hashlib.sha256()
    for tensor in tensors:
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        # hashed from a copy: a NumPy view would pin the storage, which level 3 resizes to free it
        hasher.update(local.detach().clone().reshape(-1).view(torch.uint8).numpy())
    return hasher.hexdigest()


def state_digests(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, str]:
    """Digests of the parameters and of the optimizer's states (at levels 1-3 those of its inner optimizers:
    this rank's chunks, and the parameters updated whole)."""
    state = getattr(model, "loom", None)
    with state.full_parameters() if state is not None else contextlib.nullcontext():  # level 3: freed at rest
        params = digest(model.parameters())
    return {"params": params, "optimizer": optimizer_digest(optimizer)}


def optimizer_digest(optimizer: torch.optim.Optimizer) -> str:
    inner = optimizer.inner if isinstance(optimizer, ZeroOptimizer) else [optimizer]
    tensors = [
        opt.state[p][key]
        for opt in inner
        for group in opt.param_groups
        for p in group["params"]
        for key in sorted(opt.state[p])
    ]
    return digest(tensors)


# ---- saving, loading, timing ------------------------------------------------------------------------------


def timed(fn: Callable[[], object]) -> float:
    """Seconds from a barrier before `fn()` to a barrier after it: the collective's wall time."""
    dist.barrier()
    start = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - start


def timed_alone(fn: Callable[[], object]) -> float:
    """Seconds `fn()` takes on this process (the reference: the other ranks wait, see `alone`)."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def alone(fn: Callable[[], Any]) -> Any:
    """`fn()` on rank 0 while the other ranks wait at a barrier (idle): the single-process reference,
    measured between the loom subject's own measurements."""
    result = fn() if loom.rank() == 0 else None
    dist.barrier()
    return result


def with_peak(fn: Callable[[], Any]) -> tuple[Any, int | None]:
    """`fn()`, and this process's peak resident set while it ran (Linux: VmHWM, reset first; None
    elsewhere)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return fn(), None
    result = fn()
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return result, int(line.split()[1]) * 1024
    return result, None


def max_over_ranks(value: float) -> float:
    box = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(box, op=dist.ReduceOp.MAX)
    return float(box.item())


def torch_save(model: GPT, optimizer: torch.optim.Optimizer, path: Path) -> None:
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, path)


def torch_load(path: Path, model: GPT, optimizer: torch.optim.Optimizer) -> None:
    state = torch.load(path, weights_only=True)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])


def fsync(path: Path) -> None:
    with open(path, "rb") as file:
        os.fsync(file.fileno())


def disk_bytes(path: Path) -> int:
    """What `du` counts: allocated blocks of every file under `path` (or of the file itself)."""
    files = [path] if path.is_file() else [Path(d) / f for d, _, names in os.walk(path) for f in names]
    return sum(f.stat().st_blocks * 512 for f in files)


def remove(path: Path) -> None:
    """Rank 0 removes `path` (untimed) once every rank is past it."""
    dist.barrier()
    if loom.rank() == 0:
        remove_alone(path)
    dist.barrier()


def remove_alone(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


# ---- the subjects --------------------------------------------------------------------------------------------


class TorchSubject:
    """The reference: the plain model and AdamW saved with `torch.save` and loaded with `torch.load`, on
    rank 0 alone (see `alone`)."""

    name = TORCH
    clock = staticmethod(timed_alone)
    remove = staticmethod(remove_alone)

    def __init__(self, config: GPTConfig) -> None:
        self.config = config

    def trained(self) -> tuple:
        return torch_source(self.config)

    def step(self, state: tuple) -> None:
        torch_step(*state)

    def fresh(self) -> tuple:
        return torch_target(self.config)

    def save(self, state: tuple, path: Path) -> None:
        torch_save(*state, path)

    def load(self, state: tuple, path: Path) -> None:
        torch_load(path, *state)

    def placed(self, state: tuple) -> tuple[float, dict]:
        """Everything is in place once loaded: no more seconds, and the digests."""
        return 0.0, state_digests(*state)

    def digests(self, state: tuple) -> dict:
        return state_digests(*state)


class TorchOnEveryRank(TorchSubject):
    """The reference for replicated state: every rank `torch.load`s the whole state at once, as a
    data-parallel job without sharded checkpoints resumes (timed between barriers, like loom's loads)."""

    name = "torch, every rank"
    clock = staticmethod(timed)


class LoomSubject:
    """A loom trainer on one case's mesh, saved and loaded with `loom.checkpoint`."""

    clock = staticmethod(timed)
    remove = staticmethod(remove)

    def __init__(self, config: GPTConfig, case: Case, batch: tuple) -> None:
        self.config, self.case, self.batch, self.name = config, case, batch, case.name
        self.local: tuple = ()
        self.marks: list[float] = []  # when the optimizer's state read began and ended (levels 1-3)
        self.built: str | None = None  # the optimizer digest once the read has put the states in place

    def trained(self) -> Trainer:
        trainer, self.local = loom_trainer(self.config, self.case, self.batch, trained=True)
        return trainer

    def step(self, trainer: Trainer) -> None:
        trainer.train_step([self.local])

    def fresh(self) -> Trainer:
        trainer, self.local = loom_trainer(self.config, self.case, self.batch, trained=False)
        return trainer

    def save(self, trainer: Trainer, path: Path) -> None:
        save_checkpoint(path, trainer)

    def load(self, trainer: Trainer, path: Path) -> None:
        optimizer = trainer.optimizer
        sharded = isinstance(optimizer, ZeroOptimizer)
        if sharded:  # build callbacks run in order: this one, the checkpoint's read, the one below
            self.marks = []
            optimizer.on_build(self._read_starts)
        step = load_checkpoint(path, trainer)
        if step != 2:
            raise RuntimeError(f"{self.name}: load_checkpoint found step {step}, expected 2 (the one saved)")
        if sharded:
            optimizer.on_build(self._read_done(optimizer))

    def _read_starts(self) -> None:
        dist.barrier()  # every rank builds at this point of the step: the read is timed as a collective
        self.marks.append(time.perf_counter())

    def _read_done(self, optimizer: ZeroOptimizer) -> Callable[[], None]:
        def done() -> None:
            dist.barrier()
            self.marks.append(time.perf_counter())
            self.built = optimizer_digest(optimizer)

        return done

    def placed(self, trainer: Trainer) -> tuple[float, dict]:
        """At levels 1-3: run the first step, in which the optimizer builds its chunks and reads its states
        (untimed); the seconds of that read (between barriers, max over ranks) and the digests as it left
        them."""
        if not isinstance(trainer.optimizer, ZeroOptimizer):
            return 0.0, self.digests(trainer)
        params = self.digests(trainer)["params"]
        self.step(trainer)
        start, end = self.marks
        return max_over_ranks(end - start), {"params": params, "optimizer": self.built}

    def digests(self, trainer: Trainer) -> dict:
        return state_digests(trainer.model, trainer.optimizer)


# ---- the run on each rank -------------------------------------------------------------------------------------


def run_subject(key: str, config: GPTConfig, rows: int, repeats: int, root: str) -> dict:
    """The body of one launch: loom case `key` measured on every rank, and the torch reference on rank 0
    between its measurements."""
    batch = global_batch(config, rows)
    return measure(LoomSubject(config, CASES[key], batch), TorchSubject(config), repeats, Path(root))


def measure(subject: LoomSubject, reference: TorchSubject, repeats: int, root: Path) -> dict:
    """Train two steps (the second's peak memory measured) and save `repeats` times (each save's peak memory
    measured), then the reference does the same; then load `repeats` times each, alternately, into fresh
    targets: loom, the reference on rank 0 alone, the reference's file on every rank at once. Returns
    {"loom": ..., "torch": ... (rank 0 only), "every": ...}."""
    out, ref = _record(), _record()
    paths = [root / f"{subject.name.replace(' ', '_')}-{repeat}" for repeat in range(repeats)]
    ref_paths = [root / f"torch-{loom.rank()}-{repeat}.pt" for repeat in range(repeats)]
    expected = train_and_save(subject, paths, out)  # the trained state is gone: room for the load targets
    gc.collect()
    expected_ref = alone(lambda: train_and_save(reference, ref_paths, ref))
    gc.collect()
    everywhere, every = TorchOnEveryRank(reference.config), _record()
    shared = [expected_ref, ref_paths[-1]]  # rank 0's file and digests, for every rank's torch.load
    dist.broadcast_object_list(shared, src=0)
    for _ in range(repeats):
        load_once(subject, paths[-1], expected, out)
        alone(lambda: load_once(reference, ref_paths[-1], expected_ref, ref))
        load_once(everywhere, shared[1], shared[0], every)
    if loom.rank() == 0:
        out["bytes"], ref["bytes"] = disk_bytes(paths[-1]), disk_bytes(ref_paths[-1])
        remove_alone(ref_paths[-1])
    remove(paths[-1])
    return {"loom": out, "torch": ref if loom.rank() == 0 else None, "every": every}


def _record() -> dict:
    return {"save": [], "load": [], "read": [], "fsync": [], "checks": [], "save_peak": []}


def train_and_save(subject: TorchSubject | LoomSubject, paths: list[Path], out: dict) -> dict:
    """Train, then save into each of `paths` (keeping only the last); the digests of the saved state."""
    state = subject.trained()
    _, out["step_peak"] = with_peak(lambda: subject.step(state))
    for repeat, path in enumerate(paths):
        seconds, peak = with_peak(lambda path=path: subject.clock(lambda: subject.save(state, path)))
        out["save"].append(seconds)
        out["save_peak"].append(peak)
        if subject.name == TORCH:  # for reference: the time to make the bytes durable, as DCP's writer does
            out["fsync"].append(subject.clock(lambda path=path: fsync(path)))
        if repeat:  # keep only the newest save (for the loads)
            subject.remove(paths[repeat - 1])
    return subject.digests(state)


def load_once(subject: TorchSubject | LoomSubject, path: Path, expected: dict, out: dict) -> None:
    """Load `path` into a fresh target: the seconds (with the levels 1-3 state read) and the check."""
    target = subject.fresh()
    seconds = subject.clock(lambda target=target: subject.load(target, path))
    read, digests = subject.placed(target)
    out["load"].append(seconds + read)
    out["read"].append(read)
    out["checks"].append(compare(expected, digests))
    del target
    gc.collect()


def compare(saved: dict[str, str], loaded: dict[str, str]) -> dict[str, bool]:
    """Per kind: whether the loaded digest equals the saved one."""
    return {key: saved[key] == loaded[key] for key in saved}


# ---- the report -----------------------------------------------------------------------------------------------


def verdict(checks: list[dict], key: str) -> str:
    """ok when the digests of `key` matched the saved ones after every load (every rank's), else FAIL."""
    found = [check[key] for check in checks]
    return "ok" if found and all(found) else "FAIL"


def memory_ratio(ranks: list[dict]) -> float | None:
    """The largest save peak over the step peak, over the ranks (None where peaks are unknown)."""
    ratios = [
        max(peak for peak in rank["save_peak"]) / rank["step_peak"]
        for rank in ranks
        if rank["step_peak"] and all(rank["save_peak"])
    ]
    return max(ratios) if ratios else None


def medians(record: dict) -> dict[str, float]:
    median = {op: statistics.median(record[op]) for op in ("save", "load", "read")}
    if record["fsync"]:
        median["synced"] = statistics.median(
            s + f for s, f in zip(record["save"], record["fsync"], strict=True)
        )
    return median


def report(results: dict[str, list[dict]], config: GPTConfig, rows: int, repeats: int) -> bool:
    """Print the table (`results`: by loom case, then by rank); True when every load gave back what was
    saved. Each case's ratios are against the reference measured in the same launch, between its own
    measurements (the machine may be busy with other work; this keeps both sides under the same load)."""
    loom_of = {name: [rank["loom"] for rank in ranks] for name, ranks in results.items()}
    torch_of = {name: ranks[0]["torch"] for name, ranks in results.items()}
    ours = {name: medians(ranks[0]) for name, ranks in loom_of.items()}  # every rank timed the same span
    base = {name: medians(ref) for name, ref in torch_of.items()}
    every = {name: statistics.median(ranks[0]["every"]["load"]) for name, ranks in results.items()}
    with torch.device("meta"):
        psi = GPT(config).num_parameters()
    print(
        f"GPT with {psi:,} parameters (d_model {config.d_model}, {config.n_layers} layers, {config.n_heads} "
        f"heads, vocabulary {config.vocab_size}, seq {config.max_seq_len}), fp32, after two AdamW steps "
        f"(global batch {rows})"
    )
    print(
        f"state: parameters + AdamW moments = {12 * psi / 2**20:.1f} MiB; loom on {RANKS} CPU ranks (gloo), "
        f"the torch reference on one (rank 0, the others idle) in the same launch; median of {repeats}; "
        "MiB = 2^20 bytes"
    )
    print()
    header = (
        f"{'subject':<18}{'save s':>8}{'load s':>8}{'(read)':>8}{'disk MiB':>10}{'torch s':>9}{'+fsync':>8}"
        f"{'load':>6}{'all':>6}{'save x':>8}{'load x':>8}{'all x':>7}{'mem x':>7}  {'params':<8}{'optimizer':<10}"
    )
    print(header)
    print("-" * len(header))
    good = True
    for name, ranks in loom_of.items():
        mine, ref, memory = ours[name], base[name], memory_ratio(ranks)
        checks = [check for rank in ranks for check in rank["checks"]] + torch_of[name]["checks"]
        checks += [check for rank in results[name] for check in rank["every"]["checks"]]
        params, optimizer = verdict(checks, "params"), verdict(checks, "optimizer")
        good = good and params == optimizer == "ok"
        print(
            f"{name:<18}{mine['save']:>8.2f}{mine['load']:>8.2f}{mine['read']:>8.2f}"
            f"{ranks[0]['bytes'] / 2**20:>10.1f}{ref['save']:>9.2f}{ref['synced']:>8.2f}{ref['load']:>6.2f}"
            f"{every[name]:>6.2f}{mine['save'] / ref['synced']:>8.2f}{mine['load'] / ref['load']:>8.2f}"
            f"{mine['load'] / every[name]:>7.2f}"
            f"{'' if memory is None else f'{memory:.2f}':>7}  {params:<8}{optimizer:<10}"
        )
    print()
    print(
        "torch s / +fsync / load: the reference in the same launch (torch.save, torch.save then fsync, "
        "torch.load of the same state, "
        f"{statistics.median(ref['bytes'] for ref in torch_of.values()) / 2**20:.1f} MiB); "
        "save x: save / (torch.save then fsync: DCP's writer fsyncs its files), goal <= 1.0; "
        "load x: load / torch.load, goal <= 1.2; all: every rank torch.loads the whole file at once (how a "
        "data-parallel job without sharded checkpoints resumes), all x: load / all; (read): the part of the load spent reading the optimizer "
        "states into the chunks at the first step (levels 1-3); mem x: peak resident memory during a save / "
        "during a training step (max over ranks), goal <= 1.1"
    )
    print(
        "params / optimizer: every rank's sha256 of its local parameters / optimizer states (levels 1-3: its "
        "chunks') after each load against the saved ones (and the reference's)"
    )
    return good


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--small", action="store_true", help="a GPT of about 4M parameters: a smoke run")
    parser.add_argument("--cases", nargs="+", default=DEFAULT_CASES, choices=sorted(CASES))
    parser.add_argument("--repeats", type=int, default=3, help="saves and loads of each subject")
    parser.add_argument("--rows", type=int, default=4, help="global batch of the training step")
    parser.add_argument("--seq", type=int, default=64, help="sequence length (the model's max_seq_len)")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    if args.rows % 4:
        parser.error("--rows must be a multiple of 4 (every data-parallel rank trains on its rows)")
    config = GPTConfig(**(SMALL if args.small else FULL), max_seq_len=args.seq)
    start = time.perf_counter()
    results = {}
    with tempfile.TemporaryDirectory(prefix="loom-checkpoint-bench-") as root:
        # a launch per case: fresh processes, so that memory one case's allocator kept cannot add to the
        # next one's (the ranks share the machine's memory)
        for key in args.cases:
            results[CASES[key].name] = loom.launch(
                run_subject, RANKS, key, config, args.rows, args.repeats, root
            )
    good = report(results, config, args.rows, args.repeats)
    load = os.getloadavg()[0]  # other work on the machine shows in every time above
    print(
        f"(whole run {time.perf_counter() - start:.0f} s; load average {load:.1f} on {os.cpu_count()} cores)"
    )
    if not good:
        raise SystemExit("a load did not give back the saved state: the times above measure a broken load")


if __name__ == "__main__":
    main()
