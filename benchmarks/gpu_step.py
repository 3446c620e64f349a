"""Everything issue 17 asks of a GPU, in one call: `python benchmarks/gpu_step.py --out DIR`.

GPU time comes in short leases, so one command checks and times it all and writes what it finds to files:
`DIR/results.json` (every figure) and `DIR/table.txt` (the table printed at the end), both rewritten after
each part, so that a run cut short keeps what it had. The parts, each with its own time budget (and a hard
alarm a quarter past it) and guarded so that a failure is recorded and the rest still runs (`status`: ok,
failed with the error, or skipped with the reason), in this order but for `profile` and `simulate`, which
run before the compiled parts:

- `environment`: torch, CUDA, the device, its peak bf16 FLOP/s (`loom.train.hardware_peaks`);
- `equivalence`: two ranks sharing the one GPU over gloo, CUDA tensors (`[train] device = "cuda"`), train
  the fused-attention GPT with fused AdamW at tp = 2 and at optimizer level 3 (dp = 2), against one device
  (the matmul attention): losses, gradient norms and parameters (run as a subprocess: its own process
  group, and a crash there is only that part's);
- `sync_free`: loom's Trainer, with `loom train`'s callbacks and CPU batches, steps between logged steps
  with `torch.cuda.set_sync_debug_mode("error")` (the synchronisations torch checks for; on a CPU: every
  read of a tensor into Python counted), then one logged step;
- `checkpoint`: a Trainer on the device saved by `loom.checkpoint.save_checkpoint` and loaded into a fresh
  one: values equal, parameters and optimizer states back on the device, the same parameters after one
  more step of both;
- `plain_eager`, `loom_eager`, `loom_dtensor`, `plain_compiled`, `loom_compiled`: the same GPT (~1.3B:
  24 layers, d_model 2048, 16 heads, seq 2048, vocab 50304; bf16 autocast over fp32 master weights; the
  attention through `F.scaled_dot_product_attention`, flash on an H100; AdamW fused) trained by a plain
  PyTorch loop (autocast, backward, `clip_grad_norm_`, step) and by `loom.Trainer` (non-finite skip and
  clipping on the device), each eager and with every block compiled (`loom.train.device.compile_blocks`);
  `loom_dtensor` is the model as `loom train` lays it out (`loom.parallelize` semi-auto on a 1-rank mesh,
  DTensor parameters). Tokens/s, MFU and peak memory (`torch.cuda.max_memory_allocated`);
- `profile`: this GPU measured into a hardware profile for the simulator (bf16 matmul FLOP/s at the
  model's GEMM shapes, fitted by `loom.cost.calibrate.fit_matmul`; memory bandwidth; kernel overhead;
  fused attention's speed), written to `DIR/profile.json` (`loom simulate --hardware DIR/profile.json`);
- `simulate`: `loom.sim.simulate` of the same plan (one device, flash attention, bf16) on the `h100-sxm`
  profile and on the measured one: predicted step time and peak memory, set against the measurements.

The table gives the ratios issue 17's acceptance reads: loom / plain MFU (goal >= 0.97), loom's MFU with
compile (goal >= 45% on an H100), predicted / measured step time and memory (goal within 10%).
`--smoke` runs every part on the CPU (a GPU if there is one) with a tiny model in seconds; compiling is
skipped there (inductor takes minutes on a CPU; tests/test_gpu_path.py checks compiled blocks). Nothing
here asserts on time: the figures are recorded, and a reader compares them with the goals.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# the GPU machine runs this from a plain checkout with its own torch: loom from the tree, in the workers too
sys.path.insert(0, str(ROOT))
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))

from benchmarks import gpu_deps  # noqa: E402  (standard library only)

if __name__ == "__main__":
    # before torch and loom load: what loom needs and this machine lacks comes from --wheels, or the run
    # stops here saying what is missing (GPU time is too short to find it out at the first part needing it)
    gpu_deps.ensure_from_argv(sys.argv[1:])

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import loom  # noqa: E402
from loom.cost.calibrate import fit_matmul  # noqa: E402
from loom.cost.hardware import Cluster, Device, Link, get_cluster, save_cluster  # noqa: E402
from loom.cost.layer import BACKWARD_BYTES, CAUSAL_SHARE, gemm_shapes  # noqa: E402
from loom.cost.plan import ParallelPlan  # noqa: E402
from loom.cost.transformer import transformer_config  # noqa: E402
from loom.models.gpt import GPT, GPTConfig, Strategies  # noqa: E402
from loom.parallel import make_optimizer  # noqa: E402
from loom.sim.simulator import simulate  # noqa: E402
from loom.train import Trainer  # noqa: E402
from loom.train.device import compile_blocks, optimizer_kernels  # noqa: E402
from loom.train.hardware_peaks import peak_flops  # noqa: E402
from loom.train.job import flop_parameters, step_callbacks  # noqa: E402
from loom.train.metrics import model_flops_per_token  # noqa: E402
from loom.train.precision import DTYPES  # noqa: E402

GIB = 2**30


@dataclass(frozen=True)
class Setup:
    """The run's model and batch, and how long each part may take."""

    config: GPTConfig
    batch: int
    device: torch.device
    dtype: str  # the cost model's name of the autocast dtype
    warmup: int
    max_steps: int
    compile: bool
    budgets: dict[str, float]

    @property
    def tokens(self) -> int:
        return self.batch * self.config.max_seq_len


FULL_BUDGETS = {  # seconds per part on an H100: 475 in all, within --budget-s's default of 480
    "environment": 5, "equivalence": 100, "sync_free": 30, "checkpoint": 30, "plain_eager": 35,
    "loom_eager": 35, "loom_dtensor": 45, "plain_compiled": 100, "loom_compiled": 60, "profile": 25,
    "simulate": 10,
}  # fmt: skip
SMOKE_BUDGETS = dict.fromkeys(FULL_BUDGETS, 30.0) | {"equivalence": 180.0}  # worker start-up on 2 cores


def full_setup(device: torch.device, batch: int) -> Setup:
    config = GPTConfig(
        vocab_size=50304, d_model=2048, n_layers=24, n_heads=16, max_seq_len=2048, attention_kernel="sdpa"
    )
    return Setup(config, batch, device, "bf16", warmup=3, max_steps=20, compile=True, budgets=FULL_BUDGETS)


def smoke_setup(device: torch.device) -> Setup:
    config = GPTConfig(
        vocab_size=256, d_model=64, n_layers=2, n_heads=4, max_seq_len=32, attention_kernel="sdpa"
    )
    return Setup(config, 4, device, "bf16", warmup=1, max_steps=3, compile=False, budgets=SMOKE_BUDGETS)


class Skip(Exception):
    """A part that cannot run here; its message says why."""


class PartTimeout(BaseException):
    """A part ran past its hard limit (`Report.run`'s alarm). A BaseException: compile and autotuning code
    that catches `Exception` cannot swallow it."""


def _alarm(signum: int, frame: object) -> None:
    raise PartTimeout("ran past its hard time limit (its budget and a quarter more)")


class Report:
    """Each part's status and figures, and the table with the ratios, written to `out/results.json` and
    `out/table.txt` after every part: a run cut short keeps what it had. `caption`: the table's first line
    after the device's name (the batch, the dtype)."""

    def __init__(self, out: Path, total_s: float, caption: str = "") -> None:
        self.out, self.total_s, self.start, self.caption = out, total_s, time.monotonic(), caption
        self.parts: dict[str, dict] = {}
        out.mkdir(parents=True, exist_ok=True)

    def left(self) -> float:
        return self.total_s - (time.monotonic() - self.start)

    def run(self, name: str, budget_s: float, fn: Callable[[float], dict]) -> dict:
        """Run part `name` with at most `budget_s` (less when the whole run's budget is nearly spent). The
        budget is the part's to keep (timed loops stop early); past a quarter more, an alarm stops it
        (`PartTimeout`, recorded as failed), so that one slow compile cannot spend the others' time."""
        budget = min(budget_s, self.left())
        began = time.monotonic()
        if budget <= 1:
            entry = {"status": "skipped", "reason": "the run's time budget is spent (--budget-s)"}
        else:
            try:
                with _hard_limit(1.25 * budget):
                    entry = {"status": "ok", **fn(budget)}
            except Skip as why:
                entry = {"status": "skipped", "reason": str(why)}
            except (
                Exception,
                PartTimeout,
            ) as error:  # recorded: GPU time is too short to rerun for one failure
                entry = {
                    "status": "failed",
                    "error": f"{type(error).__name__}: {error}"[:2000],
                    "traceback": traceback.format_exc()[-4000:],
                }
        entry["seconds"] = round(time.monotonic() - began, 2)
        self.parts[name] = entry
        _free_memory()
        self.write()
        print(f"[gpu_step] {name}: {entry['status']} in {entry['seconds']} s", flush=True)
        return entry

    def write(self) -> str:
        """Write results.json (every part, and the ratios) and table.txt; returns the table."""
        table, ratios = summary(self.parts)
        env = self.parts.get("environment", {})
        device = env.get("device_name", env.get("device", "?"))
        table = f"{device}, torch {torch.__version__}, CUDA {torch.version.cuda}; {self.caption}\n{table}"
        results = {**self.parts, "ratios": {"status": "ok", **ratios}}
        (self.out / "results.json").write_text(json.dumps(results, indent=2, default=str))
        (self.out / "table.txt").write_text(table + "\n")
        return table


@contextlib.contextmanager
def _hard_limit(seconds: float):
    """Raise `PartTimeout` in the main thread after `seconds` (SIGALRM; where there is none, no limit)."""
    if not hasattr(signal, "setitimer"):
        yield
        return
    previous = signal.signal(signal.SIGALRM, _alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _autocast(setup: Setup):
    if setup.dtype == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(setup.device.type, dtype=DTYPES[setup.dtype])


def _batch(setup: Setup, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(
        0, setup.config.vocab_size, (setup.batch, setup.config.max_seq_len + 1), generator=generator
    )
    ids = ids.to(setup.device)
    return ids[:, :-1], ids[:, 1:]


def _peak(setup: Setup) -> float:
    return peak_flops(setup.device.type, DTYPES[setup.dtype])


def _flops_per_token(model: GPT) -> float:
    c = model.config
    return model_flops_per_token(flop_parameters(model), c.n_layers, c.d_model, c.max_seq_len)


def _timed(setup: Setup, step: Callable[[], object], budget_s: float) -> dict:
    """Warm-up steps, then steps back to back (as training runs them) until `max_steps` or the budget, timed
    from one device synchronisation to the next."""
    began = time.monotonic()
    for _ in range(setup.warmup):
        step()
    _sync(setup.device)
    if setup.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(setup.device)
    first = time.monotonic() - began
    start, steps = time.perf_counter(), 0
    # at least 3 timed steps; more while the budget (less the warm-up's pace for one more) allows
    while steps < setup.max_steps and (
        steps < 3 or time.monotonic() - began + first / max(setup.warmup, 1) < budget_s
    ):
        step()
        steps += 1
    _sync(setup.device)
    return {"steps": steps, "step_s": (time.perf_counter() - start) / steps, "warmup_s": round(first, 2)}


def _throughput(setup: Setup, model: GPT, timing: dict) -> dict:
    tokens_per_s = setup.tokens / timing["step_s"]
    peak = _peak(setup)
    memory = torch.cuda.max_memory_allocated(setup.device) if setup.device.type == "cuda" else None
    return {
        **timing,
        "tokens_per_s": tokens_per_s,
        "mfu": tokens_per_s * _flops_per_token(model) / peak,
        "peak_memory_gib": memory / GIB if memory is not None else None,
    }


class Models:
    """The benchmark's one plain GPT, built once on the device (its init is long at 1.3B) and compiled
    in place for the compiled parts."""

    def __init__(self, setup: Setup) -> None:
        self.setup, self._plain, self.compiled = setup, None, False

    def plain(self) -> GPT:
        if self._plain is None:
            torch.manual_seed(0)
            with torch.device(self.setup.device):
                self._plain = GPT(self.setup.config)
        return self._plain

    def compile(self) -> GPT:
        if not self.setup.compile:
            raise Skip(
                "--smoke does not compile (inductor takes minutes on a CPU); tests/test_gpu_path.py does"
            )
        model = self.plain()
        if not self.compiled:
            compile_blocks(model)
            self.compiled = True
        return model


def _plain_loop(setup: Setup, model: GPT, budget_s: float) -> dict:
    """The plain PyTorch loop: autocast forward, backward, torch's clip, fused AdamW."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, **_kernels(setup))
    ids, targets = _batch(setup)

    def step() -> None:
        with _autocast(setup):
            loss = model(ids, targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    result = _throughput(setup, model, _timed(setup, step, budget_s))
    return result


def _compile_counters() -> dict:
    """What torch.compile did so far (graph breaks by reason, frames compiled): a compiled run that breaks
    its blocks' graphs gains little, and this says so."""
    from torch._dynamo.utils import counters

    return {
        "graph_breaks": dict(counters["graph_break"]),
        "frames": dict(counters["frames"]),
    }


def _kernels(setup: Setup) -> dict:
    """A GPU run's optimizer kernels (fused), on any device: torch has fused AdamW on CPUs too, so that
    --smoke runs the path a GPU runs (the non-finite skip on the device)."""
    return optimizer_kernels(torch.device("cuda"))


def _trainer(
    setup: Setup, model: torch.nn.Module, optimizer: torch.optim.Optimizer, flops: float, callbacks=()
) -> Trainer:
    return Trainer(
        model, optimizer, clip_grad_norm=1.0, precision=setup.dtype, tokens_per_step=setup.tokens,
        flops_per_token=flops, peak_flops=_peak(setup), callbacks=callbacks,
    )  # fmt: skip


def _loom_loop(setup: Setup, model: GPT, budget_s: float) -> dict:
    """loom's Trainer on the same model: the non-finite skip and clipping on the device, no sync a step."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, **_kernels(setup))
    trainer = _trainer(setup, model, optimizer, _flops_per_token(model))
    batch = [_batch(setup)]
    last = []
    result = _throughput(
        setup, model, _timed(setup, lambda: last.append(trainer.train_step(batch)), budget_s)
    )
    result["last_loss"] = last[-1].loss  # read once, after the timing
    result["skipped_steps"] = sum(m.skipped for m in last)
    result |= _compile_counters()
    return result


def part_loom_dtensor(setup: Setup, budget_s: float) -> dict:
    """The GPT as `loom train` builds it: semi-auto on a 1-rank mesh (DTensor parameters), materialised on
    the device, trained by the Trainer."""
    mesh = loom.init({"dp": 1}, device=setup.device.type)
    with torch.device("meta"):
        model = GPT(setup.config, Strategies(1, 1), mesh=mesh)
    ids, targets = _batch(setup)
    # the job's dry run sees its example batch as the loader gives it: on the CPU
    loom.parallelize(model, mode="semi_auto", example_inputs=model.shard_inputs(ids.cpu(), targets.cpu()))
    model.loom.materialize(model, setup.device)
    model.init_weights(0)
    flops = _flops_per_token(model)
    optimizer = make_optimizer(model, torch.optim.AdamW, 0, lr=1e-4, **_kernels(setup))
    trainer = _trainer(setup, model, optimizer, flops)
    batch = [(ids, targets)]
    return _throughput(setup, model, _timed(setup, lambda: trainer.train_step(batch), budget_s))


# The reads of a tensor's value into Python: on a GPU each waits for the device.
READS = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__", "numpy")


@contextlib.contextmanager
def count_reads(counts: Counter):
    """Count into `counts` every read of a tensor's value into Python (`READS`, by name) while inside: on
    a CPU, the reads that would each wait for a GPU (tests/test_gpu_path.py uses it too)."""
    originals = {name: getattr(torch.Tensor, name) for name in READS}

    def counted(name: str):
        def read(self, *args, **kwargs):
            counts[name] += 1
            return originals[name](self, *args, **kwargs)

        return read

    for name in READS:
        setattr(torch.Tensor, name, counted(name))
    try:
        yield counts
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


@contextlib.contextmanager
def _no_sync_allowed(device: torch.device, counts: Counter):
    """On a GPU, a CUDA call that synchronises and that sync debug mode watches raises; on a CPU, every
    read of a tensor is counted (`count_reads`)."""
    if device.type != "cuda":
        with count_reads(counts):
            yield
        return
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def part_sync_free(setup: Setup, models: Models, budget_s: float) -> dict:
    """Steps between logged steps must not wait for the device; a logged step reads its metrics once. The
    Trainer has `loom train`'s callbacks (`loom.train.job.step_callbacks`: the metrics logger, the
    heartbeat, the non-finite guard with a checkpoint directory) and takes its batches on the CPU, as the
    data loader gives them (moved through pinned memory)."""
    from loom.train.config import TrainConfig
    from loom.train.metrics import MetricsLogger
    from loom.train.report import ReportedCheckpointer

    model = models.plain()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, **_kernels(setup))
    every = 4  # steps 2 and 3 are not logged: neither may read the device
    with tempfile.TemporaryDirectory() as root:
        config = TrainConfig.from_dict(
            {"train": {"log_every": every, "steps": every}, "checkpoint": {"dir": root}}
        )
        logger = MetricsLogger(None, is_main=True, total_steps=every, log_every=every, console=False)
        checkpointer = ReportedCheckpointer.from_config(config)  # saves at the end only: never here
        callbacks = step_callbacks(config, logger, checkpointer, None)
        trainer = _trainer(setup, model, optimizer, _flops_per_token(model), callbacks)
        ids, targets = _batch(setup)
        batch = [(ids.cpu(), targets.cpu())]  # views of one tensor, as the loader's shifted pairs are
        trainer.train_step(batch)  # the first step builds the optimizer's state (the host decides it)
        counts: Counter = Counter()
        with _no_sync_allowed(setup.device, counts):
            pending = [trainer.train_step(batch) for _ in range(every - 2)]
        if counts:
            raise AssertionError(f"steps between logs read the device: {dict(counts)}")
        logged = trainer.train_step(batch).to_dict()  # the logged step's read
    return {
        "steps_without_sync": len(pending), "callbacks": [type(c).__name__ for c in callbacks],
        "loss": logged["loss"], "grad_norm": logged["grad_norm"],
    }  # fmt: skip


def part_checkpoint(setup: Setup, budget_s: float) -> dict:
    """A Trainer on the device saved and loaded into a fresh one: the same values, back on the device, and
    the parameters after the next step of both the same (a resumed fused optimizer steps with its state
    where it was: a state lost or misplaced moves them by about the learning rate)."""
    from loom.checkpoint import load_checkpoint, save_checkpoint

    small = GPTConfig(
        vocab_size=256, d_model=64, n_layers=2, n_heads=4, max_seq_len=32, attention_kernel="sdpa"
    )
    tiny = Setup(small, 2, setup.device, setup.dtype, 0, 1, False, {})

    def build(seed: int) -> Trainer:
        torch.manual_seed(seed)
        with torch.device(setup.device):
            model = GPT(small)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, **_kernels(setup))
        return _trainer(tiny, model, optimizer, _flops_per_token(model))

    saved = build(0)
    saved.train_step([_batch(tiny)])
    with tempfile.TemporaryDirectory() as root:
        save_checkpoint(root, saved)
        loaded = build(1)  # other weights, to be overwritten
        step = load_checkpoint(root, loaded)
    devices = {str(p.device) for p in loaded.model.parameters()}
    state_devices = {
        str(v.device)
        for s in loaded.optimizer.state.values()
        for k, v in s.items()
        if torch.is_tensor(v) and k != "step"
    }
    expected = {str(torch.empty(0, device=setup.device).device)}
    equal = all(
        torch.equal(a, b)
        for a, b in zip(saved.model.state_dict().values(), loaded.model.state_dict().values(), strict=True)
    )
    if devices != expected or state_devices != expected or not equal or step != 1:
        raise AssertionError(
            f"loaded step {step}, parameters on {devices}, optimizer states on {state_devices}, equal {equal}; "
            f"expected step 1 on {expected}"
        )
    following = [trainer.train_step([_batch(tiny, seed=1)]).loss for trainer in (saved, loaded)]
    apart = max(
        (a - b).abs().max().item()
        for a, b in zip(saved.model.parameters(), loaded.model.parameters(), strict=True)
    )
    # one AdamW step moves a weight by about lr (1e-3); the same state, by the same amount to rounding
    if following[0] != following[1] or apart > 1e-5:
        raise AssertionError(
            f"the step after loading differs from the saved run's: losses {following}, parameters apart by "
            f"up to {apart:.3g} after it"
        )
    return {
        "step": step,
        "parameters_on": sorted(devices),
        "states_on": sorted(state_devices),
        "next_loss": following[0],
        "parameters_apart_after_next_step": apart,
    }


def part_environment(setup: Setup, budget_s: float) -> dict:
    info = {
        "torch": torch.__version__, "cuda": torch.version.cuda, "device": str(setup.device),
        "python": sys.version.split()[0], "peak_flops": _peak(setup), "dtype": setup.dtype,
        "model": {k: v for k, v in vars(setup.config).items()}, "batch": setup.batch, "tokens_per_step": setup.tokens,
    }  # fmt: skip
    if setup.device.type == "cuda":
        props = torch.cuda.get_device_properties(setup.device)
        info |= {
            "device_name": props.name, "memory_gib": props.total_memory / GIB,
            "multiprocessors": props.multi_processor_count, "capability": f"{props.major}.{props.minor}",
            "flash_sdp": torch.backends.cuda.flash_sdp_enabled(),
        }  # fmt: skip
    return info


def _timed_op(device: torch.device, fn: Callable[[], object], repeats: int = 10) -> float:
    """Median seconds of `fn` on `device` (CUDA events on a GPU), after two warm-up runs."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def _plan(setup: Setup) -> ParallelPlan:
    """One device, the whole batch as one micro-batch, flash attention, no recomputation, level 0."""
    return ParallelPlan(
        global_batch=setup.batch, micro_batch=setup.batch, seq=setup.config.max_seq_len, flash_attention=True,
        dtype=setup.dtype,
    )  # fmt: skip


def part_profile(setup: Setup, out: Path, budget_s: float) -> dict:
    """This device measured as the simulator prices it; written to out/profile.json."""
    device, dtype = setup.device, DTYPES[setup.dtype]
    model = transformer_config(setup.config)
    shapes = gemm_shapes(model, _plan(setup))
    points, rows = [], []
    for m, k, n in shapes:  # a linear layer's three GEMMs per step, as loom.cost.calibrate times them
        x, w, dy = (torch.randn(a, b, device=device, dtype=dtype) for a, b in ((m, k), (n, k), (m, n)))
        seconds = _timed_op(device, lambda x=x, w=w, dy=dy: (x @ w.t(), dy @ w, dy.t() @ x))
        rate = 3 * 2 * m * k * n / seconds
        points.append(((m, k, n), rate))
        rows.append({"shape": [m, k, n], "tflops": rate / 1e12})
        del x, w, dy
    peak, knee = fit_matmul(points)
    big = torch.empty(2**28 if device.type == "cuda" else 2**23, device=device)  # 1 GiB on a GPU
    copy = torch.empty_like(big)
    bandwidth = 2 * big.numel() * 4 / _timed_op(device, lambda: copy.copy_(big))
    tiny = torch.ones(1, device=device, requires_grad=True)

    def chain() -> None:
        y = tiny
        for _ in range(100):
            y = y * 1.0
        torch.autograd.grad(y, tiny)

    overhead = _timed_op(device, chain) / (100 * (1 + BACKWARD_BYTES))  # as loom.cost.calibrate counts
    elementwise = _elementwise_bandwidth(setup, dtype)
    c = setup.config
    q = torch.randn(setup.batch, c.n_heads, c.max_seq_len, c.head_dim, device=device, dtype=dtype)
    attention_s = _timed_op(
        device, lambda: torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
    )
    s = c.max_seq_len
    attention_flops = 4.0 * s * c.head_dim * s * setup.batch * c.n_heads * CAUSAL_SHARE
    attention_efficiency = min(1.0, attention_flops / attention_s / (peak * (s / (s + knee)) ** 2))
    memory_gib = (
        torch.cuda.get_device_properties(device).total_memory / GIB if device.type == "cuda" else 16.0
    )
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    measured = Device(
        name=f"measured {name}", peak_flops={setup.dtype: peak}, memory_gib=memory_gib,
        memory_bandwidth=bandwidth, matmul_efficiency=1.0, matmul_knee=knee,
        attention_efficiency=max(attention_efficiency, 1e-3), memory_efficiency=min(1.0, elementwise / bandwidth),
        kernel_overhead_s=overhead, reserved_gib=0.0,
    )  # fmt: skip
    link = Link(name="none (one device)", bandwidth=1e12, latency_s=0.0, efficiency=1.0)
    cluster = Cluster(
        device=measured, intra=link, inter=link, gpus_per_node=1, gpus=1,
        notes="measured by benchmarks/gpu_step.py at the benchmark model's GEMM shapes",
    )  # fmt: skip
    save_cluster(cluster, out / "profile.json")
    return {
        "peak_tflops": peak / 1e12, "matmul_knee": knee, "memory_bandwidth_gbs": bandwidth / 1e9,
        "kernel_overhead_us": overhead * 1e6, "attention_efficiency": attention_efficiency,
        "elementwise_bandwidth_gbs": elementwise / 1e9, "matmuls": rows,
        "file": str(out / "profile.json"),
    }  # fmt: skip


def _elementwise_bandwidth(setup: Setup, dtype: torch.dtype) -> float:
    """Bytes/s that a step's elementwise kernels (GELU, softmax, layer norm; forward and backward) reach on
    activations of the model's size, their bytes counted as `loom.cost.layer` counts them (the share of the
    copy's bandwidth they reach is the profile's `memory_efficiency`, as `loom bench` measures it)."""
    elements = min(setup.tokens * setup.config.d_model, 2**26)
    x = torch.randn(elements // 1024, 1024, device=setup.device, dtype=dtype, requires_grad=True)
    grad = torch.randn_like(x)
    ops = (F.gelu, lambda t: torch.softmax(t, -1), lambda t: F.layer_norm(t, t.shape[-1:]))

    def run() -> None:
        for op in ops:
            torch.autograd.grad(op(x), x, grad)

    moved = len(ops) * (1 + BACKWARD_BYTES) * 2 * x.numel() * x.element_size()
    return moved / _timed_op(setup.device, run)


def part_simulate(setup: Setup, out: Path, budget_s: float) -> dict:
    """The simulator's step time and peak memory for the benchmark's plan on the h100-sxm profile and on
    the measured one (when the profile part wrote it)."""
    model, plan = transformer_config(setup.config), _plan(setup)
    profiles = {"h100-sxm": get_cluster("h100-sxm", gpus=1)}
    if (out / "profile.json").is_file():
        profiles["measured"] = get_cluster(str(out / "profile.json"), gpus=1)
    predicted = {}
    for name, cluster in profiles.items():
        result = simulate(model, plan, cluster)
        reserved = cluster.device.reserved_gib
        predicted[name] = {
            "step_s": result.iteration_s, "mfu": result.mfu,
            "memory_gib": result.memory_per_device_gib, "reserved_gib": reserved,
            "memory_breakdown_gib": result.memory_breakdown_gib,
        }  # fmt: skip
    return predicted


def _equivalence_config() -> GPTConfig:
    return GPTConfig(
        vocab_size=64, d_model=32, n_layers=2, n_heads=4, max_seq_len=16, attention_kernel="sdpa"
    )


EQ_STEPS, EQ_BATCH, EQ_LR = 4, 8, 3e-3


def _eq_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    config = _equivalence_config()
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(
        0, config.vocab_size, (EQ_STEPS, EQ_BATCH, config.max_seq_len + 1), generator=generator
    )
    return [(step[:, :-1], step[:, 1:]) for step in ids]


def _eq_train(model, device: torch.device, rows, level: int) -> tuple[list[float], list[float]]:
    optimizer = make_optimizer(
        model, torch.optim.AdamW, level, lr=EQ_LR, weight_decay=0.1, eps=1e-3, betas=(0.9, 0.95), fused=True
    )
    trainer = Trainer(model, optimizer, clip_grad_norm=0.5)
    assert trainer.device.type == device.type, (trainer.device, device)
    results = [trainer.train_step([(rows(ids), rows(targets))]) for ids, targets in _eq_batches()]
    return [r.loss for r in results], [r.grad_norm for r in results]


# (dp, tp, optimizer level): tensor parallel, then level 1 (each rank steps an fp32 chunk on the device),
# then level 3
EQ_LAYOUTS = ((1, 2, 0), (2, 1, 1), (2, 1, 3))


def equivalence_case(device_setting: str) -> dict:
    """One rank of the sharded runs (inside `loom.launch`), every layout of `EQ_LAYOUTS` in turn: its
    losses, norms and whole parameters, and where its parameters lived; or the error of a layout that
    failed (the other still runs)."""
    from loom.dist import env

    device = env.resolve_device(device_setting)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    results = {}
    for dp, tp, level in EQ_LAYOUTS:
        name = f"dp{dp}_tp{tp}_level{level}"
        try:
            results[name] = _equivalence_layout(device, dp, tp, level)
        except Exception as error:  # recorded per layout: one GPU run must tell as much as it can
            results[name] = {"error": f"{type(error).__name__}: {error}"[:2000]}
    return results


def _equivalence_layout(device: torch.device, dp: int, tp: int, level: int) -> dict:
    """This rank's run of one layout of `equivalence_case`."""
    mesh = loom.init({"dp": dp, "tp": tp}, device=device.type)
    torch.manual_seed(0)
    model = GPT(_equivalence_config(), Strategies(dp, tp)).to(device)
    rows = lambda t: t.chunk(dp)[mesh.dp_rank()]  # noqa: E731
    ids, targets = _eq_batches()[0]
    loom.parallelize(model, mode="semi_auto", example_inputs=(rows(ids).to(device), rows(targets).to(device)))
    on_device = {str(p.device) for p in model.parameters()}  # a DTensor's: its local shard's
    losses, norms = _eq_train(model, device, rows, level)
    with model.loom.full_parameters():
        params = {name: loom.full(p).detach().cpu().clone() for name, p in model.named_parameters()}
    return {"losses": losses, "norms": norms, "params": params, "devices": sorted(on_device)}


def run_equivalence(device_setting: str, out: Path) -> int:
    """Two ranks sharing this machine's device against one device; writes out/equivalence.json."""
    from loom.dist import env

    device = env.resolve_device(device_setting)
    torch.manual_seed(0)
    reference = GPT(GPTConfig(**{**vars(_equivalence_config()), "attention_kernel": "matmul"})).to(device)
    expected, expected_norms = _eq_train(reference, device, lambda t: t, 0)
    reference_params = {name: p.detach().cpu() for name, p in reference.named_parameters()}
    ranks = loom.launch(equivalence_case, 2, device_setting, backend="gloo", timeout=600)
    cases, passed = {}, True
    for name in ranks[0]:
        errors = [rank[name]["error"] for rank in ranks if "error" in rank[name]]
        if errors:
            passed = False
            cases[name] = {"passed": False, "error": errors[0]}
            continue
        worst = {"loss": 0.0, "norm": 0.0, "param_abs": 0.0}
        for rank in ranks:
            run = rank[name]
            for got, want, key in ((run["losses"], expected, "loss"), (run["norms"], expected_norms, "norm")):
                worst[key] = max(worst[key], max(abs(a / b - 1) for a, b in zip(got, want, strict=True)))
            worst["param_abs"] = max(
                worst["param_abs"],
                max((run["params"][n] - p).abs().max().item() for n, p in reference_params.items()),
            )
        # fp32 on both sides; rounding differs by reduction order (GPU kernels: 1e-4 relative, generous)
        ok = worst["loss"] <= 1e-4 and worst["norm"] <= 1e-4 and worst["param_abs"] <= 1e-4
        passed &= ok
        cases[name] = {"passed": ok, **worst, "devices": ranks[0][name]["devices"]}
    result = {"passed": passed, "device": str(device), "backend": "gloo", "cases": cases}
    (out / "equivalence.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(cases))
    return 0 if passed else 1


def part_equivalence(setup: Setup, out: Path, budget_s: float) -> dict:
    setting = "cuda" if setup.device.type == "cuda" else "cpu"
    command = [sys.executable, str(Path(__file__).resolve()), "--equivalence", setting, "--out", str(out)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=max(budget_s, 30))
    except subprocess.TimeoutExpired as error:
        raise AssertionError(f"the 2-rank equivalence run took more than {error.timeout:.0f} s") from None
    path = out / "equivalence.json"
    if not path.is_file():
        raise AssertionError(
            f"the 2-rank run wrote no result (exit {done.returncode}): {done.stderr[-3000:]}"
        )
    result = json.loads(path.read_text())
    if not result["passed"]:
        raise AssertionError(f"2 ranks on one {setting} device differ from one device: {result['cases']}")
    return result


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def summary(parts: dict) -> tuple[str, dict]:
    """The one table (text) and its figures: each part's status, then the ratios the issue's goals read."""
    lines = [f"{'part':<16} {'status':<8} {'tokens/s':>12} {'MFU':>7} {'step s':>9} {'peak GiB':>9}  note"]
    for name, entry in parts.items():
        status = entry["status"]
        cells = ("", "", "", "")
        if status == "ok" and "tokens_per_s" in entry:
            memory = entry.get("peak_memory_gib")
            cells = (
                f"{entry['tokens_per_s']:,.0f}", f"{100 * entry['mfu']:.1f}%", f"{entry['step_s']:.4f}",
                f"{memory:.2f}" if memory is not None else "-",
            )  # fmt: skip
        note = entry.get("reason") or entry.get("error", "")
        lines.append(
            f"{name:<16} {status:<8} {cells[0]:>12} {cells[1]:>7} {cells[2]:>9} {cells[3]:>9}  {note[:90]}"
        )

    def figure(part: str, key: str) -> float | None:
        entry = parts.get(part, {})
        return entry.get(key) if entry.get("status") == "ok" else None

    sim = parts.get("simulate", {}) if parts.get("simulate", {}).get("status") == "ok" else {}
    ratios = {
        "loom_over_plain_mfu_eager": _ratio(figure("loom_eager", "mfu"), figure("plain_eager", "mfu")),
        "loom_over_plain_mfu_compiled": _ratio(
            figure("loom_compiled", "mfu"), figure("plain_compiled", "mfu")
        ),
        "loom_dtensor_over_plain_mfu_eager": _ratio(
            figure("loom_dtensor", "mfu"), figure("plain_eager", "mfu")
        ),
        "loom_mfu_compiled": figure("loom_compiled", "mfu"),
    }
    for profile, predicted in sim.items():
        if not isinstance(predicted, dict):
            continue
        for run in ("loom_eager", "loom_compiled"):
            ratios[f"predicted_over_measured_step_{profile}_{run}"] = _ratio(
                predicted["step_s"], figure(run, "step_s")
            )
        # the simulator's memory includes the runtime's reserve; max_memory_allocated does not
        ratios[f"predicted_over_measured_memory_{profile}"] = _ratio(
            predicted["memory_gib"] - predicted["reserved_gib"], figure("loom_eager", "peak_memory_gib")
        )
    lines.append("")
    goals = {
        "loom_over_plain_mfu_eager": ">= 0.97", "loom_over_plain_mfu_compiled": ">= 0.97",
        "loom_mfu_compiled": ">= 0.45 (H100)",
    }  # fmt: skip
    for key, value in ratios.items():
        goal = goals.get(key, "within 0.90..1.10" if key.startswith("predicted") else "")
        shown = "-" if value is None else f"{value:.3f}"
        lines.append(f"{key:<58} {shown:>8}  {goal}")
    return "\n".join(lines), ratios


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="directory for results.json, table.txt, profile.json")
    parser.add_argument("--smoke", action="store_true", help="a tiny model, every part, in seconds (CPU)")
    parser.add_argument(
        "--batch", type=int, default=4, help="sequences per step of the 1.3B model (default 4)"
    )
    parser.add_argument(
        "--budget-s", type=float, default=480.0, help="the whole run's time budget (default 480)"
    )
    gpu_deps.add_argument(parser)  # read before torch loads (gpu_deps.ensure_from_argv); listed for --help
    parser.add_argument("--equivalence", metavar="DEVICE", help=argparse.SUPPRESS)  # the subprocess's entry
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.equivalence:
        return run_equivalence(args.equivalence, out)
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    elif not args.smoke:
        print("gpu_step: no GPU here; the 1.3B model needs one (use --smoke on a CPU)", file=sys.stderr)
        return 2
    setup = smoke_setup(device) if args.smoke else full_setup(device, args.batch)
    caption = f"{setup.batch} x {setup.config.max_seq_len} tokens a step, {setup.dtype}"
    report, models = Report(out, args.budget_s, caption), Models(setup)
    budgets = setup.budgets
    report.run("environment", budgets["environment"], lambda b: part_environment(setup, b))
    report.run("equivalence", budgets["equivalence"], lambda b: part_equivalence(setup, out, b))
    report.run("sync_free", budgets["sync_free"], lambda b: part_sync_free(setup, models, b))
    report.run("checkpoint", budgets["checkpoint"], lambda b: part_checkpoint(setup, b))
    report.run("plain_eager", budgets["plain_eager"], lambda b: _plain_loop(setup, models.plain(), b))
    report.run("loom_eager", budgets["loom_eager"], lambda b: _loom_loop(setup, models.plain(), b))
    # before compiling, whose time is the least certain: the simulator's side of the table comes first
    report.run("profile", budgets["profile"], lambda b: part_profile(setup, out, b))
    report.run("simulate", budgets["simulate"], lambda b: part_simulate(setup, out, b))
    report.run("plain_compiled", budgets["plain_compiled"], lambda b: _plain_loop(setup, models.compile(), b))
    report.run("loom_compiled", budgets["loom_compiled"], lambda b: _loom_loop(setup, models.compile(), b))
    models._plain = None  # the DTensor model needs the memory (compiled code may hold the old one)
    torch._dynamo.reset()
    report.run("loom_dtensor", budgets["loom_dtensor"], lambda b: part_loom_dtensor(setup, b))
    print(report.write())
    return 0


if __name__ == "__main__":
    sys.exit(main())
