"""Tier 1: FLOPs and MFU, hardware peaks, the JSONL metrics logger, callbacks."""

import io
import json
from types import SimpleNamespace

import pytest
import torch

from loom.cost.hardware import PROFILES
from loom.train.hardware_peaks import CPU_PEAK_FLOPS_PER_CORE, dtype_name, peak_flops
from loom.train.metrics import (
    Callback,
    LossMonitor,
    MetricsCallback,
    MetricsLogger,
    StepMetrics,
    mfu,
    model_flops_per_token,
    peak_memory_bytes,
)


def metrics(step: int, loss: float = 2.0, **kw) -> StepMetrics:
    return StepMetrics(step=step, loss=loss, lr=1e-3, tokens=1024, step_time_s=0.5, tokens_per_s=2048.0, **kw)


def test_model_flops_count_the_output_head_tied_or_not():
    """`6 N` counts the output head's weights, which multiply every token (2 V d FLOPs forward), also when
    the head is the token table itself (tied): tied and untied models of one shape count alike; the input
    embeddings (token table lookup, learned positions) are left out."""
    from loom.models.gpt import GPT, GPTConfig
    from loom.train.job import flop_parameters

    shape = dict(vocab_size=64, d_model=16, n_layers=2, n_heads=2, max_seq_len=8)
    tied, untied = GPT(GPTConfig(**shape)), GPT(GPTConfig(**shape, tie_embeddings=False))
    head = 64 * 16
    assert flop_parameters(tied) == tied.num_parameters(exclude_embeddings=True) + head
    assert flop_parameters(untied) == untied.num_parameters(exclude_embeddings=True) == flop_parameters(tied)


def test_model_flops_count_a_tied_hugging_face_head():
    transformers = pytest.importorskip("transformers")
    from loom.train.job import flop_parameters

    shapes = dict(vocab_size=64, n_embd=16, n_layer=1, n_head=2, n_positions=8)
    tied = transformers.GPT2LMHeadModel(transformers.GPT2Config(**shapes))
    untied = transformers.GPT2LMHeadModel(transformers.GPT2Config(**shapes, tie_word_embeddings=False))
    assert (
        flop_parameters(tied)
        == flop_parameters(untied)
        == tied.num_parameters(exclude_embeddings=True) + 64 * 16
    )


def test_flops_formula_numbers():
    # 6 N + 12 L d s: GPT-2 small-like numbers worked by hand.
    assert model_flops_per_token(85_000_000, 12, 768, 1024) == 6 * 85e6 + 12 * 12 * 768 * 1024
    assert model_flops_per_token(1000, 2, 8, 4) == 6000 + 768
    # 1e5 tokens/s * 1e9 FLOP/token = 1e14 FLOP/s over 2 devices of 1e14 peak: 50 %.
    assert mfu(1e5, 1e9, 1e14, n_devices=2) == pytest.approx(0.5)
    assert mfu(1e5, 1e9, None) is None


def test_peak_flops_reuse_the_cost_model_profiles():
    h100 = PROFILES["h100-sxm"].device.peak_flops
    assert peak_flops("cuda", torch.bfloat16, device_name="NVIDIA H100 80GB HBM3") == h100["bf16"]
    assert peak_flops("cuda", torch.float32, device_name="NVIDIA H100 80GB HBM3", tf32=True) == h100["tf32"]
    assert peak_flops("cuda", torch.float16, device_name="NVIDIA A100-SXM4-40GB") == 312e12
    assert peak_flops("cuda", torch.bfloat16, device_name="NVIDIA H200") == PROFILES["h200"].device.peak(
        "bf16"
    )
    assert peak_flops("cuda", torch.float32, device_name="Tesla T4") is None
    assert peak_flops("cpu", torch.float32, cores=4) == 4 * CPU_PEAK_FLOPS_PER_CORE["fp32"]
    assert peak_flops("mps", torch.float32) is None
    with pytest.raises(ValueError, match="no peak FLOP/s for dtype torch.int8"):
        dtype_name(torch.int8)


def test_peak_memory_is_reported_on_cpu():
    assert peak_memory_bytes("cpu") > 10 * 2**20  # at least the interpreter and torch


def test_jsonl_lines_every_log_every_and_the_last(tmp_path):
    path = tmp_path / "logs" / "metrics.jsonl"
    out = io.StringIO()
    with MetricsLogger(path, is_main=True, total_steps=7, log_every=3, stream=out) as logger:
        for step in range(1, 8):
            logger.log(metrics(step, loss=1.0 / step, mfu=0.25, grad_norm=1.5))
        logger.log_eval(7, {"loss": 0.5, "accuracy": 0.75})
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["step"] for r in records] == [3, 6, 7, 7]
    assert records[0] == {"kind": "step", **metrics(3, loss=1 / 3, mfu=0.25, grad_norm=1.5).to_dict()}
    assert records[-1] == {"kind": "eval", "step": 7, "loss": 0.5, "accuracy": 0.75}
    text = out.getvalue()  # not a terminal: plain lines at logged steps
    assert "step 3/7 | loss 0.3333" in text and "mfu 25.0%" in text and "eval step 7 | loss 0.5" in text
    assert "step 4/7" not in text


def test_other_ranks_write_nothing(tmp_path):
    out = io.StringIO()
    logger = MetricsLogger(tmp_path / "m.jsonl", is_main=False, stream=out)
    logger.log(metrics(1))
    logger.log_eval(1, {"loss": 1.0})
    logger.close()
    assert not (tmp_path / "m.jsonl").exists() and out.getvalue() == ""


def test_console_false_is_silent_and_appends(tmp_path):
    path = tmp_path / "m.jsonl"
    out = io.StringIO()
    for _ in range(2):  # a resumed run appends to the same file
        with MetricsLogger(path, is_main=True, console=False, stream=out) as logger:
            logger.log(metrics(1))
    assert len(path.read_text().splitlines()) == 2 and out.getvalue() == ""


def test_tensorboard_is_optional(tmp_path):
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        with pytest.warns(UserWarning, match="TensorBoard is not installed"):
            logger = MetricsLogger(is_main=True, tensorboard_dir=tmp_path / "tb", console=False)
        logger.log(metrics(1))
        logger.close()
        return
    with MetricsLogger(is_main=True, tensorboard_dir=tmp_path / "tb", console=False) as logger:
        logger.log(metrics(1))
    assert any((tmp_path / "tb").iterdir())


class Recorder(Callback):
    def __init__(self) -> None:
        self.calls = []

    def on_train_begin(self, trainer):
        self.calls.append(("begin", trainer.step))

    def on_step_end(self, trainer, metrics):
        self.calls.append(("step", metrics.step))


def test_callbacks_are_called_and_default_to_no_ops(tmp_path):
    trainer = SimpleNamespace(step=0, is_main=True)
    out = io.StringIO()
    path = tmp_path / "m.jsonl"
    logger = MetricsLogger(path, is_main=True, console=False)
    callbacks = [Recorder(), LossMonitor(every=2, stream=out), MetricsCallback(logger)]
    for cb in callbacks:
        cb.on_train_begin(trainer)
    for step in (1, 2, 3, 4):
        trainer.step = step
        for cb in callbacks:
            cb.on_step_end(trainer, metrics(step, loss=float(step)))
    for cb in callbacks:
        cb.on_eval_end(trainer, {"loss": 0.25})
        cb.on_train_end(trainer)
    assert callbacks[0].calls == [("begin", 0), ("step", 1), ("step", 2), ("step", 3), ("step", 4)]
    assert out.getvalue().splitlines() == [
        "step 2 loss 2.0000",
        "step 4 loss 4.0000",
        "step 4 eval loss 0.25",
    ]
    assert len(path.read_text().splitlines()) == 5  # four steps and one evaluation
    assert logger._file is None  # closed at the end of training

    quiet = io.StringIO()
    LossMonitor(every=1, stream=quiet).on_step_end(SimpleNamespace(step=1, is_main=False), metrics(1))
    assert quiet.getvalue() == ""


def test_step_metrics_validation():
    with pytest.raises(ValueError, match="must be >= 0"):
        StepMetrics(step=-1, loss=1.0, lr=0.1)


def test_rich_progress_on_a_terminal(tmp_path):
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    out = Terminal()
    with MetricsLogger(tmp_path / "m.jsonl", is_main=True, total_steps=4, log_every=2, stream=out) as logger:
        for step in range(1, 5):
            logger.log(metrics(step))
        logger.log_eval(4, {"loss": 1.0})
    assert "4/4" in out.getvalue() and "eval step 4" in out.getvalue()
