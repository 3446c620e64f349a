"""The Trainer's step: fp16 overflow skipping, clipping against torch's clip_grad_norm_, recomputation."""

import copy

import torch
import torch.nn.functional as F
from torch import nn

import loom
from loom.dist.context import unsharded
from loom.models import MLP
from loom.models.gpt import GPT, GPTConfig, Strategies
from loom.parallel import make_optimizer
from loom.recompute import recompute
from loom.train import Callback, DynamicLossScaler, Trainer


class Regression(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = MLP(6, 16, 3, depth=2)

    def forward(self, x, y):
        return F.mse_loss(self.net(x), y)


def overflow_case(level):
    loom.init()
    torch.manual_seed(0)
    model = loom.parallelize(Regression(), mode="data_parallel")
    optimizer = make_optimizer(model, torch.optim.AdamW, level, lr=1e-2)
    trainer = Trainer(model, optimizer, precision="fp16", loss_scaler=DynamicLossScaler(scale=1024.0))
    generator = torch.Generator().manual_seed(loom.rank())
    batch = (torch.randn(4, 6, generator=generator), torch.randn(4, 3, generator=generator))
    trainer.train_step([batch])
    poison = {"on": True}
    weight = model.net[0].weight
    # an overflow on rank 1 only, in one gradient
    handle = weight.register_hook(lambda g: g * float("inf") if poison["on"] and loom.rank() == 1 else g)

    def snapshot():  # at level 3 parameters are sharded at rest: read them gathered
        with model.loom.full_parameters():
            return [p.detach().clone() for p in model.parameters()]

    before = snapshot()
    skipped = trainer.train_step([batch])
    unchanged = all(torch.equal(a, b) for a, b in zip(before, snapshot(), strict=True))
    handle.remove()
    after = trainer.train_step([batch])
    moved = not all(torch.equal(a, b) for a, b in zip(before, snapshot(), strict=True))
    return skipped.skipped, skipped.loss_scale, unchanged, after.skipped, moved


def test_fp16_overflow_on_one_rank_skips_the_step_everywhere(dist_run):
    for level in (0, 2, 3):
        for skipped, scale, unchanged, skipped_after, moved in dist_run(2, overflow_case, level):
            assert skipped and unchanged and scale == 512.0  # every rank skipped; the scale halved
            assert not skipped_after and moved  # the next good step updates again


def clipping_case(dp, tp, level):
    config = GPTConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, max_seq_len=16)
    ids = torch.randint(0, 64, (4, 17), generator=torch.Generator().manual_seed(0))
    batch = (ids[:, :-1], ids[:, 1:])
    reference = GPT(config)
    with unsharded():
        reference(*batch).backward()
    expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm=0.1).item()
    clipped = {name: p.grad for name, p in reference.named_parameters()}
    mesh = loom.init({"dp": dp, "tp": tp})
    model = GPT(config, Strategies(dp, tp))
    rows = lambda t: t.chunk(dp)[mesh.dp_rank()]  # noqa: E731
    loom.parallelize(model, mode="semi_auto", example_inputs=tuple(map(rows, batch)))
    trainer = Trainer(model, make_optimizer(model, torch.optim.SGD, level, lr=1.0), clip_grad_norm=0.1)
    start = {name: loom.full(p).detach().clone() for name, p in model.named_parameters()}
    norm = trainer.train_step([tuple(map(rows, batch))]).grad_norm
    # SGD with lr 1 moves each parameter by exactly its clipped gradient
    steps = {name: (start[name] - loom.full(p)) for name, p in model.named_parameters()}
    error = max((steps[name] - clipped[name]).abs().max().item() for name in clipped)
    return expected, norm, error


def test_clipping_equals_clip_grad_norm_on_one_device(dist_run):
    for dp, tp, level in ((2, 2, 0), (4, 1, 2), (1, 4, 1)):
        for expected, norm, error in dist_run(4, clipping_case, dp, tp, level):
            assert abs(norm - expected) <= 1e-5 * expected, (dp, tp, level, norm, expected)
            assert error < 1e-6, (dp, tp, level, error)


class Counting(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return torch.tanh(self.linear(x))


def test_recompute_runs_the_forward_again_in_backward():
    for policy, calls in (("none", 1), ("full", 2), ("selective", 2)):
        block = recompute(Counting(), policy)
        reference = copy.deepcopy(block)
        x = torch.randn(4, 8, requires_grad=True)
        block(x).sum().backward()
        assert block.calls == calls, policy
        assert isinstance(block, Counting) and "linear.weight" in block.state_dict()
        assert reference.calls == 0


def bf16_case():
    config = GPTConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, max_seq_len=16)
    ids = torch.randint(0, 64, (3, 4, 17), generator=torch.Generator().manual_seed(0))
    batches = [(b[:, :-1], b[:, 1:]) for b in ids]

    def run(model, rows):
        trainer = Trainer(model, torch.optim.AdamW(model.parameters(), lr=3e-3), precision="bf16")
        return [trainer.train_step([tuple(map(rows, batch))]).loss for batch in batches]

    with unsharded():
        expected = run(GPT(config), lambda t: t)
    mesh = loom.init({"dp": 2, "tp": 2})
    model = GPT(config, Strategies(2, 2, True))
    rows = lambda t: t.chunk(2)[mesh.dp_rank()]  # noqa: E731
    loom.parallelize(model, mode="semi_auto", example_inputs=tuple(map(rows, batches[0])))
    dtypes = set()
    model.blocks[0].mlp.register_forward_hook(lambda _m, _a, out: dtypes.add(out.dtype))
    return expected, run(model, rows), dtypes


def test_bf16_autocast_on_a_parallel_gpt(dist_run):
    for expected, losses, dtypes in dist_run(4, bf16_case):
        assert dtypes == {torch.bfloat16}  # matmuls ran in bf16, master weights stay fp32
        # bf16 rounds partial sums differently than one device: agreement to bf16 precision, not bitwise
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=2e-2, atol=0)


class Recorder(Callback):
    def __init__(self):
        self.events = []

    def on_train_begin(self, trainer):
        self.events.append("begin")

    def on_step_end(self, trainer, metrics):
        self.events.append(("step", metrics.step, metrics.tokens, metrics.mfu is not None))

    def on_eval_end(self, trainer, results):
        self.events.append(("eval", trainer.step, sorted(results)))

    def on_train_end(self, trainer):
        self.events.append("end")


def test_fit_calls_the_callbacks_with_step_metrics_and_evaluations():
    torch.manual_seed(0)
    model = Regression()
    recorder = Recorder()
    trainer = Trainer(
        model, torch.optim.SGD(model.parameters(), lr=0.1), callbacks=[recorder],
        tokens_per_step=4, flops_per_token=1e3, peak_flops=1e9,
    )  # fmt: skip
    batch = (torch.randn(4, 6), torch.randn(4, 3))
    batches = iter([[batch]] * 3)
    results = trainer.fit(batches, 3, eval_every=2, eval_batches=lambda: [batch])
    assert [r.step for r in results] == [1, 2, 3] and results[-1].loss < results[0].loss
    assert recorder.events == [
        "begin", ("step", 1, 4, True), ("step", 2, 4, True), ("eval", 2, ["loss"]), ("step", 3, 4, True), "end"
    ]  # fmt: skip
