"""The disk tier's start-up walk: the chunk files of its layout directory, as compact as Python
allows, for the index thread to index oldest first (tiers/files/disk.py, diskindex.py).

At 2 million chunks the walk takes tens of seconds and its result must not cost an object per
file (issue 28): keys in a list, sizes and mtimes in arrays. A file of a size no chunk of
the layout can take is removed as corrupt, counted; the content of the others is verified
when read.

Primitives: `ScannedChunks`, `scan_chunk_files`.
"""

from __future__ import annotations

import threading
from array import array
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvtier.core.chunkformat import ALIGN_BYTES, HEADER_BYTES
from kvtier.core.keys import ChunkKey
from kvtier.tiers.files.chunkfiles import ChunkFiles
from kvtier.tiers.files.chunktree import walk_chunks


@dataclass(frozen=True, slots=True)
class ScannedChunks:
    """This layout's chunk files as the walk found them, file i at index i of each."""

    keys: list[ChunkKey]
    sizes: array[int]  # each file's bytes
    mtimes: array[float]  # each file's modification time (its last use)
    corrupt: int  # files removed for a size no chunk of the layout takes

    def oldest_first(self) -> npt.NDArray[np.intp]:
        """The files' indices, least recently used first (ties in walk order): an array, not
        a list, so that only a batch at a time becomes Python ints."""
        return np.argsort(np.asarray(self.mtimes, dtype=np.float64), kind="stable")


def scan_chunk_files(files: ChunkFiles, owned: bool, stop: threading.Event) -> ScannedChunks:
    """Walk `files`' layout directory (`owned`: this process owns it, so every temp file is
    a dead writer's, `walk_chunks`); stops early, with what it found, once `stop` is set.
    Removes the files of a size no chunk of this layout takes. The index thread only."""
    keys: list[ChunkKey] = []
    sizes, mtimes = array("q"), array("d")
    corrupt = 0
    for found in walk_chunks(files, owned):
        if stop.is_set():
            break
        # Any size a chunk of this layout can take (encoded chunks are smaller, sealed
        # ones a page larger); the content is verified when read.
        size = found.size_bytes
        if size % ALIGN_BYTES or not HEADER_BYTES < size <= files.max_file_bytes:
            files.remove(found.key)
            corrupt += 1
            continue
        keys.append(found.key)
        sizes.append(size)
        mtimes.append(found.mtime)
    return ScannedChunks(keys, sizes, mtimes, corrupt)
