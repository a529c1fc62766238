"""Codecs for chunks stored below RAM: how a chunk's KV bytes are compressed at rest.

A codec turns one chunk's payload (KV elements of the layout's dtype, little-endian) into the
bytes a tier stores, and back. The stored header records the codec's id
(`kvtier.core.chunkformat`), so a reader decodes whatever codec the writer chose, and treats
a chunk whose codec it does not know as a miss. Codecs run on the store's write-behind
threads (encode) and on the read path into the RAM slot (decode), never on the engine step.

- `none` (id 0): the payload as is.
- `zstd` (id 1), `lz4` (id 2), lossless: the payload split into byte planes first (the high
  byte of every 16-bit value, then the low bytes; four planes for 32-bit values), so that the
  sign/exponent bytes, which take few values in KV, sit together and compress; the mantissa
  bytes are close to random. Then the library codec (`zstandard`, `lz4`). Measured with and
  without the split on real KV in docs/performance.md ("Compressed tiers").
- `fp8` (id 3), LOSSY: float8 e4m3 with one float32 scale per group of FP8_GROUP elements
  (scale = max |x| / 448), about 0.53x of a bf16/fp16 payload. Outputs may differ from
  bf16/fp16 KV; it is marked lossy in the config docs, the logs and `kvtier bench codecs`.

Every `decode` raises CorruptChunk on any failure (truncated or garbled bytes, a size other
than the chunk's): the caller also checks the decoded payload's checksum, so a codec bug
cannot hand back wrong KV. Codec objects are thread-safe.

Primitives: `Codec` (protocol), `CODEC_NAMES`, `LOSSY_CODECS`, `make_codec`, `codec_by_id`,
`split_planes`, `join_planes`, `FP8_GROUP`.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Protocol

import numpy as np

from kvtier.core.layout import DTYPE_BYTES
from kvtier.errors import ConfigError, CorruptChunk

FP8_GROUP = 64  # elements sharing one fp8 scale (a head of 64, or half a head of 128)
FP8_MAX = 448.0  # largest finite float8 e4m3fn
ZSTD_LEVEL = 1  # level 3 was not smaller on bf16 byte planes, and 1.7x slower (performance.md)
_FLOAT_DTYPES = ("float16", "bfloat16", "float32")


class Codec(Protocol):
    """One way of storing a chunk's payload. Thread-safe."""

    name: str  # the config value, e.g. "zstd"
    id: int  # the byte the stored header records (0..255)
    lossy: bool  # decode(encode(x)) may differ from x

    def encode(self, payload: memoryview) -> bytes:
        """The stored form of `payload` (one chunk). Never raises for valid input."""
        ...

    def decode(self, stored: memoryview, out: memoryview) -> None:
        """Fill `out` (exactly one chunk) from `stored`.

        Raises:
            CorruptChunk: `stored` cannot be decoded into exactly len(out) bytes.
        """
        ...


def split_planes(payload: memoryview | bytes, element_bytes: int) -> bytes:
    """The payload as byte planes, most significant byte first (little-endian elements); a
    tail shorter than one element follows as is."""
    data = np.frombuffer(payload, dtype=np.uint8)
    whole = len(data) - len(data) % element_bytes
    if element_bytes == 1 or whole == 0:
        return data.tobytes()
    words = data[:whole].view(f"<u{element_bytes}")
    planes = np.empty((element_bytes, len(words)), dtype=np.uint8)
    for plane in range(element_bytes):  # the high byte first
        shift = 8 * (element_bytes - 1 - plane)
        np.copyto(planes[plane], words >> shift if shift else words, casting="unsafe")
    return planes.tobytes() + data[whole:].tobytes()


def join_planes(planes: bytes | memoryview, out: memoryview, element_bytes: int) -> None:
    """Inverse of `split_planes`, into `out`. Raises CorruptChunk on a size mismatch."""
    if len(planes) != len(out):
        raise CorruptChunk(f"decoded {len(planes)} bytes, expected {len(out)}")
    data = np.frombuffer(planes, dtype=np.uint8)
    target = np.frombuffer(out, dtype=np.uint8)
    whole = len(data) - len(data) % element_bytes
    if element_bytes == 1 or whole == 0:
        target[:] = data
        return
    count = whole // element_bytes
    words = target[:whole].view(f"<u{element_bytes}")
    np.copyto(words, data[(element_bytes - 1) * count:whole], casting="unsafe")  # low byte
    for plane in range(element_bytes - 1):
        shift = 8 * (element_bytes - 1 - plane)
        words |= data[plane * count:(plane + 1) * count].astype(words.dtype) << shift
    target[whole:] = data[whole:]


class PlainCodec:
    """`none`: the payload as is."""

    name, id, lossy = "none", 0, False

    def encode(self, payload: memoryview) -> bytes:
        return bytes(payload)

    def decode(self, stored: memoryview, out: memoryview) -> None:
        if len(stored) != len(out):
            raise CorruptChunk(f"stored {len(stored)} bytes, expected {len(out)}")
        out[:] = stored


class ZstdCodec:
    """`zstd`: byte planes (unless `split` is False), then zstandard at ZSTD_LEVEL."""

    lossy = False

    def __init__(self, element_bytes: int, split: bool = True, level: int = ZSTD_LEVEL,
                 name: str = "zstd", codec_id: int = 1) -> None:
        import zstandard

        self.name, self.id = name, codec_id
        self._zstd = zstandard
        self._element_bytes = element_bytes if split else 1
        self._level = level
        self._local = threading.local()  # zstandard's (de)compressors are per thread

    def _contexts(self) -> tuple[object, object]:
        if not hasattr(self._local, "c"):
            self._local.c = self._zstd.ZstdCompressor(level=self._level)
            self._local.d = self._zstd.ZstdDecompressor()
        return self._local.c, self._local.d

    def encode(self, payload: memoryview) -> bytes:
        compressor, _ = self._contexts()
        return compressor.compress(split_planes(payload, self._element_bytes))  # type: ignore[attr-defined, no-any-return]

    def decode(self, stored: memoryview, out: memoryview) -> None:
        _, decompressor = self._contexts()
        try:
            planes = decompressor.decompress(stored, max_output_size=len(out))  # type: ignore[attr-defined]
        except self._zstd.ZstdError as exc:
            raise CorruptChunk(f"zstd: {exc}") from None
        join_planes(planes, out, self._element_bytes)


class Lz4Codec:
    """`lz4`: byte planes (unless `split` is False), then an LZ4 block."""

    lossy = False

    def __init__(self, element_bytes: int, split: bool = True, name: str = "lz4",
                 codec_id: int = 2) -> None:
        import lz4.block

        self.name, self.id = name, codec_id
        self._block = lz4.block
        self._element_bytes = element_bytes if split else 1

    def encode(self, payload: memoryview) -> bytes:
        return self._block.compress(split_planes(payload, self._element_bytes),  # type: ignore[no-any-return]
                                    store_size=False)

    def decode(self, stored: memoryview, out: memoryview) -> None:
        try:
            planes = self._block.decompress(stored, uncompressed_size=len(out))
        except (self._block.LZ4BlockError, ValueError) as exc:
            raise CorruptChunk(f"lz4: {exc}") from None
        join_planes(planes, out, self._element_bytes)


class Fp8Codec:
    """`fp8`, LOSSY: float8 e4m3 with a float32 scale per FP8_GROUP elements.

    Stored: the scales (float32, one per group), then one fp8 byte per element."""

    name, id, lossy = "fp8", 3, True

    def __init__(self, dtype: str) -> None:
        import ml_dtypes

        self._dtype = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
        self._fp8 = np.dtype(ml_dtypes.float8_e4m3fn)

    def _groups(self, nbytes: int) -> tuple[int, int]:
        """(elements, groups) of a payload of `nbytes`."""
        count = nbytes // self._dtype.itemsize
        return count, -(-count // FP8_GROUP)

    def encode(self, payload: memoryview) -> bytes:
        count, groups = self._groups(len(payload))
        flat = np.zeros(groups * FP8_GROUP, dtype=np.float32)
        flat[:count] = np.frombuffer(payload, dtype=self._dtype)
        values = flat.reshape(groups, FP8_GROUP)
        amax = np.abs(values).max(axis=1)
        amax[~np.isfinite(amax) | (amax == 0)] = 1.0
        scales = (amax / FP8_MAX).astype(np.float32)
        quantized = np.clip(values / scales[:, None], -FP8_MAX, FP8_MAX).astype(self._fp8)
        return bytes(scales.tobytes() + quantized.reshape(-1)[:count].tobytes())

    def decode(self, stored: memoryview, out: memoryview) -> None:
        count, groups = self._groups(len(out))
        if count * self._dtype.itemsize != len(out) or len(stored) != 4 * groups + count:
            raise CorruptChunk(f"fp8: stored {len(stored)} bytes, expected {4 * groups + count}")
        scales = np.frombuffer(stored, dtype=np.float32, count=groups)
        flat = np.zeros(groups * FP8_GROUP, dtype=np.float32)
        flat[:count] = np.frombuffer(stored, dtype=self._fp8, offset=4 * groups)
        values = flat.reshape(groups, FP8_GROUP) * scales[:, None]
        np.frombuffer(out, dtype=self._dtype)[:] = values.reshape(-1)[:count]


# name -> (id, lossy, factory(dtype)); ids are stored: never reuse or renumber one.
_REGISTRY: dict[str, tuple[int, bool, Callable[[str], Codec]]] = {
    "none": (0, False, lambda dtype: PlainCodec()),
    "zstd": (1, False, lambda dtype: ZstdCodec(DTYPE_BYTES[dtype])),
    "lz4": (2, False, lambda dtype: Lz4Codec(DTYPE_BYTES[dtype])),
    "fp8": (3, True, Fp8Codec),
}
CODEC_NAMES = tuple(_REGISTRY)
LOSSY_CODECS = tuple(name for name, (_, lossy, _) in _REGISTRY.items() if lossy)
_BY_ID = {codec_id: name for name, (codec_id, _, _) in _REGISTRY.items()}


def allowed_codecs() -> str:
    """What a `codec` setting may be, for error messages."""
    return ("one of " + ", ".join(repr(n) for n in CODEC_NAMES)
            + " (" + ", ".join(repr(n) for n in LOSSY_CODECS) + " is LOSSY: outputs may change)")


@functools.lru_cache(maxsize=64)
def make_codec(name: str, dtype: str) -> Codec:
    """The codec `name` for KV elements of `dtype` (a KVLayout dtype); one per (name, dtype).

    Raises:
        ConfigError: an unknown name, or `fp8` for KV that is not float16/bfloat16/float32.
    """
    if name not in _REGISTRY:
        raise ConfigError("codec", name, allowed_codecs())
    if name == "fp8" and dtype not in _FLOAT_DTYPES:
        raise ConfigError("codec", name, f"'fp8' quantizes float16/bfloat16/float32 KV; this "
                          f"model's KV is {dtype}: use 'none', 'zstd' or 'lz4'")
    return _REGISTRY[name][2](dtype)


def codec_by_id(codec_id: int, dtype: str) -> Codec | None:
    """The codec a stored header names, or None when this kvtier does not know it (a chunk
    written by a newer kvtier: the reader treats it as a miss)."""
    name = _BY_ID.get(codec_id)
    if name is None:
        return None
    try:
        return make_codec(name, dtype)
    except ConfigError:  # fp8 recorded for a layout it cannot be: a damaged header
        return None
