"""The GPU path, as far as a CPU checks it: the device and backend a rank chooses (`[train] device`), the
GPT's fused attention (`attention_kernel = "sdpa"`), a step that waits for nothing from the device between
logged steps, the non-finite skip on the device (fused optimizers' `found_inf`), compiled blocks, and the
sharded paths (tp = 2, optimizer level 3) with all of these against one device. What needs a GPU
(CUDA kernels, NCCL, two ranks on one GPU) runs in `benchmarks/gpu_step.py`."""

import collections
import io
import json
import math
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from equivalence import ADAMW, RTOL, assert_params_close

import loom
from benchmarks.gpu_step import count_reads
from loom.cli.main import main
from loom.dist import env
from loom.fault import NonFiniteGuard
from loom.models.gpt import GPT, GPTConfig, Strategies
from loom.parallel import make_optimizer
from loom.parallel.grads import any_nonfinite, global_grad_norm
from loom.train import Trainer
from loom.train.config import load_config
from loom.train.device import compile_blocks, device_setting, optimizer_kernels
from loom.train.job import step_callbacks
from loom.train.metrics import MetricsCallback, MetricsLogger, StepMetrics
from loom.train.report import ReportedCheckpointer

STEPS, GLOBAL_BATCH, SEQ = 4, 8, 16
CONFIG = GPTConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, max_seq_len=SEQ)
SDPA = GPTConfig(**{**vars(CONFIG), "attention_kernel": "sdpa"})


def _gpus(monkeypatch, count: int, local_rank: int = 0, local_world: int | None = None) -> None:
    """Pretend this machine has `count` GPUs and this process is local rank `local_rank`."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setenv("LOCAL_RANK", str(local_rank))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local_world or local_rank + 1))


def test_without_a_gpu_auto_is_the_cpu_and_cuda_is_refused(monkeypatch):
    _gpus(monkeypatch, 0)
    assert env.resolve_device("auto") == torch.device("cpu")
    assert env.resolve_device("cpu") == torch.device("cpu")
    assert env.backend_for("auto", 2) == "gloo"
    with pytest.raises(ValueError, match=r"train\.device = 'cuda' but .* sees no GPU.*'auto' or 'cpu'"):
        env.resolve_device("cuda")
    with pytest.raises(ValueError, match=r"train\.device = 'gpu': choose 'auto'"):
        env.resolve_device("gpu")


def test_with_gpus_each_rank_takes_its_own_or_shares_over_gloo(monkeypatch):
    _gpus(monkeypatch, 2, local_rank=1, local_world=2)
    assert env.resolve_device("auto") == torch.device("cuda", 1)
    assert env.backend_for("auto", 2) == "nccl"
    assert env.backend_for("cpu", 2) == "gloo"
    assert env.resolve_device("cpu") == torch.device("cpu")
    # four ranks on two GPUs: auto stays on the CPU; cuda shares the GPUs, over gloo (NCCL refuses that)
    _gpus(monkeypatch, 2, local_rank=3, local_world=4)
    assert env.resolve_device("auto") == torch.device("cpu")
    assert env.resolve_device("cuda") == torch.device("cuda", 1)
    assert env.backend_for("cuda", 4) == "gloo"


def test_pipelines_run_on_the_cpu_and_refuse_cuda_by_name(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('[parallel]\npp = 2\nmicrobatches = 4\n[model]\nn_layers = 2\n[train]\ndevice = "cuda"\n')
    with pytest.raises(ValueError, match=r"train\.device = 'cuda' with parallel\.pp = 2.*'cpu'"):
        device_setting(load_config(str(path), []))
    path.write_text("[parallel]\npp = 2\nmicrobatches = 4\n[model]\nn_layers = 2\n")
    assert device_setting(load_config(str(path), [])) == "cpu"
    path.write_text('[train]\ndevice = "cpu"\n')
    assert device_setting(load_config(str(path), [])) == "cpu"
    assert optimizer_kernels(torch.device("cpu")) == {"foreach": True}
    assert optimizer_kernels(torch.device("cuda", 0)) == {"fused": True}


def test_the_simulator_prices_the_fused_attention_the_config_runs(tmp_path):
    path = tmp_path / "run.toml"
    for kernel, fused in (("matmul", False), ("sdpa", True)):
        path.write_text(f'[model]\nattention_kernel = "{kernel}"\n')
        _, plan = load_config(str(path), []).cost_model(1)
        assert plan.flash_attention is fused


def test_loom_train_refuses_cuda_without_a_gpu_before_starting_workers(monkeypatch, capsys):
    _gpus(monkeypatch, 0)
    assert main(["train", "configs/demo.toml", "--train.device", "cuda"]) == 2
    assert "train.device = 'cuda' but" in capsys.readouterr().err


def _batches(steps: int = STEPS):
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, CONFIG.vocab_size, (steps, GLOBAL_BATCH, SEQ + 1), generator=generator)
    return [(step[:, :-1], step[:, 1:]) for step in ids]


def _same_as_matmul_attention(config: GPTConfig) -> None:
    """`config`'s GPT with the fused attention gives the matmul path's loss and gradients."""
    matmul, fused = GPT(config), GPT(GPTConfig(**{**vars(config), "attention_kernel": "sdpa"}))
    fused.load_state_dict(matmul.state_dict())
    ids, targets = _batches(1)[0]
    losses = [model(ids, targets) for model in (matmul, fused)]
    for loss in losses:
        loss.backward()
    torch.testing.assert_close(losses[1], losses[0], rtol=RTOL, atol=0)
    for (name, a), b in zip(matmul.named_parameters(), fused.parameters(), strict=True):
        torch.testing.assert_close(b.grad, a.grad, rtol=RTOL, atol=1e-7, msg=name)


def test_fused_attention_equals_the_matmul_path():
    _same_as_matmul_attention(CONFIG)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_step_waits_for_the_device_only_when_its_metrics_are_logged(precision):
    """Between logged steps nothing is read back (no `.item()`, no tensor in a Python condition): the
    non-finite check, the clipping and the skip stay on the device; a logged step reads its metrics once."""
    torch.manual_seed(0)
    model = GPT(SDPA)
    optimizer = torch.optim.AdamW(model.parameters(), **ADAMW, fused=True)
    logger = MetricsLogger(None, is_main=True, log_every=3, total_steps=6, stream=io.StringIO())
    trainer = Trainer(
        model, optimizer, clip_grad_norm=0.5, precision=precision, callbacks=[MetricsCallback(logger)]
    )
    batches = _batches(6)
    trainer.train_step([batches[0]])  # the first step builds the optimizer's state
    with count_reads(collections.Counter()) as counts:
        trainer.train_step([batches[1]])  # step 2: not logged
        assert counts == {}, f"a step not logged read the device: {dict(counts)}"
        metrics = trainer.train_step([batches[2]])  # step 3: logged, its metrics read in one go
        assert counts == {"tolist": 1}, dict(counts)
    assert isinstance(metrics.loss, float) and not metrics.skipped and metrics.grad_norm > 0


def test_loom_trains_callbacks_read_the_device_only_at_logged_steps(tmp_path):
    """`loom train`'s callbacks with a checkpoint directory (the non-finite guard among them) and batches
    on the CPU, as the loader gives them: a step not logged reads nothing; a logged one reads its metrics
    and the guard's count."""
    config = load_config(
        None, ["--train.log_every", "3", "--train.steps", "6", "--checkpoint.dir", str(tmp_path)]
    )
    logger = MetricsLogger(None, is_main=True, total_steps=6, log_every=3, console=False)
    callbacks = step_callbacks(config, logger, ReportedCheckpointer.from_config(config), None)
    assert any(isinstance(callback, NonFiniteGuard) for callback in callbacks)
    torch.manual_seed(0)
    model = GPT(SDPA)
    optimizer = torch.optim.AdamW(model.parameters(), **ADAMW, fused=True)
    trainer = Trainer(model, optimizer, clip_grad_norm=0.5, callbacks=callbacks)
    batches = _batches(3)
    trainer.train_step([batches[0]])  # the first step builds the optimizer's state
    with count_reads(collections.Counter()) as counts:
        trainer.train_step([batches[1]])  # step 2: not logged
        assert counts == {}, f"a step not logged read the device: {dict(counts)}"
        trainer.train_step([batches[2]])  # step 3: logged
        assert counts == {"tolist": 2}, dict(counts)  # the metrics and the guard's streak


@pytest.mark.parametrize("fused", [True, False])
def test_a_non_finite_gradient_skips_the_step_on_the_device_or_the_host(fused):
    """A step whose gradient is not finite changes no weight and no optimizer state, decided on the device
    (fused: `found_inf`) or by the host (foreach); the next step trains again."""
    torch.manual_seed(0)
    model = GPT(SDPA)
    optimizer = torch.optim.AdamW(model.parameters(), **ADAMW, **({"fused": True} if fused else {}))
    trainer = Trainer(model, optimizer, clip_grad_norm=0.5)
    batches = _batches(3)
    trainer.train_step([batches[0]])
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    steps_before = [state["step"].clone() for state in optimizer.state.values()]
    handle = model.blocks[0].attention.wq.register_hook(lambda grad: grad * float("inf"))
    skipped = trainer.train_step([batches[1]])
    handle.remove()
    assert skipped.skipped and not math.isfinite(skipped.grad_norm)
    assert (trainer._device_skippers() is not None) == fused  # which path decided
    for name, param in model.named_parameters():
        assert torch.equal(param, before[name]), name
    assert all(torch.equal(s["step"], b) for s, b in zip(optimizer.state.values(), steps_before, strict=True))
    taken = trainer.train_step([batches[2]])
    assert not taken.skipped
    assert not torch.equal(model.blocks[0].attention.wq, before["blocks.0.attention.wq"])


def _train(model, batches, rows, level=0):
    optimizer = make_optimizer(model, torch.optim.AdamW, level, **ADAMW, fused=True)
    trainer = Trainer(model, optimizer, clip_grad_norm=0.5)
    results = [trainer.train_step([(rows(ids), rows(targets))]) for ids, targets in batches]
    return [r.loss for r in results], [r.grad_norm for r in results]


def sharded_case(dp: int, tp: int, level: int):
    """Losses, gradient norms and whole parameters after training the fused-attention GPT with fused AdamW
    on a dp x tp mesh of 2 ranks at optimizer `level`."""
    batches = _batches()
    mesh = loom.init({"dp": dp, "tp": tp})
    model = GPT(SDPA, Strategies(dp, tp))
    rows = lambda t: t.chunk(dp)[mesh.dp_rank()]  # noqa: E731
    loom.parallelize(model, mode="semi_auto", example_inputs=(rows(batches[0][0]), rows(batches[0][1])))
    losses, norms = _train(model, batches, rows, level)
    with model.loom.full_parameters():
        params = {name: loom.full(p).detach().clone() for name, p in model.named_parameters()}
    return losses, norms, params


@pytest.mark.parametrize(("dp", "tp", "level"), [(1, 2, 0), (2, 1, 1), (2, 1, 3)])
def test_sharded_paths_with_fused_kernels_match_one_device(dist_run, dp, tp, level):
    """tp = 2 and optimizer levels 1 and 3, with fused attention and fused AdamW (skipping on the device), equal
    one device running the matmul attention (what benchmarks/gpu_step.py repeats on CUDA tensors)."""
    torch.manual_seed(0)
    reference = GPT(CONFIG)
    expected, expected_norms = _train(reference, _batches(), lambda t: t)
    for losses, norms, params in dist_run(2, sharded_case, dp, tp, level):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=RTOL, atol=0)
        torch.testing.assert_close(torch.tensor(norms), torch.tensor(expected_norms), rtol=RTOL, atol=0)
        assert_params_close(params, dict(reference.named_parameters()), lr=ADAMW["lr"], steps=STEPS)


def _inductor_compiles() -> str | None:
    """Why torch.compile cannot run here (inductor needs a C compiler on a CPU), or None when it can."""
    try:
        torch.compile(lambda x: x * 2 + 1)(torch.ones(2))
    except Exception as error:  # any failure of the toolchain: the test is skipped, saying why
        return f"torch.compile cannot compile on this machine: {type(error).__name__}: {error}"
    return None


@pytest.mark.slow  # inductor compiles two blocks' forward and backward: tens of seconds on 2 cores
def test_compiled_blocks_train_as_eager(tmp_path, monkeypatch):
    """`[train] compile`: the GPT with each block compiled gives eager's losses (inductor fuses and reorders
    fp32 arithmetic: rtol 1e-5) and keeps its parameter names."""
    # inductor's own cache dir, fresh: its shared on-disk cache hands kernels built for another CPU
    # capability to a run under ATEN_CPU_CAPABILITY=avx2 on an AVX-512 machine (NaN losses, torch 2.13)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    reason = _inductor_compiles()
    if reason:
        pytest.skip(reason)
    torch.manual_seed(0)
    eager, compiled = GPT(SDPA), GPT(SDPA)
    compiled.load_state_dict(eager.state_dict())
    assert compile_blocks(compiled) == SDPA.n_layers
    assert compiled.state_dict().keys() == eager.state_dict().keys()
    runs = [_train(model, _batches(3), lambda t: t) for model in (eager, compiled)]
    torch.testing.assert_close(torch.tensor(runs[1][0]), torch.tensor(runs[0][0]), rtol=1e-5, atol=0)
    torch.testing.assert_close(torch.tensor(runs[1][1]), torch.tensor(runs[0][1]), rtol=1e-4, atol=0)


def test_metrics_stay_on_the_device_until_read():
    """A StepMetrics built deferred reads its device values once, on the first read of any of them."""
    reads = []

    def settle():
        reads.append(1)
        return {"loss": 2.5, "grad_norm": 0.5, "skipped": False, "step_time_s": 0.1, "tokens_per_s": 10.0}

    metrics = StepMetrics.deferred(settle, step=1, lr=0.1, tokens=1)
    assert reads == []
    assert metrics.lr == 0.1 and reads == []  # known fields need no read
    assert metrics.loss == 2.5 and metrics.grad_norm == 0.5 and reads == [1]
    assert metrics.to_dict()["tokens_per_s"] == 10.0 and reads == [1]


def test_metrics_settle_early_only_once_their_values_have_arrived():
    """`settle_if_arrived` reads nothing before the values reach the host (on a GPU: their copy's event),
    and never where no arrival can be asked (a CPU run's metrics wait to be read)."""
    reads, arrived = [], [False]

    def settle():
        reads.append(1)
        return {"loss": 2.5, "grad_norm": 0.5, "skipped": False, "step_time_s": 0.1, "tokens_per_s": 10.0}

    metrics = StepMetrics.deferred(settle, step=1, lr=0.1, tokens=1, arrived=lambda: arrived[0])
    assert not metrics.settle_if_arrived() and reads == []
    arrived[0] = True
    assert metrics.settle_if_arrived() and reads == [1]
    assert metrics.settle_if_arrived() and reads == [1] and metrics.loss == 2.5
    never = StepMetrics.deferred(settle, step=2, lr=0.1, tokens=1)
    assert not never.settle_if_arrived() and reads == [1]


@pytest.mark.slow  # two ranks start for the equivalence part: over 10 s on 2 cores
def test_gpu_step_smoke_runs_every_part_and_writes_the_table(tmp_path):
    """`benchmarks/gpu_step.py --smoke` (what the GPU run does, with a tiny model on the CPU): the table and
    the JSON come out, and every part ran or says why not (here only compiling is skipped)."""
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run(
        [sys.executable, str(root / "benchmarks" / "gpu_step.py"), "--smoke", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=600, cwd=root,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    table = (tmp_path / "table.txt").read_text()
    parts = ("environment", "equivalence", "sync_free", "checkpoint", "plain_eager", "loom_eager",
             "plain_compiled", "loom_compiled", "loom_dtensor", "profile", "simulate")  # fmt: skip
    for part in parts:
        entry = results[part]
        assert part in table
        assert entry["status"] in ("ok", "skipped"), (part, entry.get("error"), entry.get("traceback"))
        if entry["status"] == "skipped":
            assert part.endswith("compiled") and "does not compile" in entry["reason"]
    assert results["equivalence"]["passed"] and len(results["equivalence"]["cases"]) == 3
    assert results["loom_eager"]["skipped_steps"] == 0 and math.isfinite(results["loom_eager"]["last_loss"])
    assert results["simulate"]["measured"]["step_s"] > 0  # the profile measured here, priced
    assert (tmp_path / "profile.json").is_file()
    assert results["ratios"]["loom_over_plain_mfu_eager"] > 0


class _Shifted(torch.nn.Module):
    """A linear regression whose loss can be made non-finite by a constant (`poison`) while its gradients
    stay finite."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 1)
        self.poison = 0.0

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return ((self.linear(x) - y) ** 2).mean() + self.poison


def _regression_batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [
        (torch.randn(8, 4, generator=generator), torch.randn(8, 1, generator=generator)) for _ in range(steps)
    ]


@pytest.mark.parametrize("optimizer_class", [torch.optim.SGD, torch.optim.AdamW])
def test_a_non_finite_first_step_leaves_the_fused_optimizer_as_the_foreach_one(optimizer_class):
    """A first step skipped (infinite gradients) and the steps after it: fused kernels give the foreach
    kernels' losses. torch's fused SGD fills its momentum buffers with `empty_like` before a kernel that
    returns at once on `found_inf`: a first step skipped on the device would train on garbage."""
    hyper = {"lr": 0.1, "momentum": 0.9} if optimizer_class is torch.optim.SGD else {"lr": 0.01}
    losses = []
    for kernels in ({"fused": True}, {"foreach": True}):
        torch.manual_seed(0)
        model = _Shifted()
        trainer = Trainer(model, optimizer_class(model.parameters(), **hyper, **kernels))
        handle = model.linear.weight.register_hook(lambda grad: grad * float("inf"))
        first = trainer.train_step([_regression_batches(1)[0]])
        handle.remove()
        assert first.skipped
        losses.append([trainer.train_step([batch]).loss for batch in _regression_batches(4)])
    assert all(math.isfinite(loss) for loss in losses[0]), losses[0]
    torch.testing.assert_close(torch.tensor(losses[0]), torch.tensor(losses[1]), rtol=1e-5, atol=0)


def test_only_optimizers_that_read_found_inf_skip_on_the_device():
    """A fused optimizer class torch's kernels are not known to skip with (a subclass may step otherwise)
    leaves the decision to the host; AdamW and SGD, after their first step, skip on the device."""

    class Stepping(torch.optim.AdamW):
        pass

    for optimizer_class, on_device in ((torch.optim.AdamW, True), (torch.optim.SGD, True), (Stepping, False)):
        model = _Shifted()
        trainer = Trainer(model, optimizer_class(model.parameters(), lr=0.01, fused=True))
        assert trainer._device_skippers() is None  # no step taken yet: the host decides
        trainer.train_step([_regression_batches(1)[0]])
        assert (trainer._device_skippers() is not None) == on_device, optimizer_class


def test_fp16_loss_scale_backs_off_after_a_non_finite_loss_with_a_fused_optimizer():
    """With a loss scaler the host decides the skip: a step whose loss is not finite (its gradients
    finite) backs the scale off, as with any optimizer, rather than counting as a finite step."""
    torch.manual_seed(0)
    model = _Shifted()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, fused=True)
    trainer = Trainer(model, optimizer, precision="fp16")
    batches = _regression_batches(2)
    trainer.train_step([batches[0]])
    scale = trainer.scaler.scale
    model.poison = float("inf")
    skipped = trainer.train_step([batches[1]])
    assert skipped.skipped
    assert trainer.scaler.scale < scale


def test_deferred_metrics_keep_the_step_figures_and_pickle(monkeypatch):
    """What MFU is computed with (here the world size) is taken at the step, not when the metrics are
    read (after the run its process group is gone); deferred metrics pickle as plain numbers."""
    model = _Shifted()
    trainer = Trainer(
        model, torch.optim.SGD(model.parameters(), lr=0.1), tokens_per_step=8, flops_per_token=1e6,
        peak_flops=1e9,
    )  # fmt: skip
    monkeypatch.setattr(env, "world_size", lambda: 4)
    metrics = trainer.train_step([_regression_batches(1)[0]])
    monkeypatch.setattr(env, "world_size", lambda: 1)
    trainer.tokens_per_step = 1
    copy = pickle.loads(pickle.dumps(metrics))
    assert copy.mfu == pytest.approx(metrics.tokens_per_s * 1e6 / (1e9 * 4))
    assert copy.tokens_per_s == pytest.approx(8 / copy.step_time_s)
    assert copy.loss == metrics.loss and math.isfinite(copy.loss)


def test_step_metrics_require_the_loss_and_the_learning_rate():
    with pytest.raises(TypeError, match="loss"):
        StepMetrics(step=1, lr=0.1)
    with pytest.raises(TypeError, match="lr"):
        StepMetrics(step=1, loss=1.0)
    assert StepMetrics(step=1, loss=1.0, lr=0.1).loss == 1.0


def test_a_rank_without_gradients_measures_on_its_device():
    """A rank holding no gradient view still joins the norm's and the finiteness check's all-reduce: on
    the run's device (NCCL reduces GPU tensors only), not on the CPU."""
    assert global_grad_norm([], device="meta").device.type == "meta"
    assert any_nonfinite([], device="meta").device.type == "meta"


def test_fused_attention_with_grouped_query_heads_equals_the_matmul_path():
    """`attention_kernel = "sdpa"` with fewer key/value heads than query heads (grouped-query attention)
    gives the matmul path's loss and gradients."""
    _same_as_matmul_attention(GPTConfig(**{**vars(CONFIG), "n_kv_heads": 2}))


def test_a_part_past_its_hard_limit_is_recorded_failed_even_through_code_that_catches_exception(tmp_path):
    """The benchmark's per-part alarm cannot be swallowed by an `except Exception` inside the part (compile
    and autotuning code has such): the part is stopped and recorded as failed, and the report goes on."""
    import time

    from benchmarks.gpu_step import Report

    def stubborn(budget_s: float) -> dict:
        try:
            time.sleep(30)
        except Exception:  # noqa: BLE001 (what the alarm must pass through)
            time.sleep(30)
        return {}

    report = Report(tmp_path, total_s=60)
    entry = report.run("stubborn", 1.2, stubborn)
    assert entry["status"] == "failed" and "hard time limit" in entry["error"], entry
    assert entry["seconds"] < 10
    assert report.run("next", 5, lambda budget: {"figure": 1})["status"] == "ok"


def test_loom_trains_guard_reads_its_count_before_every_save(tmp_path):
    """The guard's device count is read at logged steps and at every step the checkpointer saves after
    (so that a failing streak is never saved unread), and nowhere else."""
    config = load_config(
        None,
        ["--train.log_every", "5", "--train.steps", "12", "--checkpoint.dir", str(tmp_path),
         "--checkpoint.every_steps", "2"],
    )  # fmt: skip
    logger = MetricsLogger(None, is_main=True, total_steps=12, log_every=5, console=False)
    callbacks = step_callbacks(config, logger, ReportedCheckpointer.from_config(config), None)
    (guard,) = [callback for callback in callbacks if isinstance(callback, NonFiniteGuard)]
    assert callbacks.index(guard) < len(callbacks) - 1  # before the checkpointer
    read = [step for step in range(1, 13) if guard.reads_at(step)]
    assert read == [2, 4, 5, 6, 8, 10, 12]
