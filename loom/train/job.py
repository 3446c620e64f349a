"""The main job, `loom train CONFIG.toml`: one file that builds and runs a whole training run.

In order: join the mesh the config asks for; build the GPT on the meta device with its tensor-parallel
strategies; parallelise it (parameters laid out from a dry run) and materialise only this rank's shards;
set recomputation, the optimizer at its optimizer level, the learning-rate schedule and the Trainer; read
this data-parallel rank's rows of every global batch; resume from the newest intact checkpoint; train,
log, evaluate, checkpoint (and save the final step); finally sample from the model and, on the arithmetic
task, measure its accuracy. With `parallel.pp > 1` the GPT is instead cut into pipeline stages balanced by
blocks, each rank materialises only its own stages, and the `Trainer` runs the schedule; its
checkpoints hold the whole model's parameter names, so they load on any other split or on one device; the
samples come from the whole model gathered once training ends (see `check_pipeline` for what pipelines
still reject). With `[model] hf_config` or `hf_pretrained` the model is a Hugging Face causal LM instead
(`build_hf_model`: data parallel at tp = 1, its family's Megatron module plan at tp > 1, its sequences cut
over cp by a Plan, the samples then decoded by a one-device copy; with pp > 1 built whole on every rank and
cut into stages by its family's recipe, `build_pipeline`); on any data but the
arithmetic task the job ends by continuing a few training prompts greedily, decoded by `data.tokenizer`.
`loom train` runs `run` under `loom.fault.supervise`, which restarts it after a failure; each start-up phase
(`STARTUP_PHASES`) and each step sends a heartbeat, so that a rank that hangs, before its first step as well
as later, is noticed.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

import loom
from loom.dist import elastic, env
from loom.dist.context import unsharded, use_mesh
from loom.dist.launch import heartbeat
from loom.fault import Fault, NonFiniteGuard, apply_rollback
from loom.layout.parameters import materialize
from loom.layout.tensor_layout import TensorLayout
from loom.models import hf
from loom.models.gpt import GPT, GPTConfig, Strategies
from loom.models.recipes import find_blocks, tensor_plan
from loom.parallel import make_optimizer
from loom.parallel.pipeline import (
    BlockStage,
    Pipeline,
    gpt_pipeline,
    gpt_stages,
    model_pipeline,
    split_model,
    stage_indices,
    stage_parameters,
    whole_gpt,
    whole_model,
)
from loom.plan import Plan
from loom.recompute import recompute
from loom.train.config import TrainConfig
from loom.train.data import (
    ArithmeticCorpus,
    ByteTokenizer,
    DistributedBatches,
    build_dataset,
    load_tokenizer,
    micro_batches,
)
from loom.train.device import compile_blocks, device_setting, model_device, optimizer_kernels
from loom.train.hardware_peaks import peak_flops
from loom.train.metrics import MetricsCallback, MetricsLogger, model_flops_per_token
from loom.train.precision import DTYPES, DynamicLossScaler
from loom.train.replicas import (
    data_position,
    join_replicas,
    replica_group,
    replica_mesh,
    replica_optimizer,
    replica_plan_text,
    replicas_mesh_sizes,
    whole_replica_model,
)
from loom.train.report import ReportedCheckpointer, group_layouts, main_rank_warnings
from loom.train.schedules import lr_multiplier
from loom.train.trainer import Trainer


def gpt_config(config: TrainConfig) -> GPTConfig:
    """The model's `GPTConfig` from `[model]`."""
    return config.model.gpt_config()


def build_model(
    config: TrainConfig, mesh: loom.Mesh, example: tuple, device: torch.device | str = "cpu"
) -> GPT:
    """The GPT of `[model]`, laid out on `mesh` (the run's, or a replica's own: `loom.train.replicas`), with
    only this rank's shards materialised on `device` (its experts cut over `parallel.ep` data-parallel
    ranks), its blocks compiled with `train.compile`."""
    par = config.parallel
    strategies = Strategies(
        mesh.dp_size, par.tp, par.sequence_parallel, par.ep, cp=par.cp, attention=par.attention
    )
    with torch.device("meta"):
        model = GPT(gpt_config(config), strategies, mesh=mesh)
    loom.parallelize(model, mode="semi_auto", example_inputs=model.shard_inputs(*example))
    model.loom.materialize(model, device)
    model.init_weights(config.train.seed)
    for block in model.blocks:
        recompute(block, par.recompute)
    if config.train.compile:
        compile_blocks(model, list(model.blocks))
    return model


def build_hf_model(config: TrainConfig, mesh: loom.Mesh, device: torch.device | str = "cpu") -> nn.Module:
    """The Hugging Face causal LM of `[model]`, made parallel on `mesh`: tensor parallel with its family's
    Megatron module plan when `parallel.tp > 1`, its experts cut over `parallel.ep` data-parallel ranks when
    `ep > 1` (Mixtral: `loom.parallel.experts`), each replica's sequences cut over `parallel.cp` ranks by
    `parallel.attention` when `cp > 1` (`loom.parallel.hf_context`), else data parallel. `hf_config`: random
    weights seeded by `train.seed`; `hf_pretrained`: built without weights, laid out, then each rank reads
    its own slices. Its parameters live on `device`; its blocks are compiled with `train.compile`. The
    model is then trained as `model(inputs, targets) -> loss` (`loom.models.hf.train_on_token_pairs`)."""
    par = config.parallel
    if config.model.hf_pretrained is not None and (par.tp > 1 or par.ep > 1):
        # laid out on the meta device: each rank allocates and reads its shards alone
        model = _parallelize_hf(hf.empty_model(config.model.hf_model_config()), par)
        model.loom.materialize(model, device)
        hf.load_weights(model, config.model.hf_pretrained)
    else:  # every rank holds the whole model, then replicates it (or lays it out)
        model = _parallelize_hf(whole_hf_model(config).to(device), par)
    if par.recompute != "none":
        for block in find_blocks(model)[1]:
            recompute(block, par.recompute)
    if config.train.compile:
        compile_blocks(model)
    return hf.train_on_token_pairs(model)


def whole_hf_model(config: TrainConfig) -> nn.Module:
    """The whole Hugging Face causal LM of `[model]` on this process: `hf_config`'s with random weights
    seeded by `train.seed` (the same on every rank), or `hf_pretrained`'s weights read one tensor at a time."""
    model_config = config.model.hf_model_config()
    if config.model.hf_pretrained is None:
        return hf.build_model(model_config, config.train.seed)
    model = hf.empty_model(model_config)
    materialize(model, "cpu")
    hf.load_weights(model, config.model.hf_pretrained)
    return model


def _parallelize_hf(model: nn.Module, par: object) -> nn.Module:
    """`model` made parallel as `[parallel]` says (`par`): data parallel, its recipe's tensor plan, or a Plan
    whose ep cuts the experts and whose cp cuts the sequences, as its family's recipe says."""
    tp, ep, cp = par.tp, par.ep, par.cp
    if tp == 1 and ep == 1 and cp == 1:
        return loom.parallelize(model, mode="data_parallel")
    if ep == 1 and cp == 1:
        return loom.parallelize(model, mode="semi_auto", module_plan=tensor_plan(model))
    # each rank of a replica brings its whole sequences: the plan's cp cuts them in a pre-hook
    # (`loom.parallel.hf_context`); its tensor plan lays out the rest
    strategies = tensor_plan(model) if tp > 1 or ep > 1 else {}
    plan = Plan(tp=tp, ep=ep, cp=cp, attention=par.attention, strategies=strategies)
    return loom.parallelize(model, plan=plan)


def check_pipeline(config: TrainConfig) -> None:
    """With `parallel.pp > 1`: a ValueError for each setting that pipelines refuse (the rules live in
    `TrainConfig.check_pipeline`, which `loom train` runs before it starts the workers)."""
    config.check_pipeline()


def check_faults(config: TrainConfig, faults: Sequence[Fault]) -> None:
    """The injected `faults` this job can honour (a ValueError otherwise; checked before workers start)."""
    _startup_faults(faults)
    if config.parallel.pp > 1 and any(fault.during == "step" for fault in faults):
        raise ValueError(
            "LOOM_FAULTS: faults during a step hook the model's forward, which pipeline runs (parallel.pp > 1) "
            'do not call yet; use during="save" or "startup", or parallel.pp = 1'
        )


def build_pipeline(config: TrainConfig, mesh: loom.Mesh) -> tuple[nn.Module, Pipeline]:
    """The model of `[model]` cut into `pp x virtual` stages (`parallel.stages` blocks each, else balanced by
    blocks), and this rank's part of the pipeline. loom's GPT is built on the meta device and only this rank's stages are materialised
    (initialised as the whole model would be; `gpt_pipeline`). A Hugging Face model is built whole on every
    rank (`whole_hf_model`), then cut by its family's recipe (`model_pipeline`): the other ranks' stages go
    to the meta device, and the last stage's loss is the model's own on targets already shifted. With
    `parallel.tp > 1` each stage is laid out tensor-parallel on its own dp x tp ranks (the GPT by its
    strategies, a Hugging Face model by its recipe's Megatron module plan)."""
    par = config.parallel
    virtual = par.virtual_stages
    if config.model.is_hf:
        model = whole_hf_model(config)
        pipeline = model_pipeline(
            model, mesh, schedule=par.schedule, microbatches=par.microbatches, virtual=virtual,
            loss_fn=hf.shifted_causal_lm_loss, split=_split(par), ep=par.ep,
        )  # fmt: skip
    else:
        with torch.device("meta"):
            strategies = Strategies(
                mesh.dp_size, par.tp, par.sequence_parallel, par.ep, cp=par.cp, attention=par.attention
            )
            model = GPT(gpt_config(config), strategies, mesh=mesh)
        pipeline = gpt_pipeline(
            model, mesh, schedule=par.schedule, microbatches=par.microbatches, virtual=virtual,
            seed=config.train.seed, split=_split(par),
        )  # fmt: skip
    for stage in pipeline.modules:
        for block in stage.blocks:
            recompute(block, par.recompute)
        if config.train.compile:
            compile_blocks(stage, list(stage.blocks))
    return model, pipeline


def all_stages(config: TrainConfig, model: nn.Module) -> list[BlockStage]:
    """Every stage of the pipeline `build_pipeline` builds from `model`, in stage order (the plan's text
    lists them by pipeline rank): the blocks cut into `pp x virtual` stages as `parallel.stages` says, or
    evenly."""
    par = config.parallel
    count = par.pp * par.virtual_stages
    if isinstance(model, GPT):
        return gpt_stages(model, count, _split(par))
    return split_model(model, count, split=_split(par))


def _split(par: object) -> list[int] | None:
    """`parallel.stages`: blocks per stage, or None for even stages."""
    return list(par.stages) if par.stages is not None else None


# What `run` does before its first step, in order; each phase begins with a heartbeat, so each must take less
# than `fault.heartbeat_timeout_s` (start-up faults name one: `Fault(during="startup", phase=...)`).
STARTUP_PHASES = (
    "joining the mesh",
    "loading the data",
    "building the model",
    "building the trainer",
    "loading the checkpoint",
    "joining the replicas",  # a replacement among replicas that come and go (loom.dist.elastic)
)


def _startup_faults(faults: Sequence[Fault]) -> list[Fault]:
    """The faults that strike in a start-up phase (a ValueError for a phase `run` does not have)."""
    startup = [fault for fault in faults if fault.during == "startup"]
    for fault in startup:
        if fault.phase not in STARTUP_PHASES:
            raise ValueError(
                f"{fault}: unknown start-up phase {fault.phase!r}; choose one of {STARTUP_PHASES}"
            )
    return startup


def _phase(name: str) -> None:
    """Announce start-up phase `name` to the supervisor (a heartbeat; where start-up faults strike)."""
    assert name in STARTUP_PHASES, name
    heartbeat(phase=name)


class Heartbeat:
    """Trainer callback: report each step to the supervisor (see `loom.dist.launch.heartbeat`)."""

    def on_train_begin(self, trainer: Trainer) -> None:
        heartbeat(trainer.step)

    def on_step_end(self, trainer: Trainer, metrics: object) -> None:
        heartbeat(trainer.step)


def step_callbacks(
    config: TrainConfig, logger: MetricsLogger, checkpointer: ReportedCheckpointer | None, batches: object
) -> list:
    """The callbacks of `loom train`'s Trainer, in their order: the metrics logger, the heartbeat, and with
    a checkpoint directory the non-finite guard (when `fault.rollback_after`) before the checkpointer, so
    that a failing streak is never saved. The guard reads its device count only where the run reads the
    device anyway: a logged step, a step before a save. `batches`: the data loader (its position goes into
    checkpoints and rollbacks)."""
    callbacks = [MetricsCallback(logger), Heartbeat()]
    if checkpointer is None:
        return callbacks
    if config.fault.rollback_after:
        reads_at = lambda step: logger.should_log(step) or checkpointer.due(step)  # noqa: E731
        callbacks.append(
            NonFiniteGuard(config.fault.rollback_after, config.checkpoint.dir, batches, reads_at)
        )
    return [*callbacks, checkpointer]


def build_trainer(
    config: TrainConfig,
    model: nn.Module,
    callbacks: list,
    pipeline: Pipeline | None = None,
    mesh: loom.Mesh | None = None,
    membership: elastic.Membership | None = None,
) -> Trainer:
    """Optimizer (at the configured optimizer level), schedule, loss scaling and the Trainer (reporting
    throughput and MFU against this device's peak); with `pipeline` (this rank's stages of `model`), the
    optimizer holds the stages' parameters and the Trainer runs the schedule. `mesh`: the run's whole mesh
    (default: the current one); with `parallel.sync` other than every step, the optimizer becomes the inner
    one of the replicas' `LocalSGD` or `DiLoCo` over its "replica" axis (`loom.train.replicas`), working
    on this rank's parameters (its stages' with a pipeline), the schedule still on it; with `membership`
    (replicas that come and go), over that instead."""
    t = config.train
    if t.optimizer == "adamw":
        optimizer_class, hyper = (
            torch.optim.AdamW,
            {"betas": tuple(t.betas), "eps": t.eps, "weight_decay": t.weight_decay},
        )
    else:
        optimizer_class, hyper = torch.optim.SGD, {"momentum": t.momentum, "weight_decay": t.weight_decay}
    level = config.parallel.optimizer_level
    # a pipeline's optimizer: over this rank's stages, sharded over the ranks that run them
    parts = model if pipeline is None else pipeline
    device = model_device(model if pipeline is None else nn.ModuleList(pipeline.modules))
    # fused kernels on a GPU (and the Trainer's non-finite skip on the device), foreach on a CPU
    hyper |= optimizer_kernels(device)
    optimizer = make_optimizer(parts, optimizer_class, level, lr=t.lr, **hyper)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lr_multiplier(t.schedule, t.warmup_steps, t.steps, t.min_lr / t.lr)
    )
    mesh = mesh or loom.current_mesh()
    group = None  # the step's loss and norm over every rank
    if config.parallel.replicas_step_alone:
        optimizer = replica_optimizer(config, parts, optimizer, mesh, membership)
        group = replica_group(mesh)
    scaler = DynamicLossScaler(scale=t.loss_scale_init, growth_interval=t.loss_scale_growth_interval)
    flops_per_token = model_flops_per_token(
        flop_parameters(model), config.model.n_layers, config.model.d_model,
        config.data.seq_len,
    )  # fmt: skip
    options = dict(
        lr_scheduler=schedule, grad_accum=config.accumulation, clip_grad_norm=t.clip_grad_norm,
        precision=t.precision, loss_scaler=scaler if t.precision == "fp16" else None, callbacks=callbacks,
        tokens_per_step=t.global_batch * config.data.seq_len, flops_per_token=flops_per_token,
        peak_flops=peak_flops(device.type, DTYPES[t.precision]),
        skip_nonfinite=config.fault.skip_nonfinite,
        seed=t.seed, mesh=mesh,  # generators per step and rank on the whole mesh (pp included)
        group=group,
    )  # fmt: skip
    if pipeline is not None:  # checkpoints see the stages' parameters under the whole model's names
        named = stage_parameters(model, pipeline.modules, pipeline.full_parameters)
        return Trainer(pipeline, optimizer, named_as=named, **options)
    return Trainer(model, optimizer, **options)


def flop_parameters(model: nn.Module) -> int:
    """The parameters one token multiplies with, the `N` of `model_flops_per_token`'s `6 N`: all but the
    input embeddings (a lookup: the token table, learned positions), with the output head counted also when
    it is tied to the token table (its logits cost 2 V d FLOPs per token forward: Megatron-LM's and
    torchtitan's convention); of a mixture's experts (loom's GPT), the `top_k` a token uses. `model`: loom's
    GPT or a Hugging Face causal LM."""
    if isinstance(model, GPT):
        tied = model.embedding.numel() if model.config.tie_embeddings else 0
        return model.num_parameters(exclude_embeddings=True, active=True) + tied
    head, table = model.get_output_embeddings(), model.get_input_embeddings()
    tied = head is not None and table is not None and head.weight is table.weight
    return model.num_parameters(exclude_embeddings=True) + (head.weight.numel() if tied else 0)


@torch.no_grad()
def generate(model: nn.Module, prompts: list[str], max_new_tokens: int) -> list[str]:
    """Greedy continuations of `prompts` in byte tokens, decoded as one batch (every data-parallel rank
    brings the same prompts)."""
    tokenizer = ByteTokenizer()
    encoded = [tokenizer.encode(prompt) for prompt in prompts]
    return [tokenizer.decode(ids) for ids in generate_batch(model, encoded, max_new_tokens)]


@torch.no_grad()
def generate_batch(model: nn.Module, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """The ids a causal LM (loom's GPT or a Hugging Face model) picks greedily after each of `prompts`, as
    one batch decoded by every rank of its mesh at once (each data-parallel rank brings the same prompts;
    logits are gathered whole)."""
    device = model_device(model)  # the prompts' ids go where the model computes
    if isinstance(model, GPT):
        multiple = model.strategies.tp if model.strategies.sequence_parallel else 1
        return hf.greedy(
            lambda x: loom.full(model(x.to(device))),
            prompts,
            max_new_tokens,
            model.config.max_seq_len,
            multiple,
        )
    window = model.config.max_position_embeddings
    return hf.greedy(
        lambda x: loom.full(model(input_ids=x.to(device)).logits), prompts, max_new_tokens, window
    )


def _text_samples(config: TrainConfig, dataset: object, model: nn.Module, count: int = 3) -> dict:
    """Greedy continuations of the first tokens of the first `count` training windows, as text (decoded by
    `data.tokenizer`, else as bytes); token files without a tokenizer show ids."""
    prompt_len = max(1, min(8, config.data.seq_len // 2))
    decode = _decoder(config)
    prompts = [dataset[index][0][:prompt_len].tolist() for index in range(min(count, len(dataset)))]
    continuations = generate_batch(model, prompts, prompt_len)
    samples = [(decode(p), decode(c)) for p, c in zip(prompts, continuations, strict=True)]
    return {"text_samples": samples}


def _decoder(config: TrainConfig):  # noqa: ANN202  (ids -> str)
    if config.data.tokenizer is not None:
        tokenizer = load_tokenizer(config.data.tokenizer)
        return lambda ids: tokenizer.decode(ids, skip_special_tokens=False)
    if config.data.kind == "tokens":
        return lambda ids: " ".join(map(str, ids))
    return ByteTokenizer().decode


def run(config: TrainConfig, faults: Sequence[Fault] = (), *, verbose: bool = False) -> dict:
    """Train as `config` says, inside a worker of `loom.launch` or `loom.fault.supervise`; returns the
    summary (losses of the steps this attempt ran, from `first_step`). `faults` are injected on purpose
    (tests of recovery). Rank 0 prints the plan (every parameter with `verbose`, else one line per layout
    pattern) and each warning; the other ranks' warnings are silenced (`main_rank_warnings`)."""
    # joined already in loom's workers; under torchrun, joined here with the backend of `train.device`
    env.ensure_process_group(env.backend_for(device_setting(config)))
    slot = elastic.membership_slot()  # a replica that may come and go: a process group of its own
    with main_rank_warnings((loom.rank() if slot is None else slot[0]) == 0):
        return _run(config, faults, verbose)


def _run(config: TrainConfig, faults: Sequence[Fault], verbose: bool) -> dict:
    disarm = [fault.install() for fault in _startup_faults(faults)]  # first: they strike in the phases below
    _phase("joining the mesh")
    # where this rank computes (`train.device`): its mesh's tensors, its model and its batches live there
    device = env.resolve_device(device_setting(config))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    membership = elastic.membership()
    if membership is not None:  # each replica its own process group of one; they meet through the store
        config.validate(membership.size)
        check_faults(config, faults)
        mesh = loom.init({"dp": 1})
        with use_mesh(None):
            return _train(config, faults, verbose, mesh, disarm, membership, model_mesh=None, device=device)
    # the run's Plan: [parallel], its plan file, or the planner's choice (made before the workers started);
    # replicas stepping alone lie on an outermost "replica" axis, each with the plan's axes inside
    replicas, world = config.parallel.replicas_step_alone, loom.world_size()
    sizes = replicas_mesh_sizes(config, world) if replicas else config.plan(world).mesh_sizes()
    mesh = loom.init(sizes, device=device.type)
    config.validate(mesh.world_size)  # the pipeline rules included (`TrainConfig.check_pipeline`)
    check_faults(config, faults)
    if not replicas:
        return _train(config, faults, verbose, mesh, disarm, model_mesh=mesh, device=device)
    inner = replica_mesh(mesh)
    with use_mesh(inner):  # each replica computes on its own ranks alone
        return _train(config, faults, verbose, mesh, disarm, model_mesh=inner, device=device)


def _train(
    config: TrainConfig,
    faults: Sequence[Fault],
    verbose: bool,
    mesh: loom.Mesh,
    disarm: list,
    membership: elastic.Membership | None = None,
    *,
    model_mesh: loom.Mesh | None,
    device: torch.device,
) -> dict:
    """The rest of `_run` once the mesh is joined: data, model, trainer, checkpoint, training, report.
    `membership`: this replica's slot among replicas that come and go (its data rank), else None.
    `model_mesh`: the mesh the model is laid out on: the run's, a replica's own (`replica_mesh`), or None
    for a replica of one process. `device`: this rank's (`train.device` resolved by `_run`)."""
    # the rank's data position: its dp index over every replica, or its slot among replicas that come and go
    dp_rank, dp_size = data_position(mesh) if membership is None else (membership.rank, membership.size)
    t, is_main = config.train, (loom.rank() if membership is None else membership.rank) == 0
    replicas = config.parallel.replicas_step_alone
    torch.manual_seed(t.seed)
    _phase("loading the data")
    dataset = build_dataset(config.data)
    batches = DistributedBatches(dataset, t.global_batch, dp_rank, dp_size, seed=t.seed)
    pipeline = None
    _phase("building the model")
    if config.parallel.pp > 1:
        model, pipeline = build_pipeline(config, model_mesh)
    elif config.model.is_hf:
        model = build_hf_model(config, model_mesh, device)
    elif model_mesh is None:  # a replica of one process: the whole GPT on it
        model = whole_replica_model(config)
    else:
        # the dry run's example batch comes from a copy of the loader, so training still starts at batch 0
        example = DistributedBatches(dataset, t.global_batch, dp_rank, dp_size, seed=t.seed)
        model = build_model(config, model_mesh, tuple(next(iter(example))), device)
    logger = MetricsLogger(
        t.metrics_file, is_main=is_main, total_steps=t.steps, log_every=t.log_every,
        tensorboard_dir=t.tensorboard_dir,
    )  # fmt: skip
    checkpointer = ReportedCheckpointer.from_config(config, batches) if config.checkpoint.dir else None
    callbacks = step_callbacks(config, logger, checkpointer, batches)
    _phase("building the trainer")
    trainer = build_trainer(config, model, callbacks, pipeline, mesh=mesh, membership=membership)
    if checkpointer is not None:
        _phase("loading the checkpoint")
        resumed = checkpointer.resume(trainer)  # from the newest intact checkpoint, data position included
        if apply_rollback(config.checkpoint.dir, resumed, batches) and is_main:
            print("rolled back: skipping the data of the steps that were not finite", flush=True)
    if replicas and trainer.optimizer.inner_steps == 0:  # weights loaded without the replicas' own state
        trainer.optimizer.adopt_params()
    joined_at = None
    if membership is not None and membership.joining:  # a replacement: it enters at the next sync
        _phase("joining the replicas")
        joined_at = join_replicas(trainer, batches, t.steps)
        if joined_at is None:  # the others synced for the last time before it was ready
            return {"losses": [], "first_step": t.steps + 1, "seconds": 0.0, "joined_at": None}
    for undo in disarm:
        undo()
    for fault in faults:
        if fault.during != "startup":
            fault.install(trainer)
    if is_main:
        if replicas:
            text = replica_plan_text(config, model if pipeline is None else pipeline, mesh, membership)
        elif pipeline is None:
            text = plan_text(config, model, verbose)
        else:
            text = pipeline_plan_text(config, model, mesh)
        print(text, flush=True)
    accumulation = config.accumulation
    steps = (micro_batches(_sequence_shards(model, next(batches)), accumulation) for _ in iter(int, 1))
    start, first_step = time.perf_counter(), trainer.step + 1
    results = trainer.fit(
        steps,
        t.steps - trainer.step,
        t.eval_every,
        lambda: [_sequence_shards(model, batch) for batch in _eval_batches(config, mesh)],
    )  # a resumed run does the steps left
    if replicas:
        trainer.optimizer.finish()  # the averages still in flight land
    if checkpointer is not None and checkpointer.last_saved_step != trainer.step:
        checkpointer.tolerant(checkpointer.save, trainer)  # the final state, whatever the period
    losses = [r.loss for r in results]
    summary = {"losses": losses, "first_step": first_step, "seconds": time.perf_counter() - start}
    if membership is not None:
        summary["joined_at"] = joined_at
    if pipeline is not None:
        summary.update(_pipeline_report(config, dataset, model, model_mesh, pipeline))
    elif config.parallel.cp > 1:
        summary.update(_context_parallel_report(config, dataset, model))
    else:
        summary.update(_report(config, dataset, model))
    return summary


def _report(config: TrainConfig, dataset: object, model: nn.Module) -> dict:
    """What the run ends with: the arithmetic samples and accuracy, or greedy continuations of text."""
    if isinstance(dataset, ArithmeticCorpus):
        return _arithmetic_report(dataset, model)
    return _text_samples(config, dataset, model)


def _sequence_shards(model: nn.Module, batch: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """This rank's piece of a local batch's sequences: cut over cp for loom's GPT (whole with cp = 1); a
    Hugging Face model takes its replica's whole sequences and cuts them itself (`loom.parallel.hf_context`)."""
    return tuple(model.shard_inputs(*batch)) if isinstance(model, GPT) else tuple(batch)


def _context_parallel_report(config: TrainConfig, dataset: object, model: nn.Module) -> dict:
    """The report of a context-parallel run (`_report`): sampling grows whole sequences one token at a
    time, which the cp cut of fixed shards cannot, so a one-device copy of the model (its parameters
    gathered whole; a Hugging Face model's tied tables under each of their names) decodes on rank 0, which
    sends its report to the others."""
    with model.loom.full_parameters():
        tensors = (
            model.named_parameters() if isinstance(model, GPT) else model.state_dict(keep_vars=True).items()
        )
        state = {name: loom.full(t).detach() for name, t in tensors}
    report: list[dict | None] = [None]
    if loom.rank() == 0:
        with unsharded():  # the whole model computes on this process alone
            whole = GPT(model.config) if isinstance(model, GPT) else _empty_hf_model(config)
            whole.load_state_dict(state)
            report = [_report(config, dataset, whole)]
    dist.broadcast_object_list(report, src=0)
    return report[0]


def _empty_hf_model(config: TrainConfig) -> nn.Module:
    """The Hugging Face causal LM of `[model]` whole on this process, its parameters allocated but not
    initialised (to load a state into)."""
    model = hf.empty_model(config.model.hf_model_config())
    materialize(model, "cpu")
    return model


def _eval_batches(config: TrainConfig, mesh: loom.Mesh) -> list[tuple]:
    """Held-out batches: the same kind of data drawn with another seed (the same on every run)."""
    data = build_dataset(dataclasses.replace(config.data, seed=config.data.seed + 10_000))
    batches = DistributedBatches(data, config.train.global_batch, *data_position(mesh), seed=1)
    return [tuple(next(batches)) for _ in range(config.train.eval_batches)]


def _arithmetic_report(corpus: ArithmeticCorpus, model: GPT) -> dict:
    pairs = corpus.prompts(8, seed=7)
    answers = generate(model, [p for p, _ in pairs], corpus.max_answer_tokens)
    samples = [(p, a, out) for (p, a), out in zip(pairs, answers, strict=True)]
    accuracy = corpus.accuracy(lambda prompts, n: generate(model, prompts, n), n=100, seed=7)
    return {"samples": samples, "accuracy": accuracy}


def _pipeline_report(
    config: TrainConfig, dataset: object, model: nn.Module, mesh: loom.Mesh, pipeline: Pipeline
) -> dict:
    """The report of a pipeline run (`_report`): the whole model gathered on every rank (sampling runs one
    token at a time, which a schedule of fixed micro-batch shapes cannot), decoded by rank 0 alone and its
    report sent to the others."""
    if isinstance(model, GPT):
        whole = whole_gpt(
            model, pipeline, mesh, schedule=pipeline.schedule_name, virtual=len(pipeline.modules)
        )
    else:
        whole = whole_model(model, pipeline, mesh)
    report: list[dict | None] = [None]
    if loom.rank() == 0:
        with unsharded():  # the whole model computes on this process alone
            report = [_report(config, dataset, whole)]
    dist.broadcast_object_list(report, src=0)
    return report[0]


def plan_text(config: TrainConfig, model: GPT, verbose: bool = False) -> str:
    """The plan: mesh, optimizer level, recomputation, and the parameters' layouts and local shapes: one
    line per layout pattern (how many parameters share it), or per parameter with `verbose`."""
    state = model.loom
    par = config.parallel
    lines = [
        f"plan: {state.mesh}, optimizer level {par.optimizer_level}, recompute {par.recompute}, "
        f"sequence parallel {'on' if par.sequence_parallel else 'off'}, precision {config.train.precision}"
        + (f", experts over ep = {par.ep} data-parallel ranks" if par.ep > 1 else ""),
        f"model: {_model_name(config, model)}{model.num_parameters() / 1e6:.2f}M parameters, "
        f"{config.model.n_layers} layers, d_model {config.model.d_model}, {config.model.n_heads} heads"
        + (f", {config.model.experts} experts top-{config.model.top_k}" if config.model.experts > 1 else ""),
        "parameters" + ("" if verbose else " by layout (loom train --verbose lists each one)") + ":",
    ]
    names, shape = state.mesh.device_mesh.mesh_dim_names, state.mesh.canonical_shape
    rows = [  # a data-parallel model (a Hugging Face one at tp = 1) has every parameter replicated
        (
            name,
            tuple(p.shape),
            state.parameter_layouts.get(name, TensorLayout.replicated(p.ndim)).describe(names, shape),
            tuple(p.to_local().shape if isinstance(p, DTensor) else p.shape),
        )
        for name, p in model.named_parameters()
    ]
    return "\n".join(lines + group_layouts(rows, verbose=verbose))


def _model_name(config: TrainConfig, model: nn.Module) -> str:
    """ "LlamaForCausalLM from PATH, " for a Hugging Face model; nothing for loom's GPT."""
    m = config.model
    return f"{type(model).__name__} from {m.hf_pretrained or m.hf_config}, " if m.is_hf else ""


def pipeline_plan_text(config: TrainConfig, model: nn.Module, mesh: loom.Mesh) -> str:
    """The plan of a pipeline run: mesh, schedule, each pipeline rank's stages (blocks, parameters)."""
    par, virtual = config.parallel, config.parallel.virtual_stages
    m = config.model
    lines = [
        f"plan: {mesh}, pipeline schedule {par.schedule} with {par.microbatches} micro-batches, "
        f"{par.pp * virtual} stages, optimizer level {par.optimizer_level}, recompute {par.recompute}, "
        f"precision {config.train.precision}"
        + (
            f", tensor parallel {par.tp} inside each stage (sequence parallel "
            f"{'on' if par.sequence_parallel else 'off'})"
            if par.tp > 1
            else ""
        ),
        f"model: {_model_name(config, model)}{model.num_parameters() / 1e6:.2f}M parameters, "
        f"{m.n_layers} layers, d_model {m.d_model}, {m.n_heads} heads",
    ]
    every = all_stages(config, model)
    head = "head (a copy of the tied embedding)" if m.tie_embeddings else "head"
    for pp_rank in range(par.pp):
        for k in stage_indices(par.schedule, pp_rank, par.pp, virtual):
            stage = every[k]
            parts = ["embedding"] * stage.first + [f"blocks {stage.block_indices}"] + [head] * stage.last
            count = sum(p.numel() for p in stage.parameters())
            lines.append(f"  pp rank {pp_rank}: {' + '.join(parts)}, {count / 1e6:.3f}M parameters")
    lines.append(
        "with pp > 1: evaluation runs the schedule forward only; samples come from the whole model, gathered "
        "on every rank once training ends"
    )
    return "\n".join(lines)
