"""A node's RAM slab, as an engine maps it, registered for DMA (engines on CUDA).

The node's RAM tier is a file in /dev/shm that each engine maps (`NodeClient`); a GPU
engine's device mover copies chunks between it and the GPU. Pageable, each copy is staged by
the driver; registered with `cudaHostRegister`, the mapping is DMA'd like the pinned slab of
an in-process memory tier (tests/gpu/test_cuda_batches.py times the two). A registration
lasts as long as its mapping: the client ends it (`unregister_for_dma`) when the last view of
a slab it let go (a restarted node's predecessor's) is gone, just before it is unmapped.

Primitives: `register_for_dma`, `unregister_for_dma`.
"""

from __future__ import annotations

import logging
import mmap

log = logging.getLogger(__name__)


def register_for_dma(mapping: mmap.mmap) -> bool:
    """Register `mapping`'s pages with CUDA. False where there is no CUDA (a CPU engine:
    nothing to register) or the driver refused (logged: copies still work, staged)."""
    try:
        import torch
    except ImportError:
        return False
    if not torch.cuda.is_available():
        return False
    data = torch.frombuffer(mapping, dtype=torch.uint8)
    cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]
    error = int(cudart.cudaHostRegister(data.data_ptr(), data.numel(), 0))
    if error:
        log.warning("kvtier: the node's slab (%d B) could not be registered for DMA (CUDA "
                    "error %d); GPU copies from it are staged by the driver", len(mapping),
                    error)
        return False
    return True


def unregister_for_dma(mapping: mmap.mmap) -> None:
    """End `mapping`'s registration (`register_for_dma`), before it is unmapped: no copy
    uses it any more. A failure is logged (the pages stay pinned until the process ends)."""
    import torch  # registered: torch and CUDA are there

    data = torch.frombuffer(mapping, dtype=torch.uint8)
    cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]
    try:
        error = int(cudart.cudaHostUnregister(data.data_ptr()))
    except RuntimeError as exc:  # CUDA torn down: nothing left to unpin
        log.warning("kvtier: the node's old slab could not be unregistered for DMA: %s", exc)
        return
    if error:
        log.warning("kvtier: the node's old slab (%d B) could not be unregistered for DMA "
                    "(CUDA error %d)", len(mapping), error)
