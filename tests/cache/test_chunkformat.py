"""The stored chunk format: a self-describing header that a reader verifies field by field
before one payload byte is trusted.

Header layout (little-endian), as written by `encode_header`:
    0 magic(8) | 8 version(2) | 10 flags(2) | 12 layout digest(16) | 28 key(16)
    | 44 payload size(8) | 52 payload xxh3-64(8) | 60 xxh3-64 of bytes 0..60 (8) | zeros
"""

from __future__ import annotations

import os
import struct

import pytest
import xxhash

from kvtier.core.chunkformat import (
    ALIGN_BYTES,
    HEADER_BYTES,
    MAGIC,
    encode_header,
    stored_size,
    verify_header,
    verify_payload,
)
from kvtier.errors import CorruptChunk

KEY = bytes(range(16))
OTHER_KEY = bytes(range(1, 17))
LAYOUT = "ab" * 16
PAYLOAD = os.urandom(10_000)

# field -> (offset, struct format, a wrong value)
FIELDS = {
    "magic": (0, "8s", b"LMCACHE\x00"),
    "version": (8, "H", 2),
    "layout": (12, "16s", bytes.fromhex("cd" * 16)),
    "key": (28, "16s", OTHER_KEY),
}


def _with_field(header: bytes, offset: int, fmt: str, value: object, resum: bool) -> bytes:
    """`header` with one field replaced; with `resum`, its header checksum made valid again
    (a well-formed header of another chunk, rather than random damage)."""
    tampered = bytearray(header)
    struct.pack_into("<" + fmt, tampered, offset, value)
    if resum:
        struct.pack_into("<Q", tampered, 60, xxhash.xxh3_64_intdigest(bytes(tampered[:60])))
    return bytes(tampered)


def test_a_header_round_trips_to_size_and_checksum() -> None:
    """Write a header, read it back: it yields the payload's size and checksum."""
    header = encode_header(KEY, LAYOUT, PAYLOAD)
    assert len(header) == HEADER_BYTES and header.startswith(MAGIC)
    size, payload_sum = verify_header(header, KEY, LAYOUT)
    assert size == len(PAYLOAD)
    verify_payload(PAYLOAD, payload_sum)


def test_stored_size_is_header_plus_payload_rounded_up_to_the_alignment() -> None:
    assert stored_size(ALIGN_BYTES) == HEADER_BYTES + ALIGN_BYTES
    assert stored_size(1) == HEADER_BYTES + ALIGN_BYTES
    assert stored_size(10_000) == HEADER_BYTES + 3 * ALIGN_BYTES
    assert stored_size(32 * 2**20) == HEADER_BYTES + 32 * 2**20


@pytest.mark.parametrize("field", list(FIELDS))
@pytest.mark.parametrize("resum", [False, True], ids=["damaged", "well-formed"])
def test_each_wrong_header_field_is_corrupt(field: str, resum: bool) -> None:
    """A header of another format, version, layout or key - whether damaged bits or a
    well-formed header of something else - must never be accepted."""
    offset, fmt, wrong = FIELDS[field]
    header = _with_field(encode_header(KEY, LAYOUT, PAYLOAD), offset, fmt, wrong, resum)
    with pytest.raises(CorruptChunk):
        verify_header(header, KEY, LAYOUT)


@pytest.mark.parametrize("offset", [44, 52])
def test_damaged_size_or_payload_checksum_fields_fail_the_header_checksum(offset: int) -> None:
    """One flipped bit in the size or payload checksum field is caught by the header's own
    checksum (the size check and payload check then never see a lying header)."""
    header = bytearray(encode_header(KEY, LAYOUT, PAYLOAD))
    header[offset] ^= 0x01
    with pytest.raises(CorruptChunk, match="header checksum"):
        verify_header(bytes(header), KEY, LAYOUT)


def test_a_short_header_is_corrupt_not_an_index_error() -> None:
    with pytest.raises(CorruptChunk, match="short"):
        verify_header(encode_header(KEY, LAYOUT, PAYLOAD)[:50], KEY, LAYOUT)
    with pytest.raises(CorruptChunk):
        verify_header(b"", KEY, LAYOUT)


def test_a_zero_filled_header_is_corrupt() -> None:
    """A file preallocated but never written (a crash between create and write) reads as
    zeros: that is not a chunk."""
    with pytest.raises(CorruptChunk):
        verify_header(bytes(HEADER_BYTES), KEY, LAYOUT)


def test_one_flipped_payload_bit_fails_the_payload_checksum() -> None:
    _size, payload_sum = verify_header(encode_header(KEY, LAYOUT, PAYLOAD), KEY, LAYOUT)
    damaged = bytearray(PAYLOAD)
    damaged[1234] ^= 0x80
    with pytest.raises(CorruptChunk, match="payload checksum"):
        verify_payload(bytes(damaged), payload_sum)
    with pytest.raises(CorruptChunk):
        verify_payload(PAYLOAD[:-1], payload_sum)
