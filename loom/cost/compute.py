"""Compute time of kernels: matmuls (FLOPs over an efficiency-scaled peak) and memory-bound elementwise ops.

A matmul is priced as a roofline: the larger of its FLOP time at `peak * efficiency(shape)` and its memory
time. Elementwise kernels (norms, activations, softmax, dropout) move bytes, so they cost bytes over the
achieved memory bandwidth. Both add the device's per-kernel launch overhead.
"""

from __future__ import annotations

from loom.cost.hardware import Device

__all__ = ["DTYPE_BYTES", "fused_attention_time", "matmul_efficiency", "matmul_time", "memory_time"]

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
    # fp8 GEMMs pay for scaling and casts around them: a lower fraction of their (doubled) peak
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
) -> float:
    """Seconds for a fused (flash) attention kernel's forward over `batch` heads: scores (queries x keys)
    and context, `share` of the score blocks computed (a causal kernel skips the blocks above the diagonal).
    Its FLOPs run at the GEMMs' shape-dependent speed times `device.attention_efficiency`; its memory traffic
    is the query, key, value and output tiles only, since the scores stay on chip: unlike `matmul_time`,
    the queries x keys scores never count as bytes moved."""
    if min(queries, head_dim, keys, batch, share) <= 0:
        return 0.0
    flops = 2 * 2.0 * queries * head_dim * keys * batch * share
    knee = device.matmul_knee
    fraction = device.matmul_efficiency * device.attention_efficiency
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
