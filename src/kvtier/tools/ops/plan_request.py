"""What `kvtier plan` is asked: the one input of the sizing (`sizing.make_plan`) and of the
per-backend alternatives (`alternatives.build_alternatives`), in a module of its own so that
neither imports the other for it.

Primitives: `PlanRequest`.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtier.node.cli import DEFAULT_SOCKET
from kvtier.tools.ops.hardware import GpuProfile
from kvtier.tools.ops.modelspec import ModelSpec
from kvtier.tools.ops.vllm_versions import Version


@dataclass(frozen=True, slots=True)
class PlanRequest:
    """What `kvtier plan` is asked; sizes in bytes."""

    model: ModelSpec  # from load_model_spec
    gpu: GpuProfile  # from gpu_profile
    tp: int = 1  # tensor-parallel size (GPUs per instance)
    gpu_memory_utilization: float = 0.9  # vLLM --gpu-memory-utilization
    host_ram_bytes: int = 0  # host RAM of the node; 0 = assume DEFAULT_HOST_RAM_PER_GPU x tp
    host_kv_fraction: float = 0.6  # share of host RAM given to the CPU tier (50-70% advised)
    nvme_bytes: int | None = None  # NVMe space; None = assume DEFAULT_NVME_BYTES; 0 = none
    nvme_path: str = "/mnt/nvme/kvtier"  # where the disk tier lives
    nvme_gen: int = 4  # NVMe PCIe generation
    pcie_gen: int | None = None  # host<->GPU link generation; None = the GPU's own
    context_tokens: int = 0  # typical session length; 0 = min(model max, 32k)
    concurrency: int = 16  # sessions expected to run at once
    kv_dtype: str = "bf16"  # vLLM --kv-cache-dtype
    vllm_version: Version | None = None  # decides the hybrid-manager flag
    cpu_tier_bytes: int | None = None  # force the CPU tier size (total across ranks)
    model_ref: str = "<model>"  # what `vllm serve` is given: a hub id or the model's folder
    tokens_per_chunk: int | None = None  # kvtier's tokens_per_chunk; None: the connector picks
    # Engines of this model on one node sharing one `kvtier node` (each with `tp` ranks): the
    # node's RAM and its KV share are theirs together; 0: one engine, no node sizing.
    node_engines: int = 0
    node_socket: str = DEFAULT_SOCKET  # the node's socket in the printed commands
    node_shm_bytes: int = 0  # the node's /dev/shm; 0 = assume half its RAM (a tmpfs's default)
    # This machine's /dev/shm, measured by the CLI (the node may run here); None: unknown.
    local_shm_bytes: int | None = None
