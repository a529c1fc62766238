"""Whether a benchmark's buffers fit in this machine's memory, asked before one is allocated.

The benches size their buffers by what the operator gives (`bench copy --blocks`, `bench
storage --sizes`/`--trial-bytes`, `bench mover --chunks`, ...). A size beyond the machine
ended in torch's or numpy's allocation error, a MemoryError traceback, or the OOM killer
half-way through a run (on a shared machine, maybe another process's). Each bench's config
says what it needs (`MemoryNeed`) and its `validate` refuses a run that does not fit, in one
line: the option, its value, the bytes needed and the bytes available.

Primitives: `MemoryNeed`, `require_memory`, `available_host_bytes`, `available_cuda_bytes`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvtier.errors import NotEnoughMemory
from kvtier.units import format_size


@dataclass(frozen=True, slots=True)
class MemoryNeed:
    """What one run allocates at its peak, and the option that sizes it."""

    option: str  # the command line's option named in a refusal, e.g. "--blocks"
    value: object  # its value as given (or as the run resolved it: --quick's, the default)
    host_bytes: int  # host RAM (pageable and pinned, and /dev/shm: all count against it)
    device_bytes: int = 0  # memory on the CUDA device (0: the run uses none)
    what: str = ""  # how the bytes come about, e.g. "64 blocks of 2 MiB, 5 copies"


def available_host_bytes() -> int:
    """RAM that can be allocated without swapping: the kernel's MemAvailable (free memory
    plus the page cache and slabs it can reclaim), through psutil (imported here: `kvtier`
    imports the benches' configs to build its parser, tests/tools/test_startup.py)."""
    import psutil

    return int(psutil.virtual_memory().available)


def available_cuda_bytes() -> int | None:
    """Free memory on the current CUDA device (torch.cuda.mem_get_info), or None where torch
    or CUDA is missing. Imports torch: call it only for a run on CUDA."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    free, _total = torch.cuda.mem_get_info()
    return int(free)


def require_memory(need: MemoryNeed) -> None:
    """Refuse a run whose buffers do not fit in the memory available now.

    Raises:
        NotEnoughMemory: host RAM (MemAvailable) or the CUDA device's free memory is less
            than `need` says; the message names the option, its value, both figures.
    """
    checks: list[tuple[str, int, Callable[[], int | None], str]] = [
        ("host RAM", need.host_bytes, available_host_bytes, "MemAvailable")]
    if need.device_bytes:
        checks.append(("CUDA memory", need.device_bytes, available_cuda_bytes,
                       "torch.cuda.mem_get_info"))
    for memory, needed, available_of, source in checks:
        available = available_of()
        if available is not None and needed > available:
            how = f" ({need.what})" if need.what else ""
            raise NotEnoughMemory(
                need.option, need.value, needed, available,
                f"the run needs {format_size(needed)} of {memory}{how}, {format_size(available)}"
                f" is available ({source})")
