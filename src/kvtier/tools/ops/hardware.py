"""Hardware profiles: accelerator memory and compute, and the bandwidth of each tier link.

Primitives:
    GpuProfile, GPU_PROFILES       -- H100, H200, A100, L40S (datasheet figures, cited)
    local_cpu_profile()            -- this machine as a vLLM CPU-backend "device"
    gpu_profile(name, hbm)         -- look one up, optionally overriding its memory size
    LinkProfile, host_link(gpu, pcie_gen), nvme_link(gen, drives), dram_link()
                                   -- effective bandwidths the plan and simulator use

All bandwidths are in GB/s (10^9 bytes per second), one direction. "Effective" figures are
what a large, pinned, sequential transfer reaches in practice, below the theoretical line
rate; each profile carries the figure's source so reports can state it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

from kvtier.errors import ConfigError
from kvtier.units import parse_size

# Effective host<->device DMA over one x16 link, one direction. Theoretical: Gen4 31.5 GB/s,
# Gen5 63 GB/s. vLLM's KV-offloading blog measured 83.4 GB/s bidirectional H100<->DRAM with
# 2 MB blocks (~42 GB/s each way); we use 25 and 50 as round "achievable" figures.
PCIE_GBPS: dict[int, float] = {4: 25.0, 5: 50.0}
# Effective sequential read of ONE NVMe drive through the page cache. Gen4 x4 drives are rated
# ~7 GB/s; the operator's guide measured 100k BF16 tokens of a 70B model (~33 GB) in 5-7 s,
# i.e. ~5-6.5 GB/s. Gen5 x4 drives are rated ~14 GB/s.
NVME_GBPS: dict[int, float] = {4: 6.0, 5: 12.0}
# One socket of 8-channel DDR5-4800: ~307 GB/s theoretical; ~200 GB/s for a single stream.
DRAM_GBPS = 200.0
# Fraction of peak dense tensor FLOPs a long prefill reaches (model FLOPs utilisation).
PREFILL_MFU = 0.4
# Assumed per-core BF16 throughput of the local CPU (AVX-512/AMX class); a rough figure.
CPU_GFLOPS_PER_CORE = 64.0


@dataclass(frozen=True, slots=True)
class GpuProfile:
    """One accelerator model."""

    name: str  # display name
    hbm_bytes: int  # device memory
    hbm_bandwidth_gbps: float  # device memory bandwidth, GB/s
    bf16_tflops: float  # dense BF16 tensor throughput, TFLOP/s
    fp8_tflops: float  # dense FP8 tensor throughput (== bf16 where FP8 is not native)
    pcie_gen: int  # host link generation; 0 for the CPU backend (no link, memcpy)
    source: str  # where the figures come from
    # CUDA compute capability major (8 Ampere/Ada, 9 Hopper): which attention kernels vLLM
    # can pick (kvtier.tools.ops.attention_kernels); 0 for the CPU backend.
    sm_major: int = 0


@dataclass(frozen=True, slots=True)
class LinkProfile:
    """The bottleneck bandwidth of one path that KV takes back to the device."""

    name: str  # e.g. "PCIe Gen5 x16", "NVMe Gen4"
    bandwidth_gbps: float  # effective GB/s, one direction
    source: str  # where the figure comes from


_GIB = 1024**3
_MIB = 1024**2
# Memory sizes are the totals nvidia-smi reports, not the marketing figure.
GPU_PROFILES: dict[str, GpuProfile] = {
    "h100": GpuProfile("H100 SXM 80GB", 81559 * _MIB, 3350.0, 989.0, 1979.0, 5,
                       "NVIDIA H100 datasheet (SXM5: HBM3 3.35 TB/s, 989 BF16 dense TFLOPS)", 9),
    "h200": GpuProfile("H200 SXM 141GB", 143771 * _MIB, 4800.0, 989.0, 1979.0, 5,
                       "NVIDIA H200 datasheet (HBM3e 141 GB, 4.8 TB/s, H100 compute)", 9),
    "a100": GpuProfile("A100 SXM 80GB", 81920 * _MIB, 2039.0, 312.0, 312.0, 4,
                       "NVIDIA A100 datasheet (HBM2e 2.04 TB/s, 312 BF16 TFLOPS, no FP8)", 8),
    "l40s": GpuProfile("L40S 48GB", 46068 * _MIB, 864.0, 362.0, 733.0, 4,
                       "NVIDIA L40S datasheet (GDDR6 864 GB/s, 362 BF16 dense TFLOPS)", 8),
}


def local_cpu_profile() -> GpuProfile:
    """This machine as vLLM's CPU backend sees it: RAM is the "device" memory.

    Memory is MemTotal from /proc/meminfo (falls back to 16 GiB elsewhere); compute assumes
    CPU_GFLOPS_PER_CORE per core, a rough figure to be replaced by a measurement.
    """
    cores = os.cpu_count() or 1
    return GpuProfile(
        name=f"local CPU ({cores} cores)", hbm_bytes=_mem_total_bytes(),
        hbm_bandwidth_gbps=DRAM_GBPS / 4, bf16_tflops=cores * CPU_GFLOPS_PER_CORE / 1000,
        fp8_tflops=cores * CPU_GFLOPS_PER_CORE / 1000, pcie_gen=0,
        source=f"/proc/meminfo and os.cpu_count(); {CPU_GFLOPS_PER_CORE:g} GFLOPS/core assumed",
    )


def gpu_profile(name: str, hbm: str | int | None = None) -> GpuProfile:
    """Return the profile `name` ("h100", "h200", "a100", "l40s", "cpu").

    Args:
        hbm: overrides the memory size, e.g. "94GiB" for an H100 NVL.
    Raises:
        ConfigError: unknown name or bad size.
    """
    key = name.strip().lower().split("-")[0].split(" ")[0]
    if key == "cpu":
        profile = local_cpu_profile()
    elif key in GPU_PROFILES:
        profile = GPU_PROFILES[key]
    else:
        raise ConfigError("gpu", name, f"one of {', '.join([*GPU_PROFILES, 'cpu'])}")
    if hbm is not None:
        profile = replace(profile, hbm_bytes=parse_size(hbm, "hbm"),
                          name=f"{profile.name} (memory overridden)")
    return profile


def host_link(gpu: GpuProfile, pcie_gen: int | None = None) -> LinkProfile:
    """The host DRAM -> device path of ONE device (each GPU has its own x16 link).

    Raises:
        ConfigError: for a PCIe generation other than 4 or 5.
    """
    if gpu.pcie_gen == 0:
        return LinkProfile("DRAM memcpy", DRAM_GBPS / 4, "single-stream memcpy, assumed")
    gen = pcie_gen or gpu.pcie_gen
    if gen not in PCIE_GBPS:
        raise ConfigError("pcie_gen", gen, "4 or 5")
    return LinkProfile(f"PCIe Gen{gen} x16", PCIE_GBPS[gen],
                       f"effective DMA, theoretical {31.5 if gen == 4 else 63:g} GB/s")


def nvme_link(gen: int = 4, drives: int = 1) -> LinkProfile:
    """Aggregate read bandwidth of `drives` NVMe drives of PCIe generation `gen`.

    Raises:
        ConfigError: for a generation other than 4 or 5, or drives < 1.
    """
    if gen not in NVME_GBPS:
        raise ConfigError("nvme_gen", gen, "4 or 5")
    if drives < 1:
        raise ConfigError("nvme_drives", drives, "an integer >= 1")
    return LinkProfile(f"NVMe Gen{gen} x{drives}", NVME_GBPS[gen] * drives,
                       "buffered sequential read, per drive: Gen4 6 GB/s, Gen5 12 GB/s")


def dram_link() -> LinkProfile:
    """Host DRAM bandwidth of one socket (caps all devices' host loads together)."""
    return LinkProfile("DRAM", DRAM_GBPS, "8-channel DDR5-4800, ~307 GB/s theoretical")


def _mem_total_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 16 * _GIB
