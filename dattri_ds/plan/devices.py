"""The devices the planner knows: memory, rates, links and calibrated host terms.

The H200's host terms are fitted to measured steps (``python benchmarks/calibrate.py``,
docs/gpu.md).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

from dattri_ds.errors import ConfigError
from dattri_ds.ops.cost import Roofline


GB = 1e9


@dataclass(frozen=True, kw_only=True)
class DeviceSpec:
    """One accelerator (or a CPU host) as the planner sees it.

    Attributes:
        name: registry key.
        memory_bytes: memory of one device (a CPU host's RAM, shared by its ranks).
        flops_per_s: dense matmul rate in the run's compute dtype (bf16 on GPUs; the CPU
            figure is fp32, one core: bf16 matmuls are ~100x slower on CPUs without
            AVX-512 BF16).
        bytes_per_s: memory bandwidth.
        link_bytes_per_s: per-rank bandwidth of the collectives (NVLink; loopback gloo).
        runtime_bytes: resident size of the framework itself (CUDA context / interpreter,
            torch, DeepSpeed, transformers) per rank.
        ranks_share_memory: every rank lives in the same memory (CPU ranks on one host).
        efficiency: the fraction of the roofline a whole step reaches (CPU: measured on
            ``benchmarks/scale.py``'s ladder; H200: fitted by ``benchmarks/calibrate.py``).
        host_link_bytes_per_s: device <-> host bandwidth that offloaded state crosses
            every step (PCIe 5 x16: ~50 GB/s sustained; PCIe 4: ~25 GB/s; CPU: none).
        kernel_latency_s: host time to issue one kernel in eager mode; a pass without host
            syncs takes ``max(host, device)`` (CPU: 0, its kernels run on the host).
        capture_layer_s: host time capture adds per captured layer per pass (a capturing
            pass is serialized, ``host + device``).
        zero3_tensor_s: host time ZeRO-3 adds per parameter tensor per step.
    """

    name: str
    memory_bytes: float
    flops_per_s: float
    bytes_per_s: float
    link_bytes_per_s: float
    runtime_bytes: float
    ranks_share_memory: bool = False
    efficiency: float = 0.5
    host_link_bytes_per_s: float = float("inf")
    kernel_latency_s: float = 0.0
    capture_layer_s: float = 0.0
    zero3_tensor_s: float = 0.0

    @property
    def roofline(self) -> Roofline:
        return Roofline(flops_per_s=self.flops_per_s, bytes_per_s=self.bytes_per_s)


def _host_memory() -> float:
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 16 * GB


#: The H200's fitted terms (``benchmarks/calibrate.py.fit`` on ``calibrate.RECORDED``, the
#: first H200 run at 0eb5305: throughput ladder 0.5B/1.5B/7B and the 1B ZeRO-3 launch step;
#: ``python benchmarks/calibrate.py`` refits and prints them with each point's error). The
#: H100 and A100 keep the roofline with the H200's host terms (same hosts, not measured).
H200_CALIBRATED = {"efficiency": 0.59, "kernel_latency_s": 20.7e-6,
                   "capture_layer_s": 290e-6, "zero3_tensor_s": 2.24e-3}

_H200 = DeviceSpec(name="h200", memory_bytes=141 * GB, flops_per_s=989e12, bytes_per_s=4.8e12,
                   link_bytes_per_s=450 * GB, runtime_bytes=1.5 * GB,
                   host_link_bytes_per_s=50 * GB, **H200_CALIBRATED)
#: name -> DeviceSpec. GPU figures are the vendors' dense bf16 peaks and HBM bandwidths
#: (H200 SXM: 141 GB, 989 TFLOPS, 4.8 TB/s; H100 SXM: 80 GB, 989 TFLOPS, 3.35 TB/s; A100 SXM
#: 80 GB: 312 TFLOPS, 2.04 TB/s); NVLink per direction 450 / 450 / 300 GB/s.
DEVICES: dict[str, DeviceSpec] = {
    "cpu": DeviceSpec(name="cpu", memory_bytes=_host_memory(), flops_per_s=8e10,
                      bytes_per_s=1e10, link_bytes_per_s=1e9, runtime_bytes=0.45 * GB,
                      ranks_share_memory=True, efficiency=0.4),
    "h200": _H200,
    "h100": replace(_H200, name="h100", memory_bytes=80 * GB, bytes_per_s=3.35e12),
    "a100": replace(_H200, name="a100", memory_bytes=80 * GB, flops_per_s=312e12,
                    bytes_per_s=2.04e12, link_bytes_per_s=300 * GB, host_link_bytes_per_s=25 * GB),
}


def device(name: str) -> DeviceSpec:
    """The registered device ``name`` (case-insensitive)."""
    try:
        return DEVICES[name.lower()]
    except KeyError:
        raise ConfigError(f"Unknown device '{name}'; known: {sorted(DEVICES)} (add a "
                          f"DeviceSpec to dattri_ds.plan.DEVICES)") from None


def available_memory(device: str = "cpu") -> tuple[float, str]:
    """(bytes this process may still allocate, where that figure comes from): free GPU
    memory on CUDA (``torch.cuda.mem_get_info``), else ``MemAvailable`` of /proc/meminfo,
    else the physical memory (``os.sysconf``)."""
    if device.startswith("cuda"):
        import torch

        free, _ = torch.cuda.mem_get_info(torch.device(device))
        return float(free), "free GPU memory (torch.cuda.mem_get_info)"
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return float(line.split()[1]) * 1024, "MemAvailable in /proc/meminfo"
    except OSError:
        pass
    return _host_memory(), "physical memory (os.sysconf)"
