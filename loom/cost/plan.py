"""The plan vocabulary (schedules, recompute policies, optimizer levels, precisions), the checks on those
names, and `ParallelPlan`: the flat description of a training run that the cost model and simulator price.

The name lists live here, in the lowest layer that needs them, and nowhere else: `loom.plan` re-exports
them for the layers above (the Plan, `[parallel]` of a config, the pipeline runner, the CLI). The one
`loom.plan.Plan` is converted to a `ParallelPlan` in one place (`Plan.parallel_plan`), because `cost/`
and `sim/` sit below `plan/` and never import it.

Rank order is Megatron's: tp innermost, then cp, then dp (with ep carved out of dp, innermost there), then pp
(as `loom.plan.Plan.mesh_sizes` orders the mesh axes).
Nothing here executes anything.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "OPTIMIZER_LEVELS",
    "PRECISIONS",
    "PRICED_ATTENTIONS",
    "PRICED_RECOMPUTE",
    "TORCHTITAN_LAYER_EVERY",
    "WHOLE_LAYER_RECOMPUTES",
    "RECOMPUTE",
    "RING_ATTENTIONS",
    "SCHEDULES",
    "SCHEDULE_VIRTUAL",
    "SIMULATED_SCHEDULES",
    "GRAD_ACCUMULATIONS",
    "FP8_SCALINGS",
    "LOOM_SYSTEM",
    "ATTENTION_KERNELS",
    "MASTER_WEIGHTS",
    "MOE_DISPATCHERS",
    "DEEPEP_DISPATCHERS",
    "MOE_SYNCS",
    "UNIT_COPIES",
    "UNIT_COPY_LEVELS",
    "GRAD_DTYPES",
    "GRAD_REDUCES",
    "FieldError",
    "ParallelPlan",
    "check_choice",
    "check_schedule",
    "check_sizes",
    "default_schedule",
    "light_ends",
]

# Every pipeline schedule loom runs, with the model chunks (virtual stages) each pipeline rank may hold:
# (fewest, most), None for "any number". `loom.parallel.pipeline.schedule` maps each name to torch's class.
SCHEDULE_VIRTUAL: dict[str, tuple[int, int | None]] = {
    "gpipe": (1, 1),
    "1f1b": (1, 1),
    "interleaved": (2, None),
    "zero_bubble": (1, None),
    "zbv": (2, 2),
}
SCHEDULES: tuple[str, ...] = tuple(SCHEDULE_VIRTUAL)
SIMULATED_SCHEDULES: tuple[str, ...] = ("gpipe", "1f1b", "interleaved")  # those the simulator plays
RECOMPUTE: tuple[str, ...] = (
    "none",
    "selective",
    "full",
)  # what loom's runtime runs (and its planner searches)
# what the simulator prices: loom's policies and other systems' ("torchtitan_op": torchtitan's op-level
# selective checkpointing, which saves the outputs of every other matmul and of the fused attention kernels and
# recomputes the rest; `loom.cost.transformer.TransformerConfig.op_sac_matmuls`). Never a planner choice.
PRICED_RECOMPUTE: tuple[str, ...] = (*RECOMPUTE, "torchtitan_op", "torchtitan_layer")
# torchtitan's layer-level selective checkpointing ("torchtitan_layer", `selective_ac_option = "2"`, its
# default): every second transformer block wrapped in torch's non-reentrant checkpoint, the others keep all
TORCHTITAN_LAYER_EVERY = 2
# the priced policies that re-run whole layers (every layer, or one in TORCHTITAN_LAYER_EVERY)
WHOLE_LAYER_RECOMPUTES: tuple[str, ...] = ("full", "torchtitan_layer")
OPTIMIZER_LEVELS: tuple[int, ...] = (0, 1, 2, 3)  # MindSpore's optimizer levels, ZeRO's stages
LEVEL_MEANING = "0 (none), 1 (states), 2 (+ gradients) or 3 (+ parameters)"
PRECISIONS: tuple[str, ...] = ("fp32", "bf16", "fp16", "fp8")
ATTENTIONS: tuple[str, ...] = ("ulysses", "ring")
"""The context-parallel attentions (`loom.parallel.context.ulysses_attention`, `loom.parallel.ring`)."""
# what the simulator prices: loom's attentions and Megatron-Core's default context parallelism ("megatron_p2p":
# `--cp-comm-type p2p`, Transformer Engine's `AttnFuncWithCPAndKVP2P`, a ring of key/value blocks over the
# head-tail cut with each block's fused attention kernels; `loom.cost.context.megatron_p2p_collectives`).
# Never a planner choice: loom's runtime does not run it.
PRICED_ATTENTIONS: tuple[str, ...] = (*ATTENTIONS, "megatron_p2p")
# the attentions that pass key/value blocks around a ring over the head-tail cut (2 * cp chunks a sequence)
RING_ATTENTIONS: tuple[str, ...] = ("ring", "megatron_p2p")
GRAD_DTYPES: tuple[str, ...] = ("", "fp32", "bf16", "fp16")  # "": the training dtype
GRAD_REDUCES: tuple[str, ...] = ("", "all_reduce", "reduce_scatter")  # "": as the optimizer level implies
GRAD_ACCUMULATIONS: tuple[str, ...] = ("fused", "separate", "flat_copy", "copy_in_out")
# the accumulations whose copies run per sharded unit (PyTorch FSDP1, FSDP2: `loom.cost.zero3.unit_copy_bytes`),
# and the optimizer levels at which those systems shard units (SHARD_GRAD_OP: 2, FULL_SHARD: 3)
UNIT_COPIES: tuple[str, ...] = ("flat_copy", "copy_in_out")
UNIT_COPY_LEVELS: tuple[int, ...] = (2, 3)
# how a mixture's tokens reach their experts' ranks: loom's all-to-all (a copy per routed expert), or DeepEP's
# kernels (a copy per destination rank, across nodes one per node forwarded over NVLink: `loom.cost.moe`), or
# NVIDIA's Hybrid-EP (DeepEP's hybrid-ep branch), which sends as DeepEP does and permutes the rows in its own
# dispatch and combine kernels (`loom.cost.layer.DISPATCH_LAUNCHES`)
MOE_DISPATCHERS: tuple[str, ...] = ("all_to_all", "deepep", "hybridep")
DEEPEP_DISPATCHERS: tuple[str, ...] = ("deepep", "hybridep")  # priced as DeepEP's kernels send
# how fp8 GEMM operands are scaled (Transformer Engine's recipes): "current" (Float8CurrentScaling, TE 2.x:
# an amax of each tensor before its cast) or "delayed" (DelayedScaling, TE 1.x's only recipe: the scale from
# the amax history, the new amax recorded by the cast kernel itself)
FP8_SCALINGS: tuple[str, ...] = ("current", "delayed")
# whether a mixture's dispatch synchronises host and device in every MoE layer's forward (`loom.cost.host`):
# "dropless" (the per-expert counts read on the host: Megatron-Core's all-to-all split sizes, DeepEP's receive
# counts, loom's own `.tolist()` of the counts), "token_drop" (capacity factor, inputs padded to capacity: fixed
# shapes, no read) or "cuda_graph" (the MoE layer captured in CUDA graphs: no host work per kernel)
MOE_SYNCS: tuple[str, ...] = ("dropless", "token_drop", "cuda_graph")
# which fused attention kernels run (with flash_attention): "flash2" (FlashAttention-2's, as torch's scaled
# dot-product attention runs it, loom's runtime) or "cudnn" (cuDNN's, Transformer Engine's FusedAttention)
ATTENTION_KERNELS: tuple[str, ...] = ("flash2", "cudnn")
# where a mixed-precision run keeps its fp32 master weights (`loom.cost.memory.state_bytes`): "parameters"
# (the model's parameters are fp32 and compute casts them: torch's autocast, FSDP's mixed precision, loom's
# runtime) or "optimizer" (16-bit parameters, fp32 copies in the optimizer: Megatron-LM, DeepSpeed)
MASTER_WEIGHTS: tuple[str, ...] = ("parameters", "optimizer")


class FieldError(ValueError):
    """A user mistake in one field: the message names `owner.key`, the value and the fix. A surface that
    spells the field differently (a config key) re-raises it under its own name with `renamed`."""

    def __init__(self, owner: str, key: str, value: Any, fix: str) -> None:
        self.owner, self.key, self.value, self.fix = owner, key, value, fix
        super().__init__(f"{owner}.{key} = {value!r} is out of range: {fix}")

    def renamed(self, owner: str, key: str | None = None) -> FieldError:
        """The same mistake reported as `owner.key` (default: the same key)."""
        return FieldError(owner, key or self.key, self.value, self.fix)


def check_sizes(owner: str, values: dict[str, int]) -> None:
    """Each of `values` (a degree, a count, a size) is a whole number >= 1."""
    for key, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise FieldError(owner, key, value, "use a whole number >= 1")


def check_choice(owner: str, key: str, value: Any, choices: Sequence[Any]) -> None:
    """`value` is one of `choices` (a name list of this module)."""
    if isinstance(value, bool) or value not in choices:
        fix = f"use {LEVEL_MEANING}" if choices is OPTIMIZER_LEVELS else f"use one of {tuple(choices)}"
        raise FieldError(owner, key, value, fix)


def light_ends(layers: int, stages: int) -> tuple[int, ...]:
    """Layers per stage when the first and last stage hold one layer fewer than the others (they also
    hold the embedding and the output layer), as Llama 3 405B's 126 layers ran on 16 stages (7, 8 x 14, 7);
    with as many stages as layers + 2 the ends hold the embedding and the output layer alone (Megatron's
    --account-for-embedding-in-pipeline-split and --account-for-loss-in-pipeline-split: 94 layers on 96
    virtual stages, 0, 1 x 94, 0)."""
    if stages < 3 or (layers + 2) % stages:
        raise ValueError(
            f"{layers} layers on {stages} stages cannot have the first and last one layer lighter: "
            f"(layers + 2) must be a multiple of the stages, and there must be at least 3 stages"
        )
    middle = (layers + 2) // stages
    return (middle - 1, *([middle] * (stages - 2)), middle - 1)


def default_schedule(virtual: int) -> str:
    """The schedule a plan gets when it names none: interleaved 1F1B with virtual stages, else 1F1B."""
    return "interleaved" if virtual > 1 else "1f1b"


def check_schedule(owner: str, schedule: str, virtual: int, key: str = "virtual_stages") -> None:
    """`schedule` is known and takes `virtual` model chunks per pipeline rank."""
    check_choice(owner, "schedule", schedule, SCHEDULES)
    low, high = SCHEDULE_VIRTUAL[schedule]
    if virtual < low or (high is not None and virtual > high):
        allowed = str(low) if high == low else f"{low} or more" if high is None else f"{low} to {high}"
        raise FieldError(
            owner, key, virtual, f"schedule {schedule!r} runs {allowed} chunks per pipeline rank"
        )


# the `ParallelPlan` fields that say how a training system runs a plan, not how the plan cuts the work
SYSTEM_FIELDS = ("dtype", "overlap_grad_sync", "overlap_p2p", "scatter_gather_p2p", "flash_attention")
SYSTEM_FIELDS += ("grad_dtype", "grad_accumulation", "fp8_matmuls", "fp8_scaling", "overlap_tp_comm")
SYSTEM_FIELDS += ("moe_dispatcher", "moe_sync", "recompute_early_stop", "attention_kernel", "master_weights")
# the values of those fields loom's own runtime runs, where it runs one only (the other values price other
# training systems' runs: `loom simulate`'s flags, the validation set)
LOOM_SYSTEM = {
    "overlap_p2p": True, "scatter_gather_p2p": False, "grad_accumulation": "fused", "fp8_matmuls": False,
    "overlap_tp_comm": False, "moe_dispatcher": "all_to_all", "moe_sync": "dropless", "recompute_early_stop": True,
    "attention_kernel": "flash2", "master_weights": "parameters",
}  # fmt: skip


@dataclass(frozen=True, kw_only=True)
class ParallelPlan:
    """Parallel degrees per axis, batch shape, memory policies and pipeline schedule of one training run,
    as the simulator prices it (build one from a `loom.plan.Plan` with `Plan.parallel_plan`).

    `interleave` is the number of model chunks (virtual stages) per pipeline stage; `schedule` defaults to
    "interleaved" when it is above 1 and "1f1b" otherwise. `optimizer_level` is 0-3 (MindSpore / ZeRO).
    `stage_layers`: the layers of each of the `pp * interleave` virtual stages in model order (virtual
    stage v runs on pipeline rank v % pp), when they are uneven; empty: equal stages.

    How gradients travel, as training systems differ in it: `grad_dtype` is the dtype they are accumulated
    over micro-batches and reduced in ("": `dtype`; "fp32": Megatron-LM's `--accumulate-allreduce-grads-
    in-fp32`, FSDP2's `reduce_dtype`, DeepSpeed's bf16 optimizer); `grad_reduce` the collective that
    synchronises them at optimizer levels 0-2 ("": all-reduce at level 0, reduce-scatter of each replica's
    shard from level 1; "all_reduce" at level 1: every replica receives the whole sum, as DeepSpeed's bf16
    optimizer does before updating its shard); `grad_accumulation` whether the backward's weight-gradient
    GEMMs add into the accumulation buffer ("fused") or a memory-bound pass after each micro-batch's
    backward adds the `dtype` gradients into the `grad_dtype` buffer ("separate": DeepSpeed's bf16 optimizer)
    or, at optimizer level 2 or 3, every micro-batch's backward copies each unit's gradients into a fresh flat
    buffer, which is cast to `grad_dtype` and pre-divided before the unit's reduce-scatter, and the reduced
    shard is added into the accumulated one ("flat_copy": PyTorch FSDP1, `loom.cost.zero3.flat_copy_bytes`),
    or every unit's gathered parameters are copied out of the all-gather buffer and its
    gradients copied, and cast, into the reduce-scatter buffer ("copy_in_out": PyTorch FSDP2,
    `loom.cost.zero3.copy_in_out_bytes`). Both also run level 2 unit by unit (`unit_sharded`).

    `attention` (with cp > 1) is one of `PRICED_ATTENTIONS`: loom's (`ATTENTIONS`) or "megatron_p2p",
    Megatron-Core's ring of point-to-point key/value exchanges, priced for published runs and never chosen by
    loom's planner.

    `recompute` is one of `PRICED_RECOMPUTE`: loom's policies (`RECOMPUTE`) or "torchtitan_op", torchtitan's
    op-level selective checkpointing, or "torchtitan_layer", its layer-level one (every
    `TORCHTITAN_LAYER_EVERY`-th layer recomputed whole), priced for its published runs and never chosen by
    loom's planner.

    How activations travel between pipeline stages: `overlap_p2p` (loom's runtime, torch's pipelining and
    Megatron-Core's --overlap-p2p-communication) posts each send and goes on computing, so a transfer only
    delays the stage waiting for it; False: every send holds its device until the transfer ends (Megatron-LM
    of 2021-22 waited on its batched sends and receives and synchronised the device after each). With
    `scatter_gather_p2p` (Megatron-LM's --scatter-gather-tensors-in-pipeline) each tensor-parallel rank
    sends 1/tp of the stream and the receiving stage all-gathers it over tp; loom sends it whole.

    `overlap_tp_comm` (Megatron-Core's --tp-comm-overlap, Transformer Engine's userbuffers) splits each
    transformer layer's sequence-parallel all-gathers and reduce-scatters into chunks pipelined with the
    linear layers' GEMMs (`loom.cost.layer.overlapped_tp_time`); it needs sequence parallelism over tp > 1,
    as Megatron asserts. loom's runtime does not run it.

    `moe_dispatcher` is how a mixture's tokens reach their experts' ranks: "all_to_all" (loom's runtime:
    one copy per routed expert) or "deepep" (DeepEP's kernels, Megatron-Core's flex dispatcher: one copy per
    destination rank, and across nodes one per destination node over RDMA, forwarded inside it over NVLink;
    `loom.cost.moe.deepep_bytes`) or "hybridep" (NVIDIA's Hybrid-EP, the flex dispatcher's other backend: sent
    as DeepEP's, its own kernels permuting the rows). loom's runtime runs neither. `moe_sync` (one of `MOE_SYNCS`) says
    whether that dispatch makes the host wait for the device in every MoE layer's forward ("dropless", what
    loom's runtime does), so that a short layer pass runs at the pace the host launches its kernels
    (`loom.cost.host`), or not ("token_drop", "cuda_graph").

    `recompute_early_stop` says how far a layer's recomputation runs under `recompute = "full"`: torch's
    non-reentrant checkpoint (loom's runtime, PyTorch FSDP's `checkpoint_wrapper`, torchtitan) stops once
    the last tensor the backward needs is rebuilt (`set_checkpoint_early_stop`, on by default), so a layer
    ending in its MLP's output projection and residual add does not re-run them
    (`loom.cost.layer.skips_mlp_out`); False: the whole forward again (Megatron-LM's and
    DeepSpeed's checkpoint functions).

    `attention_kernel` (one of `ATTENTION_KERNELS`) says whose fused attention kernels run under
    `flash_attention`: "flash2" (FlashAttention-2's schedule, torch's scaled dot-product attention: loom's
    runtime) or "cudnn" (Transformer Engine's FusedAttention on cuDNN, Megatron's and NeMo's runs), priced at
    the device's `cudnn_attention_efficiency` where it has one (Hopper).

    `master_weights` (one of `MASTER_WEIGHTS`) says where the fp32 master weights live. "parameters" (loom's
    runtime, torch's autocast and FSDP): the fp32 parameters are the master weights, 16 bytes a parameter with
    Adam, plus at loom's levels 1-2 an fp32 copy of each rank's chunk; loom gathers them and reduces their
    gradients in fp32 (`moves_master_weights`), FSDP casts each unit to `dtype` first. "optimizer"
    (Megatron-LM, DeepSpeed): 16-bit parameters with fp32 copies in the optimizer, and an fp32 copy of 16-bit
    gradients for the step: 20 bytes with fp16 gradients, 18 with fp32 ones, as Megatron-LM documents
    (`loom.cost.memory.state_bytes`).
    """

    dp: int = 1
    tp: int = 1
    pp: int = 1
    interleave: int = 1
    ep: int = 1
    micro_batch: int = 1
    global_batch: int
    seq: int
    recompute: str = "none"
    sequence_parallel: bool = False
    optimizer_level: int = 0
    schedule: str | None = None
    overlap_grad_sync: bool = True
    flash_attention: bool = False  # fused attention: no s x s tensors stored or moved
    dtype: str = "bf16"
    fp8_matmuls: bool = (
        False  # the layers' linear GEMMs in fp8 (Transformer Engine, torchao float8); the rest in dtype
    )
    fp8_scaling: str = "current"  # with fp8_matmuls: one of FP8_SCALINGS (`loom.cost.layer.fp8_cast_times`)
    stage_layers: tuple[int, ...] = ()
    cp: int = 1  # context parallelism: each sequence cut over cp ranks (`loom.sim.simulator`)
    attention: str = "ulysses"  # the attention over the cp ranks, one of PRICED_ATTENTIONS
    expert_tp: int = 0  # the experts' own tensor parallelism (Megatron-Core's ETP), a divisor of tp; 0: tp
    grad_dtype: str = ""  # see the class docstring: one of GRAD_DTYPES
    grad_reduce: str = ""  # one of GRAD_REDUCES
    grad_accumulation: str = "fused"  # one of GRAD_ACCUMULATIONS
    overlap_p2p: bool = True  # see the class docstring
    scatter_gather_p2p: bool = False
    overlap_tp_comm: bool = False  # see the class docstring
    moe_dispatcher: str = "all_to_all"  # one of MOE_DISPATCHERS; see the class docstring
    moe_sync: str = "dropless"  # one of MOE_SYNCS; see the class docstring
    recompute_early_stop: bool = True  # see the class docstring
    attention_kernel: str = "flash2"  # one of ATTENTION_KERNELS; see the class docstring
    master_weights: str = "parameters"  # one of MASTER_WEIGHTS; see the class docstring

    def __post_init__(self) -> None:
        owner = "ParallelPlan"
        sizes = ("dp", "tp", "pp", "interleave", "ep", "micro_batch", "global_batch", "seq", "cp")
        check_sizes(owner, {name: getattr(self, name) for name in sizes})
        check_choice(owner, "attention", self.attention, PRICED_ATTENTIONS)
        if self.attention == "megatron_p2p" and not self.flash_attention:
            # Transformer Engine runs each ring step as its fused attention kernels (cuDNN or flash-attn)
            raise FieldError(
                owner, "attention", self.attention,
                "Megatron's p2p context parallelism runs fused attention kernels per block: set flash_attention, "
                f"or use one of {ATTENTIONS}",
            )  # fmt: skip
        check_choice(owner, "recompute", self.recompute, PRICED_RECOMPUTE)
        if self.recompute == "torchtitan_op" and (
            not self.flash_attention or self.cp > 1 or self.fp8_matmuls
        ):
            # its save list names the fused attention kernels and aten.mm (float8 linears run aten._scaled_mm)
            raise FieldError(
                owner, "recompute", self.recompute,
                "torchtitan's op-level checkpointing is priced with fused attention, bf16/fp16 linears and no "
                f"context parallelism: set flash_attention, cp = 1 and no fp8_matmuls, or use one of {RECOMPUTE}",
            )  # fmt: skip
        if self.overlap_tp_comm and not (self.sequence_parallel and self.tp > 1):
            # Megatron: "Tensor parallel communication/GEMM overlap can happen only when sequence
            # parallelism is enabled" (and it turns sequence parallelism off at tp 1)
            raise FieldError(
                owner, "overlap_tp_comm", self.overlap_tp_comm,
                f"it overlaps sequence parallelism's all-gathers and reduce-scatters with the GEMMs (tp={self.tp}, "
                f"sequence_parallel={self.sequence_parallel}): set sequence_parallel with tp > 1, or leave it False",
            )  # fmt: skip
        check_choice(owner, "optimizer_level", self.optimizer_level, OPTIMIZER_LEVELS)
        check_choice(owner, "dtype", self.dtype, PRECISIONS)
        check_choice(owner, "grad_dtype", self.grad_dtype, GRAD_DTYPES)
        check_choice(owner, "grad_reduce", self.grad_reduce, GRAD_REDUCES)
        check_choice(owner, "grad_accumulation", self.grad_accumulation, GRAD_ACCUMULATIONS)
        check_choice(owner, "moe_dispatcher", self.moe_dispatcher, MOE_DISPATCHERS)
        check_choice(owner, "fp8_scaling", self.fp8_scaling, FP8_SCALINGS)
        if self.fp8_scaling != "current" and not self.fp8_matmuls:
            raise FieldError(
                owner, "fp8_scaling", self.fp8_scaling, "it scales fp8 GEMMs: set fp8_matmuls too"
            )
        check_choice(owner, "moe_sync", self.moe_sync, MOE_SYNCS)
        check_choice(owner, "attention_kernel", self.attention_kernel, ATTENTION_KERNELS)
        check_choice(owner, "master_weights", self.master_weights, MASTER_WEIGHTS)
        if self.grad_accumulation == "separate" and self.master_weights == "parameters":
            raise FieldError(
                owner, "grad_accumulation", self.grad_accumulation,
                "a separate accumulation pass (DeepSpeed's bf16 optimizer) adds 16-bit gradients into fp32 "
                "buffers beside 16-bit parameters: set master_weights to 'optimizer'",
            )  # fmt: skip
        if (self.grad_reduce == "reduce_scatter" and self.optimizer_level == 0) or (
            self.grad_reduce == "all_reduce" and self.optimizer_level >= 2
        ):
            raise FieldError(
                owner, "grad_reduce", self.grad_reduce,
                f"optimizer level {self.optimizer_level} "
                + ("keeps whole gradients: use all_reduce, or optimizer level 1 or more"
                   if self.optimizer_level == 0
                   else "shards gradients: use reduce_scatter, or optimizer level 0 or 1"),
            )  # fmt: skip
        if self.grad_accumulation in UNIT_COPIES and self.optimizer_level not in UNIT_COPY_LEVELS:
            raise FieldError(
                owner, "grad_accumulation", self.grad_accumulation,
                f"it prices FSDP's per-unit reduce-scatters of optimizer level 3 (FULL_SHARD) or 2 "
                f"(SHARD_GRAD_OP), not level {self.optimizer_level}: use optimizer level 2 or 3, or fused or separate",
            )  # fmt: skip
        if self.schedule is None:
            object.__setattr__(self, "schedule", default_schedule(self.interleave))
        check_schedule(owner, self.schedule, self.interleave, key="interleave")
        check_choice(owner, "schedule", self.schedule, SIMULATED_SCHEDULES)
        if self.global_batch % (self.dp * self.micro_batch):
            raise ValueError(
                f"ParallelPlan: global batch {self.global_batch} is not a multiple of dp*micro_batch "
                f"= {self.dp}*{self.micro_batch}; change --global-batch or --micro-batch"
            )
        if self.expert_tp and (self.expert_tp > self.tp or self.tp % self.expert_tp):
            raise FieldError(owner, "expert_tp", self.expert_tp, f"use a divisor of tp={self.tp} (0: tp)")
        if self.expert_tp in (0, self.tp) and self.dp % self.ep:
            raise ValueError(
                f"ParallelPlan: ep={self.ep} must divide dp={self.dp} (experts shard the data-parallel axis)"
            )
        if (self.tp * self.dp) % (self.etp * self.ep):
            raise FieldError(
                owner, "ep", self.ep,
                f"expert_tp*ep = {self.etp}*{self.ep} must divide the tp*dp = {self.tp * self.dp} ranks of a stage",
            )  # fmt: skip
        if self.stage_layers:
            object.__setattr__(self, "stage_layers", tuple(self.stage_layers))
            self._check_stage_layers(owner)

    def _check_stage_layers(self, owner: str) -> None:
        """One whole layer count per virtual stage, each at least 1 but at the ends: the first virtual stage
        holds the embedding and the last the output layer and loss, so either may hold no transformer layer
        (Megatron's --account-for-embedding-in-pipeline-split and --account-for-loss-in-pipeline-split)."""
        if len(self.stage_layers) != self.virtual_stages:
            raise FieldError(
                owner, "stage_layers", self.stage_layers,
                f"give one layer count per virtual stage: pp * interleave = {self.virtual_stages}",
            )  # fmt: skip
        last = len(self.stage_layers) - 1
        for i, n in enumerate(self.stage_layers):
            least = 0 if i in (0, last) and last > 0 else 1  # the embedding's stage, the output layer's
            if isinstance(n, bool) or not isinstance(n, int) or n < least:
                fix = f"use a whole number >= {least}"
                if n == 0:
                    fix += (
                        ": only the first virtual stage (with the embedding) and the last (with the output "
                        "layer and loss) may hold no transformer layer"
                    )
                raise FieldError(owner, f"stage_layers[{i}]", n, fix)

    @property
    def etp(self) -> int:
        """Tensor parallelism inside each expert (`expert_tp`, else `tp`). A stage's tp * dp ranks are folded
        for the experts as etp * ep * edp, etp innermost, then ep (Megatron-Core's expert layout): with
        etp = tp the ep groups are ep consecutive data-parallel replicas (loom's own layout); with etp < tp
        each rank routes its own sequence-parallel tokens and an ep group spans tensor-parallel ranks."""
        return self.expert_tp or self.tp

    @property
    def edp(self) -> int:
        """Expert data parallelism: the ranks that hold the same experts' shard (tp * dp / (etp * ep))."""
        return self.tp * self.dp // (self.etp * self.ep)

    @property
    def grad_collective(self) -> str:
        """The collective that synchronises gradients at levels 0-2 (`grad_reduce`, or the level's own)."""
        return self.grad_reduce or ("all_reduce" if self.optimizer_level == 0 else "reduce_scatter")

    @property
    def unit_sharded(self) -> bool:
        """Whether parameters are all-gathered and gradients reduce-scattered unit by unit around each
        micro-batch's passes: optimizer level 3, or level 2 under PyTorch FSDP (`grad_accumulation` in
        `UNIT_COPIES`: FSDP1's SHARD_GRAD_OP, FSDP2 without resharding after forward), which gathers each
        unit before its forward and keeps it gathered for its backward. Otherwise level 2 reduces the
        gradients after the backward and gathers the parameters after the optimizer step."""
        return self.optimizer_level == 3 or (
            self.optimizer_level == 2 and self.grad_accumulation in UNIT_COPIES
        )

    @property
    def moves_master_weights(self) -> bool:
        """Whether the fp32 master weights travel as they are: loom's runtime (`master_weights` "parameters"
        without PyTorch FSDP's unit copies) gathers its fp32 parameters at optimizer levels 1-3 and reduces
        their fp32 gradients; FSDP casts each unit to `dtype` before gathering it."""
        return self.master_weights == "parameters" and self.grad_accumulation not in UNIT_COPIES

    @property
    def casts_weights(self) -> bool:
        """Whether compute casts the fp32 parameters to a 16-bit `dtype` in every forward, as torch's autocast
        in loom's runtime does (`moves_master_weights`: FSDP casts each unit's shard before gathering it):
        a copy of every matmul weight per forward, kept for its backward, and each 16-bit weight gradient
        cast back and added into the fp32 gradient (`loom.cost.memory.cast_weight_bytes`)."""
        return self.moves_master_weights and self.dtype in ("bf16", "fp16")

    @property
    def param_precision(self) -> str:
        """The dtype parameters are gathered in at optimizer levels 1-3 (fp32 when `moves_master_weights`)."""
        return "fp32" if self.moves_master_weights else self.dtype

    @property
    def grad_precision(self) -> str:
        """The dtype gradients are accumulated and reduced in: `grad_dtype`, else the parameters'
        (`param_precision`)."""
        return self.grad_dtype or self.param_precision

    def chunk_layers(self, layers: int) -> list[int]:
        """Layers of each virtual stage in model order (`stage_layers`, else `layers` split equally)."""
        return list(self.stage_layers) or [layers // self.virtual_stages] * self.virtual_stages

    def rank_layers(self, layers: int, rank: int) -> int:
        """Layers held by pipeline rank `rank` (its chunks v = rank, rank + pp, ...)."""
        return sum(self.chunk_layers(layers)[rank :: self.pp])

    @property
    def devices(self) -> int:
        """Devices the plan uses: dp * cp * tp * pp (ep lives inside dp)."""
        return self.dp * self.cp * self.tp * self.pp

    def system(self) -> dict[str, Any]:
        """How the training system runs the plan (`SYSTEM_FIELDS`): what a search over plans for the same
        run holds fixed (`loom.plan.outer.search_plans(..., **plan.system())`)."""
        return {name: getattr(self, name) for name in SYSTEM_FIELDS}

    @property
    def micro_batches(self) -> int:
        """Micro-batches per data-parallel replica per iteration."""
        return self.global_batch // (self.dp * self.micro_batch)

    @property
    def virtual_stages(self) -> int:
        """Pipeline stages times chunks per stage."""
        return self.pp * self.interleave

    def replace(self, **changes) -> ParallelPlan:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        """Plain data for JSON (stage layers as a list, as JSON reads them back)."""
        return dataclasses.asdict(self) | {"stage_layers": list(self.stage_layers)}
