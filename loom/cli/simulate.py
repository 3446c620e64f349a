"""`loom simulate`: predict step time, throughput, utilisation and memory of a plan on a cluster.

Three sources of what is priced: a training config (`loom simulate CONFIG.toml`: the model, Plan and batch
`loom train CONFIG.toml` runs, on its `train.workers` devices), a saved Plan (`--plan plan.json` with a
model from the flags), or the flags alone. Each becomes a `loom.plan.Plan`, priced through
`Plan.parallel_plan`.

Replicas joined by a slow link (`--replicas` with the flags, or a config's `[parallel] sync = "local_sgd" |
"diloco"`): the plan priced is one replica's, and `loom.cost.slow_links` sets it against synchronous data
parallelism over the link.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
from dataclasses import asdict, dataclass

from rich.console import Console
from rich.table import Table

from loom.cost.hardware import PROFILES, Cluster, Link, get_cluster
from loom.cost.plan import (
    ATTENTION_KERNELS,
    FP8_SCALINGS,
    GRAD_ACCUMULATIONS,
    GRAD_DTYPES,
    GRAD_REDUCES,
    MASTER_WEIGHTS,
    MOE_DISPATCHERS,
    MOE_SYNCS,
    PRICED_ATTENTIONS,
    PRICED_RECOMPUTE,
    FieldError,
    ParallelPlan,
    light_ends,
)
from loom.cost.slow_links import SlowLinkComparison, compare_sync
from loom.cost.transformer import TransformerConfig
from loom.plan import (
    ATTENTIONS,
    OPTIMIZER_LEVELS,
    PRECISIONS,
    RECOMPUTE,
    SIMULATED_SCHEDULES,
    Plan,
    default_schedule,
)
from loom.sim.presets import PRESETS, get_model, load_model_config
from loom.sim.simulator import BUBBLE_DEFINITION, PlanError, SimResult, simulate
from loom.sim.timeline import MissingDependency, draw_timeline, require_matplotlib
from loom.train.config import TrainConfig, load_config

NAME = "simulate"
TAKES_CONFIG_OVERRIDES = True  # `loom simulate CONFIG.toml --parallel.tp 4`, as `loom train` takes them
HELP = "predict step time, MFU and memory of a parallel plan (no GPU needed)"
DESCRIPTION = f"""\
Simulate one training iteration of a transformer under a parallel plan on a modelled cluster: the pipeline
schedule played as events, tensor/expert/context/data-parallel communication, recomputation and the
optimizer step.

examples:
  loom simulate configs/demo.toml            # the run `loom train configs/demo.toml` makes
  loom simulate configs/demo.toml --train.workers 8 --parallel.tp 4   # ... with loom train's overrides
  loom simulate --plan plan.json --model llama3-8b --hardware h100-sxm --global-batch 512 --seq 4096
  loom simulate --model gpt3-175b --hardware h100-sxm --gpus 1024 --tp 8 --pp 8 --interleave 3 \\
      --global-batch 1536 --recompute selective --sequence-parallel
  loom simulate --model llama3-70b --hardware h200 --gpus 64 --tp 8 --pp 2 --global-batch 256 --seq 8192 \\
      --recompute full --optimizer-level 1 --json
  loom simulate --layers 24 --hidden 2048 --heads 16 --vocab 32000 --gpus 8 --tp 2 --global-batch 64
  loom simulate --model llama3-8b --hardware h100-sxm --gpus 8 --cp 8 --attention ring --seq 65536 \\
      --global-batch 8 --flash-attention --optimizer-level 1 --recompute full  # a sequence over 8 ranks
  loom simulate --model gpt3-175b --gpus 64 --tp 8 --pp 8 --interleave 3 --global-batch 64 --timeline t.png
  loom simulate --model-config config.json --hardware this-machine.json --gpus 2
  loom simulate --model llama3-8b --gpus 8 --tp 8 --global-batch 64 --seq 4096 --recompute full \\
      --replicas 4 --link-gbps 1 --sync-every 100 --fragments 4 --fragment-delay 5

models: {", ".join(PRESETS)}
hardware: {", ".join(PROFILES)}, or a profile file written by `loom bench --out FILE`

dp defaults to gpus / (tp * pp * cp); the global batch defaults to dp * micro-batch * (4 * pp when pipelined),
with --plan to dp * the plan's micro-batches * micro-batch. --cp cuts each sequence over cp ranks (inside a
node after tp, as the mesh orders its axes): Ulysses (tp * cp must divide the heads) or ring attention
(the sequence a multiple of 2 * cp), with pipelines too. A CONFIG.toml sets the model, the plan, the batch
and the devices itself: only the hardware, output and link options go with it, and after CONFIG.toml the
`--section.key value` overrides that `loom train` takes. A config whose replicas step alone ([parallel] sync
= "local_sgd" or "diloco") is priced as one replica, then against synchronous data parallelism over a link of
--link-gbps between the replicas (as --replicas does with the flags).
exit status: 0 when the plan fits; 1 when it is impossible or does not fit in memory (the reason is printed);
2 for usage errors. --timeline draws the schedule of a plan that does not fit too (as if memory allowed),
says so, and still exits 1. A timeline with many micro-batches gets a second panel zoomed on the step's start.

pipeline bubble: the slowest device's idle time inside the pipeline schedule, as a share of the iteration
(the summary and the breakdown's pipeline_bubble row are the same number).
"""


def positive_int(text: str) -> int:
    """An argparse type: a whole number >= 1 (a count, a degree, a size); 0 is never "the default"."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(
            f"expected a whole number >= 1, got {value} (leave it out for the default)"
        )
    return value


DEFAULT_SEQ = 2048
PLAN_FLAGS = ("dp", "tp", "pp", "interleave", "ep", "micro_batch", "global_batch", "seq", "recompute")
PLAN_FLAGS += ("sequence_parallel", "optimizer_level", "schedule", "dtype", "stage_layers", "cp", "attention")
SYNC_EVERY = 50  # --sync-every's default
# set by a config's [parallel] sync keys
SYNC_FLAGS = ("replicas", "sync_every", "fragments", "fragment_delay", "outer_dtype")
MODEL_FLAGS = ("model", "model_config", "layers", "hidden", "heads", "kv_heads", "ffn_hidden", "experts")
MODEL_FLAGS += ("top_k", "vocab", "swiglu")
RUN_FLAGS = ("global_batch", "seq", "micro_batch")  # the batch shape, which a Plan does not fix
# how another system runs a plan (`ParallelPlan` fields with no `loom.plan.Plan` counterpart)
SYSTEM_FLAGS = ("fp8_matmuls", "expert_tp", "grad_dtype", "grad_reduce", "grad_accumulation", "blocking_p2p")
SYSTEM_FLAGS += ("scatter_gather_p2p", "tp_comm_overlap", "moe_dispatcher", "fp8_scaling", "moe_sync")
SYSTEM_FLAGS += ("whole_layer_recompute", "attention_kernel", "master_weights")
FLAG_FIELDS = {"tp_comm_overlap": "overlap_tp_comm"}  # system flags spelled as Megatron spells them


def configure(parser: argparse.ArgumentParser) -> None:
    """Add `loom simulate`'s arguments to `parser`."""
    parser.add_argument(
        "config", nargs="?", metavar="CONFIG.toml", help="a training config: price the run loom train makes"
    )
    parser.add_argument(
        "--plan", metavar="PLAN.json", help="price a saved loom.plan.Plan (model from the flags)"
    )
    model = parser.add_argument_group("model (a preset, a file, or the shape)")
    model.add_argument(
        "--model", choices=sorted(PRESETS), metavar="NAME", help="a preset (see the list below)"
    )
    model.add_argument(
        "--model-config", metavar="FILE", help="TOML/JSON of model fields, or a Hugging Face config.json"
    )
    for flag in ("layers", "hidden", "heads", "kv-heads", "ffn-hidden", "experts", "top-k", "vocab"):
        model.add_argument(f"--{flag}", type=positive_int, metavar="N")
    model.add_argument("--swiglu", action="store_true", help="gated (SwiGLU) MLP, Llama-style")
    hardware = parser.add_argument_group("hardware")
    hardware.add_argument("--hardware", default="a100-80gb", help="profile name or file (default a100-80gb)")
    hardware.add_argument("--gpus", type=positive_int, help="devices (default dp * tp * pp * cp)")
    hardware.add_argument(
        "--gpus-per-node", type=positive_int, help="devices per node (default: the profile's)"
    )
    plan = parser.add_argument_group("plan")
    for axis in ("dp", "tp", "pp", "interleave", "ep", "micro-batch", "global-batch"):
        plan.add_argument(f"--{axis}", type=positive_int, metavar="N")
    plan.add_argument(
        "--cp", type=positive_int, metavar="N", help="context parallel: each sequence cut over N ranks"
    )
    plan.add_argument(
        "--attention", choices=PRICED_ATTENTIONS,
        help="attention over the cp ranks (default ulysses; needs --cp); megatron_p2p prices Megatron-Core's "
        "p2p context parallelism (needs --flash-attention), which loom does not run",
    )  # fmt: skip
    plan.add_argument(
        "--seq", type=positive_int, metavar="N", help=f"sequence length (default {DEFAULT_SEQ})"
    )
    plan.add_argument(
        "--recompute", choices=PRICED_RECOMPUTE,
        help="default none; torchtitan_op prices torchtitan's op-level selective activation checkpointing "
        "(every other matmul's output saved, all else recomputed; needs --flash-attention) and torchtitan_layer its "
        "layer-level one (every second layer recomputed whole), which loom does not run",
    )  # fmt: skip
    plan.add_argument("--sequence-parallel", action="store_true")
    plan.add_argument("--optimizer-level", type=int, choices=OPTIMIZER_LEVELS, help="default 0")
    plan.add_argument(
        "--schedule",
        choices=SIMULATED_SCHEDULES,
        help="default: interleaved when --interleave > 1, else 1f1b",
    )
    plan.add_argument(
        "--stage-layers",
        metavar="N,N,...|light-ends",
        help="layers of each of the pp * interleave stages (uneven), or light-ends: the first and last stage "
        "one layer fewer (as Llama 3 405B ran)",
    )
    plan.add_argument("--no-overlap-grad-sync", action="store_true", help="reduce gradients after backward")
    plan.add_argument("--flash-attention", action="store_true", help="fused attention (no s x s tensors)")
    plan.add_argument("--dtype", choices=PRECISIONS, help="default bf16")
    system = parser.add_argument_group(
        "how another training system runs the plan (to price its published runs; loom train does none of it)"
    )
    system.add_argument("--fp8-matmuls", action="store_true", help="the layers' linear GEMMs in fp8")
    system.add_argument(
        "--fp8-scaling",
        choices=FP8_SCALINGS,
        help="with --fp8-matmuls: current (default; an amax pass before each cast, Transformer Engine 2.x) or "
        "delayed (scales from the amax history, Transformer Engine 1.x)",
    )
    system.add_argument(
        "--expert-tp", type=positive_int, metavar="N", help="experts' own tensor parallelism, a divisor of tp"
    )
    system.add_argument(
        "--grad-dtype", choices=[d for d in GRAD_DTYPES if d], help="gradients accumulated and reduced in it"
    )
    system.add_argument(
        "--grad-reduce",
        choices=[r for r in GRAD_REDUCES if r],
        help="their collective (default: the level's)",
    )
    system.add_argument(
        "--grad-accumulation",
        choices=GRAD_ACCUMULATIONS,
        help="fused into the weight-gradient GEMMs (default), a separate pass after each micro-batch, "
        "FSDP1's flat copy, cast and pre-divide before each unit's reduce-scatter, or FSDP2's copy-out "
        "after each unit's all-gather and copy-in before its reduce-scatter (the last two at level 3, or "
        "at level 2 run unit by unit: SHARD_GRAD_OP)",
    )
    system.add_argument(
        "--moe-dispatcher",
        choices=MOE_DISPATCHERS,
        help="how tokens reach their experts' ranks: all_to_all (default, a copy per routed expert), deepep "
        "(DeepEP's kernels: a copy per destination rank, across nodes one per node forwarded over NVLink) or "
        "hybridep (Hybrid-EP: sent as DeepEP's, its own kernels permuting the rows)",
    )
    system.add_argument(
        "--moe-sync",
        choices=MOE_SYNCS,
        help="whether each MoE layer's dispatch makes the host wait for the device: dropless (default, as loom "
        "runs: the per-expert counts read on the host, so a short layer pass runs at the host's launch pace), "
        "token_drop (capacity factor, fixed shapes) or cuda_graph (the MoE layer captured in CUDA graphs)",
    )
    system.add_argument(
        "--attention-kernel",
        choices=ATTENTION_KERNELS,
        help="with --flash-attention, whose fused attention kernels: flash2 (default, FlashAttention-2's, as "
        "torch's scaled dot-product attention runs them) or cudnn (Transformer Engine's FusedAttention, faster "
        "on Hopper)",
    )
    system.add_argument(
        "--master-weights",
        choices=MASTER_WEIGHTS,
        help="where the fp32 master weights live: parameters (default, as loom runs: fp32 parameters and "
        "gradients, 16 bytes a parameter with Adam, gathered and reduced in fp32) or optimizer (Megatron-LM, "
        "DeepSpeed: 16-bit parameters, fp32 copies in the optimizer, 20 bytes with 16-bit gradients, 18 with "
        "--grad-dtype fp32)",
    )
    system.add_argument(
        "--whole-layer-recompute",
        action="store_true",
        help="with --recompute full, each layer's whole forward runs again (Megatron-LM's and DeepSpeed's "
        "checkpointing); loom's, torch's non-reentrant checkpoint, stops once the last tensor the backward "
        "needs is rebuilt, before the MLP's output projection",
    )
    system.add_argument(
        "--blocking-p2p",
        action="store_true",
        help="each pipeline send holds its device until it ends (Megatron-LM 2021-22); loom's are posted",
    )
    system.add_argument(
        "--scatter-gather-p2p",
        action="store_true",
        help="each tp rank sends 1/tp of a stage's activations, gathered over tp on arrival",
    )
    system.add_argument(
        "--tp-comm-overlap",
        action="store_true",
        help="sequence parallelism's all-gathers and reduce-scatters pipelined with the GEMMs in chunks "
        "(Megatron-Core's --tp-comm-overlap, Transformer Engine's userbuffers; needs --sequence-parallel, tp > 1)",
    )
    slow = parser.add_argument_group(
        "replicas over a slow link (the plan above is one replica): synchronous data parallelism vs DiLoCo"
    )
    slow.add_argument("--replicas", type=positive_int, help="replicas joined by the slow link")
    slow.add_argument(
        "--link-gbps", type=float, default=1.0, help="bandwidth per replica, Gbit/s (default 1)"
    )
    slow.add_argument("--link-latency-ms", type=float, default=10.0, help="latency per hop (default 10 ms)")
    slow.add_argument(
        "--sync-every", type=positive_int, help=f"inner steps between syncs (default {SYNC_EVERY})"
    )
    slow.add_argument("--fragments", type=positive_int, help="DiLoCo's streaming fragments (default 1)")
    slow.add_argument("--fragment-delay", type=int, help="inner steps a fragment's sync overlaps (default 0)")
    slow.add_argument("--outer-dtype", choices=("fp32", "bf16"), help="pseudo-gradients sent (default fp32)")
    output = parser.add_argument_group("output")
    output.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    output.add_argument(
        "--timeline", metavar="PNG", help="draw the simulated pipeline schedule (needs matplotlib)"
    )


def _model(args: argparse.Namespace) -> TransformerConfig:
    shape = {
        "layers": args.layers, "hidden": args.hidden, "heads": args.heads, "kv_heads": args.kv_heads,
        "ffn_hidden": args.ffn_hidden, "experts": args.experts, "top_k": args.top_k, "vocab": args.vocab,
    }  # fmt: skip
    given = {name: value for name, value in shape.items() if value is not None}
    if args.model and args.model_config:
        raise ValueError("give --model or --model-config, not both")
    if args.model or args.model_config:
        base = get_model(args.model) if args.model else load_model_config(args.model_config)
        return base.replace(**given, **({"gated_mlp": True} if args.swiglu else {}))
    missing = [f"--{name}" for name in ("layers", "hidden", "heads", "vocab") if name not in given]
    if missing:
        raise ValueError(
            f"no model: give --model NAME, --model-config FILE, or the shape (missing {' '.join(missing)})"
        )
    return TransformerConfig(name="custom", gated_mlp=args.swiglu, **given)


def _check_sources(args: argparse.Namespace) -> None:
    """A usage error for flags that the chosen source (CONFIG.toml or --plan) already sets."""
    if args.config and args.plan:
        raise ValueError("give CONFIG.toml or --plan, not both")
    if args.config:
        taken = [*MODEL_FLAGS, *PLAN_FLAGS, *SYNC_FLAGS, *SYSTEM_FLAGS, "gpus", "flash_attention"]
        taken.append("no_overlap_grad_sync")
        why = (
            "CONFIG.toml sets the model, the plan, the batch, the devices and how replicas meet ([parallel] "
            "sync), priced as loom train runs them"
        )
    elif args.plan:
        taken = [flag for flag in PLAN_FLAGS if flag not in RUN_FLAGS]
        why = "--plan sets the parallel degrees, the schedule, the memory policies and the precision"
    else:
        taken, why = [], ""
    if not args.config and args.replicas is None:
        sync = [f"--{flag.replace('_', '-')}" for flag in SYNC_FLAGS if getattr(args, flag) is not None]
        if sync:
            raise ValueError(f"{' '.join(sync)} price replicas over a slow link: give --replicas N too")
    given = [f"--{flag.replace('_', '-')}" for flag in taken if getattr(args, flag) not in (None, False)]
    if given:
        raise ValueError(f"{why}; leave out {' '.join(given)}")


def _config(args: argparse.Namespace) -> TrainConfig | None:
    """The training config CONFIG.toml with its `--section.key value` overrides (None without CONFIG)."""
    overrides = args.overrides
    if overrides and not args.config:
        raise ValueError(
            f"{' '.join(overrides)}: not a loom simulate option; --section.key overrides change a training "
            "config, so give CONFIG.toml first (loom simulate CONFIG.toml --parallel.tp 4)"
        )
    return load_config(args.config, overrides) if args.config else None


def _stage_layers(text: str | None, layers: int, stages: int) -> list[int] | None:
    """`--stage-layers`: counts separated by commas, or light-ends (`loom.cost.plan.light_ends`)."""
    if text is None:
        return None
    if text == "light-ends":
        return list(light_ends(layers, stages))
    try:
        return [int(part) for part in text.split(",")]
    except ValueError:
        raise PlanError(
            [f"--stage-layers {text!r}: give {stages} layer counts separated by commas, or light-ends"]
        ) from None


def _flags_plan(args: argparse.Namespace, layers: int) -> tuple[Plan, int]:
    """The Plan and global batch the plan flags describe (`layers`: the model's, for --stage-layers)."""
    tp, pp, cp = args.tp or 1, args.pp or 1, args.cp or 1
    if args.attention and cp == 1:
        raise PlanError([f"--attention {args.attention} spans a sequence cut over cp ranks: give --cp N too"])
    if args.dp is None:
        gpus = args.gpus or tp * pp * cp
        if gpus % (tp * pp * cp):
            degrees = f"tp*pp*cp = {tp * pp * cp}" if cp > 1 else f"tp*pp = {tp * pp}"
            raise PlanError(
                [f"--gpus {gpus} is not a multiple of {degrees}; choose degrees that multiply to it"]
            )
        dp = gpus // (tp * pp * cp)
    else:
        dp = args.dp
    micro, interleave = args.micro_batch or 1, args.interleave or 1
    batch = args.global_batch or dp * micro * (4 * pp if pp > 1 else 1)
    if batch % (dp * micro):
        raise PlanError(
            [
                f"global batch {batch} is not a multiple of dp*micro_batch = {dp}*{micro}; "
                "change --global-batch or --micro-batch"
            ]
        )
    plan = Plan(
        dp=dp, tp=tp, pp=pp, ep=args.ep or 1, cp=cp, attention=_loom_attention(args),
        schedule=args.schedule or default_schedule(interleave),
        virtual_stages=interleave, micro_batches=batch // (dp * micro), recompute=_loom_recompute(args),
        sequence_parallel=args.sequence_parallel, optimizer_level=args.optimizer_level or 0,
        precision=args.dtype or "bf16", stages=_loom_stages(_stage_layers(args.stage_layers, layers, pp * interleave)),
    )  # fmt: skip
    return plan, batch


def _config_plan(config: TrainConfig) -> tuple[ParallelPlan, int]:
    """What `loom train CONFIG` runs, as the simulator prices it: the whole run, or one replica's share of it
    when the replicas step alone (`[parallel] sync`), on that replica's devices."""
    workers = config.train.workers
    if not config.parallel.replicas_step_alone:
        return config.cost_model(workers)[1], workers
    config.validate(workers)
    plan = config.plan(workers)
    replicas = config.parallel.replica_count(plan.dp)
    one = plan.replace(dp=plan.dp // replicas).parallel_plan(
        global_batch=config.train.global_batch // replicas,
        seq=config.data.seq_len,
        accumulation=config.train.grad_accum,
    )
    return one, workers // replicas


def _saved_plan(args: argparse.Namespace, saved: Plan) -> tuple[Plan, int]:
    """A loaded Plan (`dp = -1` resolved on --gpus) and the global batch to price it with."""
    if not saved.resolved and args.gpus is None:
        raise PlanError(["the plan has dp = -1: give --gpus to fill it in"])
    plan = saved if args.gpus is None else saved.resolve(args.gpus)
    batch = args.global_batch or plan.dp * plan.micro_batches * (args.micro_batch or 1)
    return plan, batch


def _plan(
    args: argparse.Namespace, config: TrainConfig | None, saved: Plan | None, layers: int
) -> tuple[ParallelPlan, int]:
    """What the simulator prices, and on how many devices (an impossible plan is a `PlanError`)."""
    try:
        if config is not None:
            return _config_plan(config)
        plan, batch = _saved_plan(args, saved) if saved is not None else _flags_plan(args, layers)
        priced = plan.parallel_plan(
            global_batch=batch,
            seq=args.seq or DEFAULT_SEQ,
            flash_attention=args.flash_attention,
            overlap_grad_sync=not args.no_overlap_grad_sync,
        )
        priced = _with_system(priced, args, layers)
    except ValueError as exc:  # inconsistent degrees or batch sizes: an impossible plan, not a usage error
        raise PlanError([str(exc)]) from exc
    return priced, args.gpus or priced.devices


def _loom_recompute(args: argparse.Namespace) -> str:
    """The Plan's recompute policy: `--recompute` when loom runs it, else none (a policy only the simulator
    prices, another system's, is set on the priced plan by `_with_system`)."""
    return args.recompute if args.recompute in RECOMPUTE else "none"


def _loom_stages(stages: list[int] | None) -> list[int] | None:
    """The Plan's layers per stage: `--stage-layers` when loom runs them (every stage holds a block), else
    none (ends that hold only the embedding or the output layer, as Megatron's account-for-embedding and
    account-for-loss splits leave them, are set on the priced plan by `_with_system`)."""
    return stages if stages is None or min(stages) >= 1 else None


def _loom_attention(args: argparse.Namespace) -> str:
    """The Plan's context-parallel attention: `--attention` when loom runs it, else ulysses (an attention
    only the simulator prices, another system's, is set on the priced plan by `_with_system`)."""
    return args.attention if args.attention in ATTENTIONS else "ulysses"


def _with_system(plan: ParallelPlan, args: argparse.Namespace, layers: int) -> ParallelPlan:
    """`plan` run as the flags of another training system say (`SYSTEM_FLAGS`, and a `--recompute` policy
    or `--attention` or `--stage-layers` that only the simulator prices; `layers`: the model's); a value the plan cannot take is an impossible plan that names the flag."""
    given = {flag: getattr(args, flag) for flag in SYSTEM_FLAGS if getattr(args, flag) not in (None, False)}
    if args.recompute is not None and args.recompute != _loom_recompute(args):
        given["recompute"] = args.recompute
    if args.attention is not None and args.attention != _loom_attention(args):
        given["attention"] = args.attention
    stages = _stage_layers(args.stage_layers, layers, plan.virtual_stages)
    if stages is not None and _loom_stages(stages) is None:
        given["stage_layers"] = tuple(stages)
    if given.pop("blocking_p2p", False):
        given["overlap_p2p"] = False
    if given.pop("whole_layer_recompute", False):
        given["recompute_early_stop"] = False
    for flag, field in FLAG_FIELDS.items():
        if flag in given:
            given[field] = given.pop(flag)
    try:
        priced = plan.replace(**given)
    except FieldError as error:
        key = error.key.split("[")[0]  # "stage_layers[2]": the flag of the whole list
        if key not in given:
            raise
        value = "" if isinstance(error.value, bool) else f" {error.value}"  # a switch's value says nothing
        if key != error.key:  # one entry of a list: "--stage-layers[1] = 0"
            value = f"{error.key[len(key) :]} = {error.value}"
        raise PlanError([f"{_flag(key)}{value}: {_as_flags(error.fix)}"]) from None
    # flags that would change nothing on this plan (their defaults cannot be told from the plan, so asked here)
    idle = [
        (args.fp8_scaling is not None and not priced.fp8_matmuls,
         f"--fp8-scaling {args.fp8_scaling}: it scales fp8 GEMMs: give --fp8-matmuls too"),
        (args.attention_kernel is not None and not priced.flash_attention,
         f"--attention-kernel {args.attention_kernel}: it says whose fused attention kernels run: give "
         "--flash-attention too, or leave it out"),
        (args.whole_layer_recompute and priced.recompute != "full",
         f"--whole-layer-recompute: it says how full recomputation runs (--recompute is {priced.recompute}): "
         "give --recompute full too, or leave it out"),
    ]  # fmt: skip
    if reasons := [reason for refused, reason in idle if refused]:
        raise PlanError(reasons)
    return priced


def _flag(field: str) -> str:
    """The `loom simulate` flag that sets the `ParallelPlan` field `field`."""
    flag = next((flag for flag, name in FLAG_FIELDS.items() if name == field), field)
    return "--" + flag.replace("_", "-")


def _as_flags(text: str) -> str:
    """`text` (a `ParallelPlan` error's fix) with the plan's two-word field names spelled as the flags that set
    them (`fp8_matmuls` -> `--fp8-matmuls`)."""
    fields = [f.name for f in dataclasses.fields(ParallelPlan) if "_" in f.name]
    return re.sub(r"\b(" + "|".join(fields) + r")\b", lambda m: _flag(m.group(1)), text)


def _check_fp8(plan: ParallelPlan, cluster: Cluster, hardware: str) -> None:
    """`--fp8-matmuls` needs a device with an fp8 peak."""
    if plan.fp8_matmuls and "fp8" not in cluster.device.peak_flops:
        with_fp8 = sorted(name for name, profile in PROFILES.items() if "fp8" in profile.device.peak_flops)
        raise PlanError(
            [
                f"--fp8-matmuls: {hardware} has no fp8 peak (it has {sorted(cluster.device.peak_flops)}); "
                f"use --hardware with fp8 ({', '.join(with_fp8)}), or leave out --fp8-matmuls"
            ]
        )


def _json(
    model: TransformerConfig, plan: ParallelPlan | None, result: SimResult | None, reasons: list[str]
) -> dict:
    data: dict = {
        "model": model.name,
        "parameters": model.parameter_count(),
        "plan": plan.to_dict() if plan else None,
    }
    if result is not None:
        data |= result.to_dict() | {"bubble_definition": BUBBLE_DEFINITION}
    if reasons:
        data |= {"fits": False, "reasons": reasons}
        for key in (
            "iteration_s",
            "tokens_per_s",
            "tflops_per_device",
            "model_tflops_per_device",
            "mfu",
            "hfu",
        ):
            data[key] = None  # no number for a plan that cannot run
        data |= {"bubble_fraction": None, "breakdown": None}
        data.setdefault("memory_per_device_gib", None)
    return data


def _count(n: int) -> str:
    """A parameter count at a readable scale: 175.0B, 431.4M, 12.3K."""
    for scale, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.1f}{suffix}"
    return str(n)


def _duration(seconds: float) -> str:
    """Seconds at a readable scale (a small model's step takes microseconds): 1.234 s, 2.345 ms, 3.5 µs."""
    if seconds >= 1 or seconds == 0:
        return f"{seconds:.3f} s"
    return f"{seconds * 1e3:.3f} ms" if seconds >= 1e-3 else f"{seconds * 1e6:.1f} µs"


def _gib(gib: float) -> str:
    """Memory in GiB, or in MiB below a tenth of one."""
    return f"{gib:.1f} GiB" if gib >= 0.1 or gib == 0 else f"{gib * 1024:.1f} MiB"


def _rank_layers(model: TransformerConfig, plan: ParallelPlan) -> list[int]:
    return [plan.rank_layers(model.layers, rank) for rank in range(plan.pp)]


def _print(
    console: Console, model: TransformerConfig, plan: ParallelPlan, cluster, result: SimResult
) -> None:
    p = plan
    console.print(
        f"[bold]{model.name}[/] ({_count(model.parameter_count())} parameters) on {cluster.gpus} x {cluster.name} "
        f"({cluster.gpus_per_node} per node): dp {p.dp} tp {p.tp} pp {p.pp} interleave {p.interleave} ep {p.ep}, "
        f"micro-batch {p.micro_batch} x {p.micro_batches}, global batch {p.global_batch} x {p.seq} tokens, "
        f"recompute {p.recompute}{', sequence parallel' if p.sequence_parallel else ''}"
        f"{' (tp communication overlapped with GEMMs)' if p.overlap_tp_comm else ''}, "
        f"optimizer level {p.optimizer_level}, {p.schedule}"
        + (f", cp {p.cp} ({p.attention} attention)" if p.cp > 1 else "")
    )
    summary = Table(title="predicted iteration", show_header=False)
    rows = [
        ("iteration", _duration(result.iteration_s)),
        ("tokens/s", f"{result.tokens_per_s:,.0f}"),
        (
            "TFLOP/s per device",
            f"{result.tflops_per_device:.1f} (model FLOPs only: {result.model_tflops_per_device:.1f})",
        ),
        ("MFU / HFU", f"{result.mfu:.1%} / {result.hfu:.1%}"),
        ("pipeline bubble", f"{result.bubble_fraction:.1%}"),
        ("memory per device", f"{_gib(result.memory_per_device_gib)} of {result.memory_capacity_gib:g} GiB"),
    ]
    for name, value in rows:
        summary.add_row(name, value)
    console.print(summary)
    parts = Table(title="time on the slowest device", show_header=True)
    parts.add_column("part")
    parts.add_column("time", justify="right")
    parts.add_column("share", justify="right")
    for name, seconds in result.breakdown.items():
        parts.add_row(name, _duration(seconds), f"{seconds / result.iteration_s:.1%}")
    memory = ", ".join(f"{name} {_gib(gib)}" for name, gib in result.memory_breakdown_gib.items())
    console.print(parts)
    console.print(f"memory: {memory}")
    if plan.cp > 1:
        console.print(
            f"context parallel: each rank sends {result.cp_bytes_per_layer / 2**20:,.2f} MiB over its cp group "
            "per layer and micro-batch (forward and backward); cp_comm is what compute leaves exposed",
            highlight=False,
        )
    if plan.pp > 1:
        stages = ", ".join(
            f"{gib:.1f}" + (f" ({n} layers)" if plan.stage_layers else "")
            for gib, n in zip(result.stage_memory_gib, _rank_layers(model, plan), strict=True)
        )
        console.print(f"memory per pipeline stage, GiB: {stages}")
    console.print(BUBBLE_DEFINITION, highlight=False)


@dataclass(frozen=True)
class Sync:
    """How replicas joined by a slow link meet: from the flags, or a config's `[parallel] sync` keys."""

    method: str  # "DiLoCo" or "local SGD" (the same traffic: parameters every sync_every steps)
    replicas: int
    sync_every: int
    fragments: int = 1
    fragment_delay: int = 0
    outer_dtype: str = "fp32"


def _sync(args: argparse.Namespace, config: TrainConfig | None) -> Sync | None:
    """The replicas to price over the slow link, or None (no --replicas, a config that syncs every step)."""
    if config is not None:
        par = config.parallel
        if not par.replicas_step_alone:
            return None
        method = "DiLoCo" if par.sync == "diloco" else "local SGD"
        replicas = par.replica_count(config.plan(config.train.workers).dp)
        return Sync(method, replicas, par.sync_every, par.fragments, par.fragment_delay,
                    par.outer_dtype)  # fmt: skip
    if args.replicas is None:
        return None
    return Sync("DiLoCo", args.replicas, args.sync_every or SYNC_EVERY, args.fragments or 1,
                args.fragment_delay or 0, args.outer_dtype or "fp32")  # fmt: skip


def _slow_links(
    args: argparse.Namespace, sync: Sync, model: TransformerConfig, result: SimResult
) -> SlowLinkComparison:
    """One replica's step against `sync.replicas` of them over the slow link (`loom.cost.slow_links`)."""
    if args.link_gbps <= 0 or args.link_latency_ms < 0:
        raise ValueError(f"--link-gbps {args.link_gbps} must be > 0 and --link-latency-ms >= 0")
    link = Link(name="slow link", bandwidth=args.link_gbps * 1e9 / 8, latency_s=args.link_latency_ms / 1e3,
                efficiency=1.0)  # fmt: skip
    return compare_sync(
        replica_step_s=result.iteration_s, parameters=model.parameter_count(), replicas=sync.replicas,
        link=link, sync_every=sync.sync_every, grad_bytes_per_value=4,
        outer_bytes_per_value=2 if sync.outer_dtype == "bf16" else 4, fragments=sync.fragments,
        fragment_delay=sync.fragment_delay,
    )  # fmt: skip


def _slow_json(sync: Sync, slow: SlowLinkComparison) -> dict:
    return asdict(slow) | {
        "method": sync.method,
        "replicas": sync.replicas,
        "speedup": slow.speedup,
        "byte_reduction": slow.byte_reduction,
    }


def _print_slow(console: Console, args: argparse.Namespace, sync: Sync, slow: SlowLinkComparison) -> None:
    how = f"sync every {sync.sync_every}"
    if sync.method == "DiLoCo":
        how += f", {sync.fragments} fragment(s), delay {sync.fragment_delay}, {sync.outer_dtype}"
    table = Table(
        title=f"{sync.replicas} replicas over {args.link_gbps:g} Gbit/s, {args.link_latency_ms:g} ms "
        f"({sync.method}: {how})"
    )
    for column in ("", "step", "GB sent per step"):
        table.add_column(column, justify="left" if not column else "right")
    table.add_row("one replica alone", _duration(slow.replica_step_s), "0")
    table.add_row("synchronous data parallel", _duration(slow.synchronous_step_s),
                  f"{slow.synchronous_bytes_per_step / 1e9:.3f}")  # fmt: skip
    table.add_row(sync.method, _duration(slow.diloco_step_s), f"{slow.diloco_bytes_per_step / 1e9:.3f}")
    console.print(table)
    console.print(
        f"{sync.method} steps {slow.speedup:.2f}x faster and sends {slow.byte_reduction:.0f}x fewer bytes; it "
        "needs somewhat more tokens for the same loss (benchmarks/diloco.py measures both)."
    )


def execute(args: argparse.Namespace) -> int:
    """Simulate and print; return the exit status."""
    console = Console(stderr=False)
    try:
        if args.timeline:
            require_matplotlib()
        config = _config(args)
        _check_sources(args)
        saved = Plan.read(args.plan) if args.plan else None
        model = config.model.transformer_config() if config is not None else _model(args)
    except (ValueError, MissingDependency) as exc:
        print(f"loom simulate: error: {exc}", file=sys.stderr)
        return 2
    plan = None
    try:
        plan, gpus = _plan(args, config, saved, model.layers)
        cluster = get_cluster(args.hardware, gpus=gpus, gpus_per_node=args.gpus_per_node)
        _check_fp8(plan, cluster, args.hardware)
        result = simulate(model, plan, cluster, record=bool(args.timeline))
    except PlanError as exc:
        if args.json:
            print(json.dumps(_json(model, plan, None, exc.reasons)))
        else:
            print("loom simulate: impossible plan:\n  " + "\n  ".join(exc.reasons), file=sys.stderr)
        return 1
    except ValueError as exc:  # an unknown hardware profile or a broken profile file
        print(f"loom simulate: error: {exc}", file=sys.stderr)
        return 2
    try:
        sync = _sync(args, config)
        slow = _slow_links(args, sync, model, result) if sync is not None else None
    except ValueError as exc:
        print(f"loom simulate: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        data = _json(model, plan, result, [] if result.fits else [result.reason])
        print(json.dumps(data | ({"slow_links": _slow_json(sync, slow)} if slow else {})))
    elif not result.fits:
        print(f"loom simulate: the plan does not fit: {result.reason}", file=sys.stderr)
    else:
        _print(console, model, plan, cluster, result)
        if slow is not None:
            _print_slow(console, args, sync, slow)
    if args.timeline:
        title = f"{model.name}: {result.iteration_s:.2f} s" + (
            "" if result.fits else " (does not fit in memory)"
        )
        try:
            drawn = draw_timeline(result.timeline, plan.pp, args.timeline, title=title)
        except MissingDependency as exc:
            print(f"loom simulate: error: {exc}", file=sys.stderr)
            return 2
        # on stderr with --json, so that stdout stays one JSON object
        stream = sys.stderr if args.json or not result.fits else sys.stdout
        if result.fits:
            print(f"wrote {drawn}", file=stream)
        else:
            print(
                f"wrote {drawn}, although the plan does not fit (the schedule is drawn as if memory "
                "allowed); exit status 1 because it does not fit",
                file=stream,
            )
    return 0 if result.fits else 1
