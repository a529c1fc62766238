"""The store's write-behind copies (kvtier.core.copies): page-aligned, reused only once no view
of a copy is left, and a bounded pool."""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch

from kvtier.core.copies import MIN_KEPT, CopyPool

SIZE = 64 << 10


def address(view: memoryview) -> int:
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


def test_a_copy_is_page_aligned_equal_and_independent_of_its_source() -> None:
    source = bytearray(np.random.default_rng(0).integers(0, 256, SIZE, dtype=np.uint8))
    copy = CopyPool().copy(memoryview(source))
    assert address(copy) % 4096 == 0 and bytes(copy) == bytes(source)
    source[:] = bytes(SIZE)
    assert bytes(copy) != bytes(source)


def test_a_buffer_is_reused_once_its_copy_is_gone() -> None:
    pool = CopyPool()
    first = pool.copy(memoryview(b"a" * SIZE))
    where = address(first)
    assert pool.idle(SIZE) == 0
    del first
    assert pool.idle(SIZE) == 1
    again = pool.copy(memoryview(b"b" * SIZE))
    assert address(again) == where and bytes(again) == b"b" * SIZE


VIEWS = {  # what writers make of a copy
    "slice": lambda copy: copy[128:],
    "numpy": lambda copy: np.frombuffer(copy, dtype=np.uint8)[7:],
    "torch": lambda copy: torch.frombuffer(copy, dtype=torch.uint8),
    "bytes view": lambda copy: memoryview(copy).cast("B")[1:],
}


@pytest.mark.parametrize("kind", VIEWS)
def test_a_view_made_from_a_copy_keeps_its_buffer_from_reuse(kind: str) -> None:
    pool = CopyPool()
    copy = pool.copy(memoryview(b"a" * SIZE))
    where, view = address(copy), VIEWS[kind](copy)
    del copy
    gc.collect()
    other = pool.copy(memoryview(b"b" * SIZE))
    assert address(other) != where
    assert bytes(memoryview(view.numpy() if isinstance(view, torch.Tensor) else view)[-1:]) \
        == b"a"
    del view
    gc.collect()
    assert address(pool.copy(memoryview(b"c" * SIZE))) == where  # now free again


def test_the_pool_keeps_a_bounded_number_of_idle_buffers() -> None:
    pool = CopyPool(keep_bytes=4 * SIZE)
    copies = [pool.copy(memoryview(bytes(SIZE))) for _ in range(10)]
    del copies
    assert pool.idle(SIZE) == 4
    big = 1 << 20
    large = [pool.copy(memoryview(bytes(big))) for _ in range(5)]  # 4 * SIZE < one of them
    del large
    assert pool.idle(big) == MIN_KEPT
