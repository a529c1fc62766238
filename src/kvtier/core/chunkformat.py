"""The stored format of a chunk outside process memory (disk, shared directory, remote).

A stored chunk is a HEADER_BYTES header followed by the payload, zero-padded to a multiple of
ALIGN_BYTES so the payload starts and ends on O_DIRECT boundaries. The header carries magic,
format version, layout digest, key, payload size, the payload's xxh3-64 checksum and a checksum
of the header itself. A reader verifies all of it before a byte is used: stored data is
untrusted and is never unpickled.

Primitives: `encode_header`, `verify_header`, `verify_payload`, `stored_size`.
"""

from __future__ import annotations

import struct

import xxhash

from kvtier.core.keys import KEY_BYTES, ChunkKey
from kvtier.errors import CorruptBlock

MAGIC = b"KVTIERC\x00"
VERSION = 1
ALIGN_BYTES = 4096  # O_DIRECT alignment of offsets, sizes and buffers
HEADER_BYTES = ALIGN_BYTES
# magic, version, flags, layout digest, key, payload size, payload checksum
_FIELDS = struct.Struct(f"<8sHH16s{KEY_BYTES}sQQ")
_HEADER_SUM = struct.Struct("<Q")


def stored_size(payload_bytes: int) -> int:
    """Bytes a chunk of `payload_bytes` takes once stored (header + aligned payload)."""
    return HEADER_BYTES + -(-payload_bytes // ALIGN_BYTES) * ALIGN_BYTES


def checksum(payload: memoryview | bytes) -> int:
    """The payload checksum (xxh3-64)."""
    return xxhash.xxh3_64_intdigest(payload)


def encode_header(key: ChunkKey, layout_digest: str, payload: memoryview | bytes) -> bytes:
    """Return the HEADER_BYTES header for `payload` stored under `key`."""
    fields = _FIELDS.pack(
        MAGIC, VERSION, 0, bytes.fromhex(layout_digest), key, len(payload), checksum(payload)
    )
    fields += _HEADER_SUM.pack(xxhash.xxh3_64_intdigest(fields))
    return fields.ljust(HEADER_BYTES, b"\0")


def verify_header(header: memoryview | bytes, key: ChunkKey, layout_digest: str) -> tuple[int, int]:
    """Check a header read back; return (payload size, payload checksum).

    Raises:
        CorruptBlock: short header, bad magic, unknown version, header checksum mismatch,
            or a layout or key other than expected.
    """
    end = _FIELDS.size + _HEADER_SUM.size
    if len(header) < end:
        raise CorruptBlock(f"short header: {len(header)} bytes")
    fields = bytes(header[: _FIELDS.size])
    magic, version, _flags, layout, stored_key, size, payload_sum = _FIELDS.unpack(fields)
    if magic != MAGIC:
        raise CorruptBlock("bad magic")
    (header_sum,) = _HEADER_SUM.unpack(bytes(header[_FIELDS.size : end]))
    if header_sum != xxhash.xxh3_64_intdigest(fields):
        raise CorruptBlock("header checksum mismatch")
    if version != VERSION:
        raise CorruptBlock(f"unknown format version {version}")
    if layout != bytes.fromhex(layout_digest):
        raise CorruptBlock("layout digest mismatch")
    if stored_key != key:
        raise CorruptBlock("key mismatch")
    return size, payload_sum


def verify_payload(payload: memoryview | bytes, expected_checksum: int) -> None:
    """Raises CorruptBlock when the payload's checksum differs from the header's."""
    if checksum(payload) != expected_checksum:
        raise CorruptBlock("payload checksum mismatch")
