"""Hardware profiles: what one device computes and stores, and how devices talk to each other.

A `Cluster` is a `Device` (peak FLOP/s per dtype, memory capacity and bandwidth, achieved efficiencies) and
a two-level interconnect: `intra` links the devices of a node (NVLink/NVSwitch, HCCS), `inter` links nodes
(InfiniBand/RoCE), given as bandwidth per device (one NIC per device in rail-optimised clusters).

The built-in numbers are vendor data-sheet peaks. The efficiencies (`matmul_efficiency`, `matmul_knee`,
`fp8_efficiency`, `memory_efficiency`, `Link.efficiency`) are what well-tuned kernels reach of those peaks;
they are the only knobs of the cost model, one set per profile and never per run, and their values live in
`loom.cost.efficiency` (with how they were fitted). `loom bench` measures them for this machine
and writes a profile that `load_cluster` reads back.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

from loom.cost import efficiency as fitted
from loom.files import read_table

__all__ = ["Cluster", "Device", "Link", "PROFILES", "cluster_from_dict", "get_cluster", "save_cluster"]

GIB = 1024**3
DTYPES = ("fp32", "tf32", "bf16", "fp16", "fp8")


@dataclass(frozen=True, kw_only=True)
class Device:
    """One accelerator: peaks and the fractions of them that real kernels reach.

    `matmul_knee` models shape dependence: a GEMM of sizes (m, k, n) runs at
    `peak * matmul_efficiency * prod(d / (d + matmul_knee))`, so small dims (thin tensor-parallel shards, short
    head dims) run slower than large ones. `kernel_overhead_s` is paid once per kernel launch, on the device.
    `host_kernel_s` is the host's work to launch one kernel, which sets the pace of a pass only after the host
    has waited for the device (`loom.cost.host`; 0 where host and device are one, as on a CPU).
    """

    name: str
    peak_flops: dict[str, float]  # FLOP/s per dtype, dense
    memory_gib: float
    memory_bandwidth: float  # bytes/s
    matmul_efficiency: float = fitted.MATMUL_EFFICIENCY["a100"]
    matmul_knee: float = fitted.MATMUL_KNEE
    fp8_efficiency: float = (
        fitted.FP8_MATMUL_EFFICIENCY
    )  # fp8 GEMMs: this times matmul_efficiency of the fp8 peak
    attention_efficiency: float = fitted.ATTENTION_EFFICIENCY[
        "a100"
    ]  # fused attention's speed relative to a GEMM's
    # cuDNN's fused attention's (`ParallelPlan.attention_kernel = "cudnn"`); None: as `attention_efficiency`
    cudnn_attention_efficiency: float | None = None
    memory_efficiency: float = fitted.MEMORY_EFFICIENCY
    kernel_overhead_s: float = 0.0
    host_kernel_s: float = fitted.HOST_KERNEL_S
    reserved_gib: float = 2.0  # runtime context, allocator slack and workspace, never usable by the model

    def __post_init__(self) -> None:
        if not self.peak_flops:
            raise ValueError(f"Device {self.name!r}: peak_flops is empty; give at least one dtype")
        for dtype, flops in self.peak_flops.items():
            if dtype not in DTYPES or flops <= 0:
                raise ValueError(f"Device {self.name!r}: bad peak {dtype}={flops}; dtypes are {DTYPES}")
        if self.memory_gib <= 0 or self.memory_bandwidth <= 0:
            raise ValueError(f"Device {self.name!r}: memory capacity and bandwidth must be positive")
        for name in ("matmul_efficiency", "fp8_efficiency", "attention_efficiency", "memory_efficiency"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"Device {self.name!r}: {name} must be in (0, 1], got {getattr(self, name)}")
        if min(self.matmul_knee, self.kernel_overhead_s, self.host_kernel_s, self.reserved_gib) < 0:
            raise ValueError(
                f"Device {self.name!r}: knee, kernel overhead, host time per kernel and reserved memory must be >= 0"
            )

    def peak(self, dtype: str) -> float:
        """Peak FLOP/s for `dtype` (fp16 and bf16 stand in for each other)."""
        for name in (dtype, {"bf16": "fp16", "fp16": "bf16"}.get(dtype, dtype)):
            if name in self.peak_flops:
                return self.peak_flops[name]
        raise ValueError(f"Device {self.name!r} has no {dtype} peak; it has {sorted(self.peak_flops)}")


@dataclass(frozen=True, kw_only=True)
class Link:
    """One level of the interconnect: bandwidth per device (bytes/s, one direction) and latency per step."""

    name: str
    bandwidth: float
    latency_s: float
    efficiency: float = (
        fitted.LINK_EFFICIENCY
    )  # fraction of `bandwidth` that collectives reach as bus bandwidth

    def __post_init__(self) -> None:
        if self.bandwidth <= 0 or self.latency_s < 0:
            raise ValueError(f"Link {self.name!r}: bandwidth must be > 0 and latency >= 0")
        if not 0 < self.efficiency <= 1:
            raise ValueError(f"Link {self.name!r}: efficiency must be in (0, 1], got {self.efficiency}")

    @property
    def bus_bandwidth(self) -> float:
        """Achieved bus bandwidth in bytes/s (what nccl-tests reports as busbw)."""
        return self.bandwidth * self.efficiency


@dataclass(frozen=True, kw_only=True)
class Cluster:
    """`gpus` devices, `gpus_per_node` per node, linked by `intra` inside a node and `inter` between nodes."""

    device: Device
    intra: Link
    inter: Link
    gpus_per_node: int = 8
    gpus: int = 8
    notes: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        if self.gpus_per_node < 1 or self.gpus < 1:
            raise ValueError(
                f"Cluster: gpus ({self.gpus}) and gpus_per_node ({self.gpus_per_node}) must be >= 1"
            )

    @property
    def name(self) -> str:
        """The device's name (a cluster is named after its devices)."""
        return self.device.name

    def with_size(self, gpus: int, gpus_per_node: int | None = None) -> Cluster:
        """The same hardware with another device count (and optionally node size)."""
        return dataclasses.replace(self, gpus=gpus, gpus_per_node=gpus_per_node or self.gpus_per_node)

    def to_dict(self) -> dict:
        """Plain data for JSON (`cluster_from_dict` reads it back)."""
        return dataclasses.asdict(self)


def _node(
    device: Device, intra: tuple[str, float, float], inter: tuple[str, float, float], notes: str
) -> Cluster:
    return Cluster(
        device=device,
        intra=Link(name=intra[0], bandwidth=intra[1], latency_s=intra[2]),
        inter=Link(name=inter[0], bandwidth=inter[1], latency_s=inter[2]),
        notes=notes,
    )


_A100 = {"fp32": 19.5e12, "tf32": 156e12, "bf16": 312e12, "fp16": 312e12}
_H100 = {"fp32": 66.9e12, "tf32": 494.7e12, "bf16": 989.4e12, "fp16": 989.4e12, "fp8": 1978.9e12}
_NVLINK3, _NVLINK4 = ("nvlink3-nvswitch", 300e9, 8e-6), ("nvlink4-nvswitch", 450e9, 8e-6)
_HDR, _NDR = ("infiniband-hdr-200g", 25e9, 12e-6), ("infiniband-ndr-400g", 50e9, 12e-6)

PROFILES: dict[str, Cluster] = {
    "a100-40gb": _node(
        Device(name="a100-40gb", peak_flops=_A100, memory_gib=40, memory_bandwidth=1.555e12),
        _NVLINK3,
        _HDR,
        "DGX A100 40GB: 8 GPUs, NVSwitch, one HDR NIC per GPU",
    ),
    "a100-80gb": _node(
        Device(name="a100-80gb", peak_flops=_A100, memory_gib=80, memory_bandwidth=2.039e12),
        _NVLINK3,
        _HDR,
        "DGX A100 80GB: 8 GPUs, NVSwitch, one HDR NIC per GPU",
    ),
    "h100-sxm": _node(
        Device(
            name="h100-sxm",
            peak_flops=_H100,
            memory_gib=80,
            memory_bandwidth=3.35e12,
            matmul_efficiency=fitted.MATMUL_EFFICIENCY["h100"],
            attention_efficiency=fitted.ATTENTION_EFFICIENCY["h100"],
            cudnn_attention_efficiency=fitted.CUDNN_ATTENTION_EFFICIENCY["h100"],
        ),  # fmt: skip
        _NVLINK4,
        _NDR,
        "DGX H100: 8 GPUs, NVSwitch, one NDR NIC per GPU",
    ),
    "h200": _node(
        Device(
            name="h200",
            peak_flops=_H100,
            memory_gib=141,
            memory_bandwidth=4.8e12,
            matmul_efficiency=fitted.MATMUL_EFFICIENCY["h100"],
            attention_efficiency=fitted.ATTENTION_EFFICIENCY["h100"],
            cudnn_attention_efficiency=fitted.CUDNN_ATTENTION_EFFICIENCY["h100"],
        ),  # fmt: skip
        _NVLINK4,
        _NDR,
        "HGX H200: H100 compute with 141 GB HBM3e, NVSwitch, one NDR NIC per GPU",
    ),
    "ascend-910b": _node(
        Device(
            name="ascend-910b",
            peak_flops={"fp16": 313e12, "bf16": 313e12, "fp32": 75e12},
            memory_gib=64,
            memory_bandwidth=1.6e12,
        ),
        ("hccs", 196e9, 10e-6),
        ("roce-200g", 25e9, 15e-6),
        "Atlas 800T A2: 8 NPUs, HCCS inside a node, 200G RoCE per NPU (approximate published figures)",
    ),
}


def cluster_from_dict(data: dict) -> Cluster:
    """A `Cluster` from the plain data of `Cluster.to_dict` (a saved profile)."""
    try:
        return Cluster(
            device=Device(**data["device"]),
            intra=Link(**data["intra"]),
            inter=Link(**data["inter"]),
            gpus_per_node=data.get("gpus_per_node", 8),
            gpus=data.get("gpus", 8),
            notes=data.get("notes", ""),
        )
    except (KeyError, TypeError) as exc:
        raise ValueError(
            f"not a loom hardware profile ({exc}); write one with `loom bench --out FILE`"
        ) from exc


def save_cluster(cluster: Cluster, path: str | Path) -> None:
    """Write `cluster` as a JSON profile."""
    Path(path).write_text(json.dumps(cluster.to_dict(), indent=2) + "\n")


def get_cluster(name_or_path: str, gpus: int | None = None, gpus_per_node: int | None = None) -> Cluster:
    """A built-in profile by name, or a JSON profile file written by `loom bench`, sized as asked."""
    if name_or_path in PROFILES:
        cluster = PROFILES[name_or_path]
    elif Path(name_or_path).exists() or Path(name_or_path).suffix in (".json", ".toml"):
        data = read_table(name_or_path, "hardware profile")
        try:
            cluster = cluster_from_dict(data)
        except ValueError as exc:
            raise ValueError(f"hardware profile file {name_or_path!r}: {exc}") from None
    else:
        raise ValueError(
            f"unknown hardware {name_or_path!r}: use one of {sorted(PROFILES)} or a profile file from `loom bench`"
        )
    if gpus is not None or gpus_per_node is not None:
        cluster = cluster.with_size(gpus or cluster.gpus, gpus_per_node)
    return cluster
