"""Peak FLOP/s of the device a run trains on, the denominator of model FLOPs utilisation (MFU).

GPU peaks are the data-sheet numbers of the cost model's profiles (`loom.cost.hardware.PROFILES`), looked up
by a substring of `torch.cuda.get_device_name()`; there is deliberately no second table here. CPU peaks are
rough: a per-core figure times the threads torch uses (see `CPU_PEAK_FLOPS_PER_CORE`), or, for a number
measured on this machine, `measure_matmul_flops`.
"""

from __future__ import annotations

import functools
import time

import torch

from loom.cost.hardware import PROFILES

__all__ = ["CPU_PEAK_FLOPS_PER_CORE", "dtype_name", "measure_matmul_flops", "peak_flops"]

# Rough dense-matmul peak of one modern x86 server core (AVX2/AVX-512 FMA at ~2.5-3 GHz), FLOP/s. CPUs vary
# by several times around it (and bf16 is often emulated), so CPU MFU is an indication, not a measurement.
CPU_PEAK_FLOPS_PER_CORE = {"fp32": 1e11, "bf16": 1e11, "fp16": 1e11}

# Substring of the CUDA device name -> profile in loom.cost.hardware. Order matters: first match wins.
# The H100 PCIe is reported with the SXM peaks (higher), so its MFU reads low rather than high.
_GPU_PROFILES = (("H200", "h200"), ("H100", "h100-sxm"), ("A100", "a100-80gb"))

_DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def dtype_name(dtype: torch.dtype) -> str:
    """The cost model's name of a torch dtype ("fp32", "bf16", "fp16")."""
    if dtype not in _DTYPE_NAMES:
        raise ValueError(f"no peak FLOP/s for dtype {dtype}; use one of {list(_DTYPE_NAMES)}")
    return _DTYPE_NAMES[dtype]


def peak_flops(
    device_type: str,
    dtype: torch.dtype,
    *,
    device_name: str | None = None,
    cores: int | None = None,
    tf32: bool = False,
) -> float | None:
    """Peak dense FLOP/s of one device of `device_type` ("cuda" or "cpu") for matmuls in `dtype`.

    On CUDA the device is named by `device_name` (default: `torch.cuda.get_device_name()`); `tf32=True`
    gives the TF32 peak for fp32 matmuls. On CPU a "device" is one process using `cores` cores (default:
    `torch.get_num_threads()`), and the figure is rough. Returns None for unknown hardware.
    """
    name = dtype_name(dtype)
    if device_type == "cpu":
        return CPU_PEAK_FLOPS_PER_CORE[name] * (cores or torch.get_num_threads())
    if device_type != "cuda":
        return None
    if device_name is None:
        if not torch.cuda.is_available():
            return None
        device_name = torch.cuda.get_device_name()
    for key, profile in _GPU_PROFILES:
        if key in device_name.upper():
            device = PROFILES[profile].device
            return device.peak("tf32" if tf32 and name == "fp32" else name)
    return None


@functools.cache
def measure_matmul_flops(device: str = "cpu", dtype: torch.dtype = torch.float32, size: int = 512) -> float:
    """FLOP/s of a square matmul measured once on `device` (cached): an achieved rate, a floor for the peak."""
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    a @ b  # warm up: first calls pay for allocation and kernel selection
    repeats, start = 8, time.perf_counter()
    for _ in range(repeats):
        a @ b
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return 2 * size**3 * repeats / (time.perf_counter() - start)
