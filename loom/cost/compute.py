"""Compute time of kernels: matmuls (FLOPs over an efficiency-scaled peak) and memory-bound elementwise ops.

A matmul is priced as a roofline: the larger of its FLOP time at `peak * efficiency(shape)` and its memory
time. Elementwise kernels (norms, activations, softmax, dropout) move bytes, so they cost bytes over the
achieved memory bandwidth. Both add the device's per-kernel launch overhead.
"""

from __future__ import annotations

from loom.cost.hardware import Device

__all__ = [
    "DTYPE_BYTES", "fp8_quantize_bytes", "fp8_quantize_kernels", "fused_attention_time", "matmul_efficiency", "matmul_time",
    "memory_time",
]  # fmt: skip

DTYPE_BYTES = {"fp32": 4, "tf32": 4, "bf16": 2, "fp16": 2, "fp8": 1}


def matmul_efficiency(device: Device, m: float, k: float, n: float) -> float:
    """Fraction of peak that an (m x k) @ (k x n) matmul reaches: smaller dims fill the machine less."""
    knee = device.matmul_knee
    return device.matmul_efficiency * (m / (m + knee)) * (k / (k + knee)) * (n / (n + knee))


def matmul_time(
    device: Device, m: float, k: float, n: float, *, dtype: str = "bf16", batch: float = 1
) -> float:
    """Seconds for `batch` independent (m x k) @ (k x n) matmuls in `dtype`."""
    if min(m, k, n, batch) <= 0:
        return 0.0
    flops = 2.0 * m * k * n * batch
    # fp8 GEMMs reach their own fraction of their (doubled) peak; the casts around them are priced apart
    # (`fp8_quantize_bytes`)
    fraction = matmul_efficiency(device, m, k, n) * (device.fp8_efficiency if dtype == "fp8" else 1.0)
    compute = flops / (device.peak(dtype) * fraction)
    memory = (
        (m * k + k * n + m * n)
        * batch
        * DTYPE_BYTES[dtype]
        / (device.memory_bandwidth * device.memory_efficiency)
    )
    return max(compute, memory) + device.kernel_overhead_s


def fused_attention_time(
    device: Device,
    queries: float,
    head_dim: float,
    keys: float,
    *,
    dtype: str = "bf16",
    batch: float = 1,
    share: float = 1.0,
    kernel: str = "flash2",
) -> float:
    """Seconds for a fused (flash) attention kernel's forward over `batch` heads: scores (queries x keys)
    and context, `share` of the score blocks computed (a causal kernel skips the blocks above the diagonal).
    Its FLOPs run at the GEMMs' shape-dependent speed times `device.attention_efficiency`; its memory traffic
    is the query, key, value and output tiles only, since the scores stay on chip: unlike `matmul_time`,
    the queries x keys scores never count as bytes moved. `kernel` "cudnn" runs at
    `device.cudnn_attention_efficiency` where the device has one (`ParallelPlan.attention_kernel`)."""
    if min(queries, head_dim, keys, batch, share) <= 0:
        return 0.0
    flops = 2 * 2.0 * queries * head_dim * keys * batch * share
    knee = device.matmul_knee
    attention = device.attention_efficiency
    if kernel == "cudnn" and device.cudnn_attention_efficiency is not None:
        attention = device.cudnn_attention_efficiency
    fraction = device.matmul_efficiency * attention
    fraction *= queries / (queries + knee) * keys / (keys + knee)
    compute = flops / (device.peak(dtype) * fraction)
    memory = (
        2
        * (queries + keys)
        * head_dim
        * batch
        * DTYPE_BYTES[dtype]
        / (device.memory_bandwidth * device.memory_efficiency)
    )
    return max(compute, memory) + device.kernel_overhead_s


def memory_time(device: Device, nbytes: float, kernels: int = 1) -> float:
    """Seconds for memory-bound kernels moving `nbytes` in all (reads plus writes)."""
    if nbytes <= 0:
        return kernels * device.kernel_overhead_s
    return nbytes / (device.memory_bandwidth * device.memory_efficiency) + kernels * device.kernel_overhead_s


def fp8_quantize_bytes(
    elements: float, *, dtype: str = "bf16", amax_fused: bool = False, gathered: int = 1
) -> tuple[float, float]:
    """Bytes Transformer Engine's fp8 current-scaling quantizer (`Float8CurrentScalingQuantizer`, the recipe
    of every fp8 run on Hopper that Megatron-Bridge publishes) moves for one GEMM operand of `elements`
    elements in `dtype` on this rank, quantized for both its uses: row-wise for its own GEMM and column-wise
    (a transposed copy: Hopper's fp8 GEMMs take only the TN layout) for the weight-gradient GEMM. Returns
    (bytes where the operand is made, bytes of the transpose the backward makes of a gathered operand).

    An amax pass reads the operand (`quantize_impl`'s `nvte_compute_amax`) unless the norm that produced it
    computed the amax in its own kernel (`amax_fused`: TE 2.8+'s `FUSED_NORM_AMAX_FP8` in LayerNormLinear),
    or the recipe is delayed scaling, whose cast records the amax for a later step's scale;
    the cast reads it and writes one byte per element row-wise, and the column-wise byte in the same kernel.
    An operand all-gathered over `gathered` ranks (sequence parallelism) is cast row-wise only, since fp8
    column-wise data cannot be all-gathered, and the backward transposes the gathered tensor instead
    (`update_usage(columnwise_usage=True)`: one byte read and one written per gathered element)."""
    if gathered < 1:
        raise ValueError(
            f"fp8_quantize_bytes: gathered={gathered} must be at least 1 (ranks the operand spans)"
        )
    e = DTYPE_BYTES[dtype]
    amax = 0.0 if amax_fused else e * elements
    cast = (e + 1) * elements
    if gathered == 1:
        return amax + cast + elements, 0.0
    return amax + cast, 2.0 * elements * gathered


def fp8_quantize_kernels(*, amax_fused: bool = False, delayed: bool = False) -> int:
    """Kernels of one quantization that `fp8_quantize_bytes` prices where the operand is made: the amax pass
    (unless fused into the norm, or `delayed` scaling's), the scale computed from the amax (delayed scaling
    computes every tensor's once per step, from the amax history), and the cast (a gathered operand's
    transpose is one kernel more, in the backward)."""
    if delayed:
        return 1
    return (0 if amax_fused else 1) + 2
