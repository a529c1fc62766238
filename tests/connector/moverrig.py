"""The rig of the device mover's tests (test_stream_mover*.py): vLLM's KV (a `PagedKV`) on the
CPU stand-in device, a store of a memory tier over a disk tier, the `StreamChunkMover` between
them and a load's pinned spares. A context manager: `with Rig(...) as rig:` closes the mover,
the store and the device."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from types import TracebackType

from kvtier.core.keys import ChunkKey
from kvtier.core.store import TieredStore
from kvtier.integrations.vllm.worker.cpu import spare_buffers
from kvtier.integrations.vllm.worker.paged import PagedKV
from kvtier.integrations.vllm.worker.streams import StreamChunkMover
from kvtier.testing.standin import StandInDevice, StandInEvent, StandInStream
from kvtier.tiers import open_store
from kvtier.tiers.storeconfig import StoreConfig

# The mover's waits between its own streams: a copy engine's DMA and the scatter or gather on
# the other side of it.
COPY_WAITS = ({"load copy", "load"}, {"store", "store copy"})


class NoWaits(StandInDevice):
    """A device on which the mover's waits for vLLM's work, and vLLM's for the mover's, are
    lost (the bug the scenarios catch); its waits between its own streams are kept."""

    def wait(self, stream: StandInStream, event: StandInEvent) -> None:  # type: ignore[override]
        self.waits += 1
        if event.stream is not None and {stream.name, event.stream.name} in COPY_WAITS:
            super().wait(stream, event)


class NoCopyWaits(StandInDevice):
    """A device on which the mover's waits between its own streams are lost: a DMA runs
    before the gather it copies, a scatter before the DMA it scatters."""

    def wait(self, stream: StandInStream, event: StandInEvent) -> None:  # type: ignore[override]
        self.waits += 1
        if event.stream is None or {stream.name, event.stream.name} not in COPY_WAITS:
            super().wait(stream, event)


class MoverRig:
    """`paged` (on `device`), `ram_chunks` chunks of RAM (0: none) over a disk tier under
    `tmp`, the mover (`staging` chunks of staging per direction, in batches of `batch`
    chunks: by default 2 buffers of one chunk, a chunk at a time), 4 spares; states noted to
    `note_state`."""

    def __init__(self, tmp: Path, device: StandInDevice, paged: PagedKV, tokens_per_chunk: int,
                 ram_chunks: int = 16,
                 note_state: Callable[[ChunkKey, bool], None] = lambda _k, _s: None,
                 staging: int = 2, batch: int | None = None) -> None:
        self.paged = paged
        layout = paged.layout(tokens_per_chunk)
        self.chunk_bytes = layout.bytes_per_chunk
        slot_bytes = -(-self.chunk_bytes // 4096) * 4096  # the memory tier's slots
        ram = [{"kind": "memory", "capacity": ram_chunks * slot_bytes, "pin": "off"}] \
            if ram_chunks else []  # none: a disk-only store (no slots: chunks go by spare)
        self.store: TieredStore = open_store(StoreConfig.parse({"tiers": [
            *ram, {"kind": "disk", "path": str(tmp / "disk"), "capacity": "64MiB"}]}), layout)
        self.device = device
        self.mover = StreamChunkMover(paged, self.store, self.chunk_bytes,
                                      note_state=note_state, device=device, staging=staging,
                                      batch=batch)
        self.spares = spare_buffers(4, self.chunk_bytes, device.pinned)

    def close(self) -> None:
        self.mover.close()
        self.store.close()
        self.device.close()

    def __enter__(self) -> MoverRig:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
