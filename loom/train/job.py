"""The main job, `loom train CONFIG.toml`: one file that builds and runs a whole training run.

In order: join the mesh the config asks for; build the GPT on the meta device with its tensor-parallel
strategies; parallelise it (parameters laid out from a dry run) and materialise only this rank's shards;
set recomputation, the optimizer at its optimizer level, the learning-rate schedule and the Trainer; read
this data-parallel rank's rows of every global batch; resume from the newest intact checkpoint; train,
log, evaluate, checkpoint (and save the final step); finally sample from the model and, on the arithmetic
task, measure its accuracy. `loom train` runs `run` under `loom.fault.supervise`, which restarts it after a
failure; each step sends a heartbeat so that a hung rank is noticed.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Sequence

import torch

import loom
from loom.checkpoint import Checkpointer
from loom.dist import env
from loom.dist.launch import heartbeat
from loom.fault import Fault, NonFiniteGuard, apply_rollback
from loom.models.gpt import GPT, GPTConfig, Strategies
from loom.parallel import make_optimizer
from loom.recompute import recompute
from loom.train.config import TrainConfig
from loom.train.data import ArithmeticCorpus, ByteTokenizer, DistributedBatches, build_dataset, micro_batches
from loom.train.hardware_peaks import peak_flops
from loom.train.metrics import MetricsCallback, MetricsLogger, model_flops_per_token
from loom.train.precision import DTYPES, DynamicLossScaler
from loom.train.schedules import lr_multiplier
from loom.train.trainer import Trainer


def build_model(config: TrainConfig, mesh: loom.Mesh, example: tuple) -> GPT:
    """The GPT of `[model]`, laid out on `mesh`, with only this rank's shards materialised."""
    par = config.parallel
    known = {f.name for f in dataclasses.fields(GPTConfig)}
    gpt = GPTConfig(**{key: value for key, value in vars(config.model).items() if key in known})
    with torch.device("meta"):
        model = GPT(gpt, Strategies(mesh.dp_size, par.tp, par.sequence_parallel))
    loom.parallelize(model, mode="semi_auto", example_inputs=example)
    model.loom.materialize(model, "cpu")
    model.init_weights(config.train.seed)
    for block in model.blocks:
        recompute(block, par.recompute)
    return model


class Heartbeat:
    """Trainer callback: report each step to the supervisor (see `loom.dist.launch.heartbeat`)."""

    def on_train_begin(self, trainer: Trainer) -> None:
        heartbeat(trainer.step)

    def on_step_end(self, trainer: Trainer, metrics: object) -> None:
        heartbeat(trainer.step)


def build_trainer(config: TrainConfig, model: GPT, callbacks: list) -> Trainer:
    """Optimizer (at the configured optimizer level), schedule, loss scaling and the Trainer (reporting
    throughput and MFU against this device's peak)."""
    t = config.train
    if t.optimizer == "adamw":
        optimizer_class, hyper = torch.optim.AdamW, {"betas": tuple(t.betas), "weight_decay": t.weight_decay}
    else:
        optimizer_class, hyper = torch.optim.SGD, {"momentum": t.momentum, "weight_decay": t.weight_decay}
    optimizer = make_optimizer(model, optimizer_class, config.parallel.optimizer_level, lr=t.lr, **hyper)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lr_multiplier(t.schedule, t.warmup_steps, t.steps, t.min_lr / t.lr)
    )
    scaler = DynamicLossScaler(scale=t.loss_scale_init, growth_interval=t.loss_scale_growth_interval)
    flops_per_token = model_flops_per_token(
        model.num_parameters(exclude_embeddings=True), config.model.n_layers, config.model.d_model,
        config.data.seq_len,
    )  # fmt: skip
    return Trainer(
        model, optimizer, lr_scheduler=schedule, grad_accum=t.grad_accum, clip_grad_norm=t.clip_grad_norm,
        precision=t.precision, loss_scaler=scaler if t.precision == "fp16" else None, callbacks=callbacks,
        tokens_per_step=t.global_batch * config.data.seq_len, flops_per_token=flops_per_token,
        peak_flops=peak_flops(env.device_type(), DTYPES[t.precision]),
        skip_nonfinite=config.fault.skip_nonfinite,
    )  # fmt: skip


@torch.no_grad()
def generate(model: GPT, mesh: loom.Mesh, prompt: str, max_new_tokens: int) -> str:
    """Greedy continuation of `prompt` (every data-parallel rank decodes the same prompt)."""
    tokenizer = ByteTokenizer()
    ids = tokenizer.encode(prompt)
    multiple = model.strategies.tp if model.strategies.sequence_parallel else 1
    for _ in range(max_new_tokens):
        # pad on the right to a length the sequence cut divides; causality keeps padding out of the answer
        padded = ids + [0] * (-len(ids) % multiple)
        window = torch.tensor([padded[-model.config.max_seq_len :]])
        logits = loom.full(model(window))
        ids.append(int(logits[0, min(len(ids), model.config.max_seq_len) - 1].argmax()))
    return tokenizer.decode(ids[len(tokenizer.encode(prompt)) :])


def run(config: TrainConfig, faults: Sequence[Fault] = ()) -> dict:
    """Train as `config` says, inside a worker of `loom.launch` or `loom.fault.supervise`; returns the
    summary (losses of the steps this attempt ran). `faults` are injected on purpose (tests of recovery)."""
    env.ensure_process_group()  # joined already in loom's workers; under torchrun, joined here
    mesh = loom.init(config.parallel.mesh_sizes(loom.world_size()))
    config.validate(mesh.world_size)
    t, is_main = config.train, loom.rank() == 0
    torch.manual_seed(t.seed)
    dataset = build_dataset(config.data)
    batches = DistributedBatches(dataset, t.global_batch, mesh.dp_rank(), mesh.dp_size, seed=t.seed)
    # the dry run's example batch comes from a copy of the loader, so training still starts at batch 0
    example = DistributedBatches(dataset, t.global_batch, mesh.dp_rank(), mesh.dp_size, seed=t.seed)
    first = next(iter(example))
    model = build_model(config, mesh, tuple(first))
    logger = MetricsLogger(
        t.metrics_file, is_main=is_main, total_steps=t.steps, log_every=t.log_every,
        tensorboard_dir=t.tensorboard_dir,
    )  # fmt: skip
    checkpointer = Checkpointer.from_config(config, batches) if config.checkpoint.dir else None
    callbacks = [MetricsCallback(logger), Heartbeat()]
    if checkpointer is not None:
        if config.fault.rollback_after:  # before the checkpointer: a failing streak is never saved
            callbacks.append(NonFiniteGuard(config.fault.rollback_after, config.checkpoint.dir, batches))
        callbacks.append(checkpointer)
    trainer = build_trainer(config, model, callbacks)
    if checkpointer is not None:
        resumed = checkpointer.resume(trainer)  # from the newest intact checkpoint, data position included
        if apply_rollback(config.checkpoint.dir, resumed, batches) and is_main:
            print("rolled back: skipping the data of the steps that were not finite", flush=True)
    for fault in faults:
        fault.install(trainer)
    if is_main:
        print(plan_text(config, model), flush=True)
    steps = (micro_batches(next(batches), t.grad_accum) for _ in iter(int, 1))
    start = time.perf_counter()
    results = trainer.fit(
        steps, t.steps - trainer.step, t.eval_every, lambda: _eval_batches(config, mesh)
    )  # a resumed run does the steps left
    if checkpointer is not None and checkpointer.last_saved_step != trainer.step:
        checkpointer.save(trainer)  # the final state, whatever the period
    losses = [r.loss for r in results]
    summary = {"losses": losses, "seconds": time.perf_counter() - start}
    if isinstance(dataset, ArithmeticCorpus):
        summary.update(_arithmetic_report(dataset, model, mesh))
    return summary


def _eval_batches(config: TrainConfig, mesh: loom.Mesh) -> list[tuple]:
    """Held-out batches: the same kind of data drawn with another seed (the same on every run)."""
    data = build_dataset(config.data.__class__(**{**vars(config.data), "seed": config.data.seed + 10_000}))
    batches = DistributedBatches(data, config.train.global_batch, mesh.dp_rank(), mesh.dp_size, seed=1)
    return [tuple(next(batches)) for _ in range(config.train.eval_batches)]


def _arithmetic_report(corpus: ArithmeticCorpus, model: GPT, mesh: loom.Mesh) -> dict:
    samples = [
        (p, a, generate(model, mesh, p, corpus.max_answer_tokens)) for p, a in corpus.prompts(8, seed=7)
    ]
    accuracy = corpus.accuracy(lambda p, n: generate(model, mesh, p, n), n=100, seed=7)
    return {"samples": samples, "accuracy": accuracy}


def plan_text(config: TrainConfig, model: GPT) -> str:
    """The plan: mesh, every parameter's layout and local shape, optimizer level, recomputation."""
    state = model.loom
    par = config.parallel
    lines = [
        f"plan: {state.mesh}, optimizer level {par.optimizer_level}, recompute {par.recompute}, "
        f"sequence parallel {'on' if par.sequence_parallel else 'off'}, precision {config.train.precision}",
        f"model: {model.num_parameters() / 1e6:.2f}M parameters, {config.model.n_layers} layers, "
        f"d_model {config.model.d_model}, {config.model.n_heads} heads",
    ]
    names, shape = state.mesh.device_mesh.mesh_dim_names, state.mesh.canonical_shape
    for name, param in model.named_parameters():
        layout = state.parameter_layouts[name].describe(names, shape)
        lines.append(
            f"  {name:32s} {tuple(param.shape)!s:14s} {layout:26s} local {tuple(param.to_local().shape)}"
        )
    return "\n".join(lines)


def steps_summary(losses: list[float]) -> str:
    """First and last losses, as one line."""
    head = sum(losses[:10]) / min(10, len(losses))
    tail = sum(losses[-10:]) / min(10, len(losses))
    return f"loss {head:.3f} (first 10 steps) -> {tail:.3f} (last 10 steps)" + (
        "" if math.isfinite(tail) else " (not finite!)"
    )
