"""The stored format of a chunk outside process memory (disk, shared directory, remote).

A stored chunk is a HEADER_BYTES header followed by its stored bytes (the *body*), zero-padded
to a multiple of ALIGN_BYTES in files so the body starts and ends on O_DIRECT boundaries. A
reader verifies all of it before a byte is used: stored data is untrusted and is never
unpickled.

Version 1 (a chunk stored as is; what every kvtier writes without a codec or encryption, and
all the previous release wrote): magic, version, flags (0), layout digest, key, payload size,
the payload's xxh3-64, then an xxh3-64 of those fields. The body is the payload.

Version 2 (a codec, or encryption): the version 1 fields, then the codec id, the seal (0 in
clear, 1 AES-256-GCM), the body's size and xxh3-64 (verified before anything is decoded), the
tenant key's id and the nonce, then the xxh3-64 of all of it. In clear, the payload checksum
field is the decoded payload's, checked after decoding, so a codec bug cannot hand back wrong
KV. Sealed (compress, then encrypt), the body is AES-256-GCM(payload checksum (8) + encoded
bytes) + tag, with every header field before the body checksum as associated data (a header
moved onto other bytes fails authentication), and the header's payload checksum field is 0:
a checksum of the plaintext would let anyone confirm a guess of it.

A chunk whose format version, codec or key this reader does not know is a miss, like a
corrupt one (`CodecFailure`, `AuthFailure` are CorruptChunks; `failure_of` says which).

Primitives: `ChunkEncoder` (a tier's `encode` on write threads / `decode` on reads), `Encoded`,
`ChunkHeader`, `read_header`, `encode_header` + `verify_header` + `verify_payload` (version
1), `stored_size`, `checksum`, `failure_of` (the Failure of a `CorruptChunk` from kvtier.errors).
"""

from __future__ import annotations

import mmap
import struct
import threading
from dataclasses import dataclass

import xxhash

from kvtier.core.codecs import Codec, codec_by_id, make_codec
from kvtier.core.keys import KEY_BYTES, ChunkKey
from kvtier.core.sealing import (
    KEY_ID_BYTES,
    NONCE_BYTES,
    SEAL_OVERHEAD,
    Sealer,
    TenantKey,
    new_nonce,
)
from kvtier.core.tier import Failure
from kvtier.errors import AuthFailure, CodecFailure, CorruptChunk, KeyNotHeld

MAGIC = b"KVTIERC\x00"
VERSION = 1  # a chunk stored as is
VERSION_ENCODED = 2  # a codec or a seal
ALIGN_BYTES = 4096  # O_DIRECT alignment of offsets, sizes and buffers
HEADER_BYTES = ALIGN_BYTES
SEAL_AES_GCM = 1
CHECKSUM_BYTES = 8
# magic, version, flags, layout digest, key, payload size, payload checksum
_FIELDS = struct.Struct(f"<8sHH16s{KEY_BYTES}sQQ")
# version 2 adds: codec id, seal, 6 reserved, body size, body checksum, key id, nonce
_V2_FIELDS = struct.Struct(f"<8sHH16s{KEY_BYTES}sQQBB6xQQ{KEY_ID_BYTES}s{NONCE_BYTES}s")
_HEADER_SUM = struct.Struct("<Q")
_U64 = struct.Struct("<Q")


def failure_of(exc: CorruptChunk) -> Failure:
    """The Failure reason of a chunk that did not verify: NO_KEY, AUTH, CODEC or CORRUPT."""
    if isinstance(exc, KeyNotHeld):
        return Failure.NO_KEY
    if isinstance(exc, AuthFailure):
        return Failure.AUTH
    if isinstance(exc, CodecFailure):
        return Failure.CODEC
    return Failure.CORRUPT


def stored_size(payload_bytes: int) -> int:
    """Bytes a chunk whose body is `payload_bytes` takes in a file (header + aligned body)."""
    return HEADER_BYTES + -(-payload_bytes // ALIGN_BYTES) * ALIGN_BYTES


def checksum(payload: memoryview | bytes | bytearray) -> int:
    """The payload checksum (xxh3-64)."""
    return xxhash.xxh3_64_intdigest(payload)


@dataclass(frozen=True, slots=True)
class ChunkHeader:
    """A verified header (`read_header`)."""

    version: int
    payload_bytes: int  # the chunk's size decoded
    payload_sum: int  # xxh3-64 of the decoded payload (0 when sealed: it is inside the body)
    codec_id: int = 0
    seal: int = 0  # 0: in clear; SEAL_AES_GCM
    body_bytes: int = 0  # bytes stored after the header (version 1: payload_bytes)
    body_sum: int = 0  # xxh3-64 of those bytes (version 1: payload_sum)
    key_id: bytes = bytes(KEY_ID_BYTES)
    nonce: bytes = bytes(NONCE_BYTES)

    @property
    def plain(self) -> bool:
        """Whether the body is the payload itself (no codec, no seal)."""
        return self.codec_id == 0 and self.seal == 0


def encode_header(key: ChunkKey, layout_digest: str, payload: memoryview | bytes) -> bytes:
    """Return the version 1 HEADER_BYTES header for `payload` stored as is under `key`."""
    fields = _FIELDS.pack(
        MAGIC, VERSION, 0, bytes.fromhex(layout_digest), key, len(payload), checksum(payload)
    )
    fields += _HEADER_SUM.pack(xxhash.xxh3_64_intdigest(fields))
    return fields.ljust(HEADER_BYTES, b"\0")


def _v2_fields(key: ChunkKey, layout_digest: str, h: ChunkHeader) -> bytes:
    return _V2_FIELDS.pack(MAGIC, VERSION_ENCODED, 0, bytes.fromhex(layout_digest), key,
                           h.payload_bytes, h.payload_sum, h.codec_id, h.seal, h.body_bytes,
                           h.body_sum, h.key_id, h.nonce)


def _aad(key: ChunkKey, layout_digest: str, h: ChunkHeader) -> bytes:
    """What a seal authenticates besides the body: every header field but the body checksum
    (computed over the sealed bytes, after sealing)."""
    return _v2_fields(key, layout_digest, ChunkHeader(
        h.version, h.payload_bytes, h.payload_sum, h.codec_id, h.seal, h.body_bytes, 0,
        h.key_id, h.nonce))


def _pack(key: ChunkKey, layout_digest: str, h: ChunkHeader) -> bytes:
    fields = _v2_fields(key, layout_digest, h)
    fields += _HEADER_SUM.pack(xxhash.xxh3_64_intdigest(fields))
    return fields.ljust(HEADER_BYTES, b"\0")


def read_header(header: memoryview | bytes, key: ChunkKey, layout_digest: str) -> ChunkHeader:
    """Check a header read back (version 1 or 2) and return its fields.

    Raises:
        CorruptChunk: short header, bad magic, unknown version, header checksum mismatch,
            or a layout or key other than expected.
    """
    if len(header) < _FIELDS.size + _HEADER_SUM.size:
        raise CorruptChunk(f"short header: {len(header)} bytes")
    magic, version = struct.unpack_from("<8sH", header)
    if magic != MAGIC:
        raise CorruptChunk("bad magic")
    layout_size = _V2_FIELDS if version == VERSION_ENCODED else _FIELDS
    end = layout_size.size + _HEADER_SUM.size
    if len(header) < end:
        raise CorruptChunk(f"short header: {len(header)} bytes")
    fields = bytes(header[: layout_size.size])
    (header_sum,) = _HEADER_SUM.unpack(bytes(header[layout_size.size : end]))
    if header_sum != xxhash.xxh3_64_intdigest(fields):
        raise CorruptChunk("header checksum mismatch")
    if version not in (VERSION, VERSION_ENCODED):
        raise CorruptChunk(f"unknown format version {version}")
    values = layout_size.unpack(fields)
    if values[3] != bytes.fromhex(layout_digest):
        raise CorruptChunk("layout digest mismatch")
    if values[4] != key:
        raise CorruptChunk("key mismatch")
    size, payload_sum = values[5], values[6]
    if version == VERSION:
        return ChunkHeader(VERSION, size, payload_sum, body_bytes=size, body_sum=payload_sum)
    codec_id, seal, body_bytes, body_sum, key_id, nonce = values[7:]
    return ChunkHeader(VERSION_ENCODED, size, payload_sum, codec_id, seal, body_bytes,
                       body_sum, key_id, nonce)


def verify_header(header: memoryview | bytes, key: ChunkKey, layout_digest: str) -> tuple[int, int]:
    """Check a header read back; return (payload size, payload checksum) (see read_header).

    Raises:
        CorruptChunk: as `read_header`.
    """
    h = read_header(header, key, layout_digest)
    return h.payload_bytes, h.payload_sum


def verify_payload(payload: memoryview | bytes, expected_checksum: int) -> None:
    """Raises CorruptChunk when the payload's checksum differs from the header's."""
    if checksum(payload) != expected_checksum:
        raise CorruptChunk("payload checksum mismatch")


@dataclass(frozen=True, slots=True)
class Encoded:
    """A chunk ready to store: its header and its body."""

    header: bytes  # HEADER_BYTES
    body: memoryview  # the bytes after the header (the payload itself when `plain`)
    plain: bool  # version 1: the body is the caller's payload, not a copy
    # `body` in a page-aligned buffer zero-padded to a multiple of ALIGN_BYTES, when it is in
    # one (a file tier writes it with O_DIRECT as is); else None
    padded: memoryview | None = None


class ChunkEncoder:
    """How one tier stores chunks of one layout: its codec and its sealer. Thread-safe.

    `encode` runs where writes run (the store's write-behind threads); `decode` on the read
    path, from the bytes read into the caller's buffer. Both take the chunk's tenant
    (`ChunkMeta.tenant`, from the tier call): the sealing key is that tenant's. Without a
    codec and a sealer every chunk is version 1, byte for byte what the previous release
    wrote.
    """

    def __init__(self, layout_digest: str, dtype: str, payload_bytes: int,
                 codec: str = "none", sealer: Sealer | None = None) -> None:
        """Raises:
            ConfigError: an unknown codec, or one that cannot encode `dtype`.
        """
        self.layout_digest = layout_digest
        self.dtype = dtype
        self.payload_bytes = payload_bytes
        self.codec: Codec = make_codec(codec, dtype)
        self.sealer = sealer
        # A codec's output is kept only when smaller than the payload; a seal adds its tag
        # and the sealed payload checksum.
        self.max_body_bytes = payload_bytes + (
            SEAL_OVERHEAD + CHECKSUM_BYTES if sealer is not None else 0)
        self._local = threading.local()

    @property
    def plain(self) -> bool:
        """Whether every chunk is stored as is (version 1)."""
        return self.codec.id == 0 and self.sealer is None

    def _key_of(self, tenant: str | None) -> TenantKey | None:
        """The key a chunk of `tenant` is sealed under here, or None (stored in clear)."""
        if self.sealer is None:
            return None
        return self.sealer.key_for(tenant)

    def encode(self, key: ChunkKey, payload: memoryview, tenant: str | None = None) -> Encoded:
        """The header and body of `payload` (one chunk of `tenant`) stored under `key`:
        compressed by the codec (kept only when smaller), then sealed when the tenant has a
        key here.

        A sealed body lives in this thread's buffer: store it before this thread encodes
        another chunk (as the tiers do: encode, then write, on one thread)."""
        tenant_key = self._key_of(tenant)
        codec, body = self.codec, b""
        if codec.id != 0:
            body = codec.encode(payload)
            if len(body) >= len(payload):
                codec = make_codec("none", self.dtype)
        if codec.id == 0 and tenant_key is None:
            return Encoded(encode_header(key, self.layout_digest, payload), payload, True)
        if codec.lossy:  # the checksum of what readers will get back
            decoded = bytearray(len(payload))
            codec.decode(memoryview(body), memoryview(decoded))
            payload_sum = checksum(decoded)
        elif codec.id != 0 or tenant_key is None:
            payload_sum = checksum(payload)
        else:  # sealed as is: the tag proves the payload, no checksum of it is stored
            payload_sum = 0
        encoded: bytes | memoryview = body if codec.id != 0 else payload
        if tenant_key is None:
            h = ChunkHeader(VERSION_ENCODED, len(payload), payload_sum, codec.id, 0,
                            len(encoded), checksum(encoded))
            return Encoded(_pack(key, self.layout_digest, h), memoryview(encoded), False)
        # Stored as is, the payload is encrypted straight from the caller's buffer (no codec,
        # so no decoded checksum: the tag alone proves it); else checksum + encoded bytes.
        plain = encoded if codec.id == 0 else _U64.pack(payload_sum) + bytes(encoded)
        sealed_bytes = len(plain) + SEAL_OVERHEAD
        h = ChunkHeader(VERSION_ENCODED, len(payload), 0, codec.id, SEAL_AES_GCM,
                        sealed_bytes, 0, tenant_key.key_id, new_nonce())
        padded = self._seal_buffer(sealed_bytes)
        sealed = padded[:sealed_bytes]
        tenant_key.seal_into(h.nonce, plain, _aad(key, self.layout_digest, h), sealed)
        h = ChunkHeader(h.version, h.payload_bytes, 0, h.codec_id, h.seal, h.body_bytes,
                        checksum(sealed), h.key_id, h.nonce)
        return Encoded(_pack(key, self.layout_digest, h), sealed, False, padded)

    def _seal_buffer(self, size: int) -> memoryview:
        """This thread's page-aligned buffer for a sealed body of `size` bytes, zero-padded
        to ALIGN_BYTES (a file tier writes it with O_DIRECT as is, without a bounce copy).
        Reused: a fresh buffer per chunk cost more in page faults than the encryption
        (1.2 GB/s against AES-GCM's 10 here)."""
        buffer: mmap.mmap | None = getattr(self._local, "seal_buffer", None)
        if buffer is None:
            capacity = -(-self.max_body_bytes // ALIGN_BYTES) * ALIGN_BYTES
            buffer = self._local.seal_buffer = mmap.mmap(-1, capacity)
        end = -(-size // ALIGN_BYTES) * ALIGN_BYTES
        view = memoryview(buffer)
        view[size:end] = bytes(end - size)
        return view[:end]

    def decode(self, key: ChunkKey, header: ChunkHeader, body: memoryview,
               out: memoryview, tenant: str | None = None) -> None:
        """Verify `body` (exactly header.body_bytes) of a chunk of `tenant` against `header`
        and decode it into `out` (one chunk); `out` holds undefined bytes when this raises.
        `body` may be `out` itself only for a plain chunk.

        Raises:
            CorruptChunk: a size or checksum mismatch.
            KeyNotHeld: sealed under a key this reader does not hold for `tenant` (another
                tenant's, another secret's): not tampering, the chunk is kept.
            AuthFailure: tampered (it fails under the right key), or in clear where this
                tier seals the tenant's chunks.
            CodecFailure: an unknown codec, or bytes that do not decode to the payload.
        """
        if header.payload_bytes != len(out):
            raise CorruptChunk(f"payload is {header.payload_bytes} bytes, expected {len(out)}")
        if len(body) != header.body_bytes:
            raise CorruptChunk(f"body is {len(body)} bytes, header says {header.body_bytes}")
        if checksum(body) != header.body_sum:
            raise CorruptChunk("payload checksum mismatch")
        if not header.seal and self._key_of(tenant) is not None:
            # Whoever can write the directory or the server could otherwise replace a sealed
            # chunk with one in clear, checksums and all.
            raise AuthFailure("stored in clear where this tier seals the chunk's tenant")
        if header.plain:
            if body is not out:
                out[:] = body
            return
        codec = codec_by_id(header.codec_id, self.dtype)
        if codec is None:
            raise CodecFailure(f"unknown codec id {header.codec_id} (written by a newer kvtier?)")
        payload_sum = header.payload_sum
        encoded = body
        if header.seal:
            tenant_key = self._tenant_key(tenant, header)
            aad = _aad(key, self.layout_digest, header)
            if header.codec_id == 0:  # stored as is: decrypted straight into `out`
                if header.body_bytes != len(out) + SEAL_OVERHEAD:
                    raise CorruptChunk(f"sealed body of {header.body_bytes} bytes")
                tenant_key.open_into(header.nonce, body, aad, out)
                return
            if header.body_bytes < CHECKSUM_BYTES + SEAL_OVERHEAD:
                raise CorruptChunk(f"sealed body of {header.body_bytes} bytes")
            scratch = self._scratch(header.body_bytes - SEAL_OVERHEAD)
            tenant_key.open_into(header.nonce, body, aad, scratch)
            (payload_sum,) = _U64.unpack_from(scratch)
            encoded = scratch[CHECKSUM_BYTES:]
        try:
            codec.decode(encoded, out)
        except CodecFailure:
            raise
        except CorruptChunk as exc:
            raise CodecFailure(f"{codec.name}: {exc}") from None
        if checksum(out) != payload_sum:
            raise CodecFailure(f"{codec.name}: decoded payload checksum mismatch")

    def _tenant_key(self, tenant: str | None, header: ChunkHeader) -> TenantKey:
        """The key that opens a sealed chunk of `tenant`. Raises KeyNotHeld, CodecFailure."""
        if header.seal != SEAL_AES_GCM:
            raise CodecFailure(f"unknown seal {header.seal}")
        tenant_key = self._key_of(tenant)
        if tenant_key is None or tenant_key.key_id != header.key_id:
            raise KeyNotHeld("sealed under a key this reader does not hold (another "
                             "tenant's, or another secret's)")
        return tenant_key

    def _scratch(self, size: int) -> memoryview:
        """`size` bytes of this thread's buffer, which grows to the largest size asked and is
        then reused. A compressed body's size differs chunk by chunk: a buffer of exactly
        its size, made anew (zeroed, page-faulted) for nearly every sealed get, held a
        sealed zstd disk tier's gets to 0.57-0.68x of the same tier in clear (`kvtier bench
        codecs`)."""
        scratch: bytearray | None = getattr(self._local, "scratch", None)
        if scratch is None or len(scratch) < size:
            scratch = self._local.scratch = bytearray(size)
        return memoryview(scratch)[:size]
