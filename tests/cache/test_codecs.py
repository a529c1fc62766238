"""Codecs for chunks at rest (kvtier.core.codecs) and the version 2 chunk format that records
them (kvtier.core.chunkformat.ChunkEncoder).

The story: lossless codecs give back every byte of bf16/fp16/fp32 KV; fp8 is lossy within its
bound; damaged compressed bytes, an unknown codec id or a codec that decodes wrongly are all
misses (CorruptChunk / CodecFailure), never wrong KV; a chunk without a codec is still the
version 1 format the previous release wrote, and that release's files are read.
"""

from __future__ import annotations

import shutil
import struct
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import xxhash
from tierkit import key, tiny_layout

from kvtier.core.chunkformat import HEADER_BYTES, VERSION, ChunkEncoder, failure_of, read_header
from kvtier.core.codecs import (
    CODEC_NAMES,
    FP8_GROUP,
    LOSSY_CODECS,
    Lz4Codec,
    ZstdCodec,
    codec_by_id,
    join_planes,
    make_codec,
    split_planes,
)
from kvtier.core.layout import KVLayout
from kvtier.core.tier import Failure
from kvtier.errors import CodecFailure, ConfigError, CorruptChunk
from kvtier.tiers import build_tier
from kvtier.tiers.files.chunkfiles import ChunkFiles
from kvtier.tiers.storeconfig import StoreConfig

DTYPES = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16, "float32": np.float32}
LOSSLESS = [n for n in CODEC_NAMES if n not in LOSSY_CODECS]
V1_FIXTURE = Path(__file__).parent.parent / "data" / "chunks-v1"


def kv_like(dtype: str, elements: int = 1 << 16, seed: int = 0) -> bytes:
    """Values shaped like KV: roughly normal, a few heads larger than others."""
    rng = np.random.default_rng(seed)
    scale = rng.choice([0.1, 1.0, 8.0], size=elements // 64).repeat(64)[:elements]
    return (rng.standard_normal(elements) * scale).astype(DTYPES[dtype]).tobytes()


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("codec", LOSSLESS)
def test_lossless_codecs_round_trip_every_byte(codec: str, dtype: str) -> None:
    payload = kv_like(dtype)
    c = make_codec(codec, dtype)
    assert not c.lossy
    stored = c.encode(memoryview(payload))
    out = bytearray(len(payload))
    c.decode(memoryview(stored), memoryview(out))
    assert bytes(out) == payload


@pytest.mark.parametrize("size", [0, 1, 3, 4095, 4097])
@pytest.mark.parametrize("element_bytes", [1, 2, 4])
def test_byte_planes_join_back_for_any_size(size: int, element_bytes: int) -> None:
    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes()
    out = bytearray(size)
    join_planes(split_planes(data, element_bytes), memoryview(out), element_bytes)
    assert bytes(out) == data


def test_byte_planes_put_the_high_bytes_first() -> None:
    words = np.array([0x1122, 0x3344], dtype="<u2").tobytes()
    assert split_planes(words, 2) == bytes([0x11, 0x33, 0x22, 0x44])


@pytest.mark.parametrize("cls", [ZstdCodec, Lz4Codec])
def test_the_byte_plane_split_makes_bf16_kv_smaller(cls: type) -> None:
    """Why the split is there: the exponent bytes compress once they sit together."""
    payload = memoryview(kv_like("bfloat16"))
    split = len(cls(2).encode(payload))
    whole = len(cls(2, split=False).encode(payload))
    assert split < whole


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_fp8_is_lossy_within_its_per_group_bound(dtype: str) -> None:
    payload = kv_like(dtype)
    codec = make_codec("fp8", dtype)
    assert codec.lossy and "fp8" in LOSSY_CODECS
    stored = codec.encode(memoryview(payload))
    width = np.dtype(DTYPES[dtype]).itemsize
    assert len(stored) < 0.6 * len(payload) if width == 2 else len(stored) < 0.3 * len(payload)
    out = bytearray(len(payload))
    codec.decode(memoryview(stored), memoryview(out))
    original = np.frombuffer(payload, DTYPES[dtype]).astype(np.float32).reshape(-1, FP8_GROUP)
    decoded = np.frombuffer(out, DTYPES[dtype]).astype(np.float32).reshape(-1, FP8_GROUP)
    amax = np.abs(original).max(axis=1, keepdims=True)
    # e4m3: 3 mantissa bits, so a rounding error of at most 1/16 of a value, plus the
    # subnormal step of the group's scale and the output dtype's own rounding.
    assert np.all(np.abs(decoded - original) <= np.abs(original) / 16 + amax / 448 * 2**-9
                  + np.abs(original) / 128 + 1e-30)
    assert not np.array_equal(decoded, original)


@pytest.mark.parametrize("codec", ["zstd", "lz4", "fp8"])
def test_truncated_or_garbled_compressed_bytes_raise_corrupt_block(codec: str) -> None:
    payload = kv_like("bfloat16")
    c = make_codec(codec, "bfloat16")
    stored = c.encode(memoryview(payload))
    out = memoryview(bytearray(len(payload)))
    with pytest.raises(CorruptChunk):
        c.decode(memoryview(stored[: len(stored) // 2]), out)
    with pytest.raises(CorruptChunk):
        c.decode(memoryview(b"\xff" * 64), out)


def test_unknown_codec_names_are_a_config_error_naming_what_is_allowed() -> None:
    with pytest.raises(ConfigError) as err:
        StoreConfig.parse({"tiers": [{"kind": "memory", "capacity": "1MiB"}, {
            "kind": "disk", "path": "/tmp/kvtier-codec-test", "capacity": "1MiB",
            "codec": "brotli"}]})
    message = str(err.value)
    assert "tiers.1.disk.codec" in message and "brotli" in message
    assert all(repr(name) in message for name in CODEC_NAMES) and "LOSSY" in message


def test_fp8_of_int8_kv_is_refused_when_the_tier_is_built(tmp_path: Path) -> None:
    layout = KVLayout(num_layers=1, num_kv_heads=1, head_size=64, dtype="int8",
                      tokens_per_chunk=16)
    config = StoreConfig.parse({"tiers": [{"kind": "disk", "path": str(tmp_path),
                                           "capacity": "1MiB", "codec": "fp8"}]})
    with pytest.raises(ConfigError, match=r"codec.*fp8"):
        build_tier(config.tiers[0], layout)


# -- the stored format -------------------------------------------------------------------

LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_size=64, dtype="bfloat16",
                  tokens_per_chunk=64)  # 16 KiB chunks


def encoder(codec: str) -> ChunkEncoder:
    return ChunkEncoder(LAYOUT.digest(), LAYOUT.dtype, LAYOUT.bytes_per_chunk, codec)


def test_without_a_codec_a_chunk_is_the_version_1_format_as_is() -> None:
    payload = memoryview(kv_like("bfloat16", LAYOUT.bytes_per_chunk // 2))
    encoded = encoder("none").encode(key(1), payload)
    assert encoded.plain and encoded.body is payload
    assert read_header(encoded.header, key(1), LAYOUT.digest()).version == VERSION


@pytest.mark.parametrize("codec", CODEC_NAMES)
def test_an_encoded_chunk_decodes_through_its_header(codec: str) -> None:
    payload = kv_like("bfloat16", LAYOUT.bytes_per_chunk // 2)
    enc = encoder(codec)
    encoded = enc.encode(key(2), memoryview(payload))
    header = read_header(encoded.header, key(2), LAYOUT.digest())
    assert header.codec_id == make_codec(codec, "bfloat16").id
    assert header.body_bytes == len(encoded.body) <= len(payload)
    out = bytearray(len(payload))
    # A reader configured with another codec reads it all the same.
    encoder("none").decode(key(2), header, encoded.body, memoryview(out))
    if codec in LOSSY_CODECS:
        assert bytes(out) != payload
    else:
        assert bytes(out) == payload


def test_incompressible_chunks_are_stored_as_is() -> None:
    payload = np.random.default_rng(3).integers(0, 256, LAYOUT.bytes_per_chunk,
                                                dtype=np.uint8).tobytes()
    encoded = encoder("zstd").encode(key(3), memoryview(payload))
    assert encoded.plain and bytes(encoded.body) == payload


def _repacked(header: bytes, **changes: int) -> bytes:
    """A version 2 header with fields changed and its header checksum made valid again."""
    layout = struct.Struct("<8sHH16s16sQQBB6xQQ8s12s")
    values = list(layout.unpack_from(header))
    names = ["magic", "version", "flags", "layout", "key", "size", "payload_sum", "codec",
             "seal", "body_bytes", "body_sum", "key_id", "nonce"]
    for name, value in changes.items():
        values[names.index(name)] = value
    fields = layout.pack(*values)
    return (fields + struct.pack("<Q", xxhash.xxh3_64_intdigest(fields))).ljust(HEADER_BYTES,
                                                                                 b"\0")


def test_an_unknown_codec_id_is_a_codec_failure_not_a_crash() -> None:
    payload = kv_like("bfloat16", LAYOUT.bytes_per_chunk // 2)
    encoded = encoder("zstd").encode(key(4), memoryview(payload))
    foreign = _repacked(encoded.header, codec=77)  # written by a newer kvtier
    header = read_header(foreign, key(4), LAYOUT.digest())
    assert codec_by_id(77, "bfloat16") is None
    with pytest.raises(CodecFailure, match="unknown codec id 77") as err:
        encoder("zstd").decode(key(4), header, encoded.body, memoryview(bytearray(len(payload))))
    assert failure_of(err.value) is Failure.CODEC


def test_damaged_compressed_bytes_fail_the_body_checksum() -> None:
    payload = kv_like("bfloat16", LAYOUT.bytes_per_chunk // 2)
    encoded = encoder("lz4").encode(key(5), memoryview(payload))
    header = read_header(encoded.header, key(5), LAYOUT.digest())
    damaged = bytearray(encoded.body)
    damaged[len(damaged) // 2] ^= 0x10
    with pytest.raises(CorruptChunk, match="checksum"):
        encoder("lz4").decode(key(5), header, memoryview(damaged),
                              memoryview(bytearray(len(payload))))


def test_a_codec_that_decodes_wrongly_is_caught_by_the_payload_checksum(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A codec bug (bytes that verify but decode to other KV) must never reach the engine."""
    payload = kv_like("bfloat16", LAYOUT.bytes_per_chunk // 2)
    encoded = encoder("zstd").encode(key(6), memoryview(payload))
    header = read_header(encoded.header, key(6), LAYOUT.digest())
    real = make_codec("zstd", "bfloat16")

    class OffByOne:
        name, id, lossy = "zstd", 1, False

        def encode(self, data: memoryview) -> bytes:
            return real.encode(data)

        def decode(self, stored: memoryview, out: memoryview) -> None:
            real.decode(stored, out)
            out[0] ^= 1

    monkeypatch.setattr("kvtier.core.chunkformat.codec_by_id", lambda *_: OffByOne())
    with pytest.raises(CodecFailure, match="decoded payload checksum"):
        encoder("zstd").decode(key(6), header, encoded.body, memoryview(bytearray(len(payload))))


def test_a_chunk_file_written_by_the_previous_release_is_read(tmp_path: Path) -> None:
    """tests/data/chunks-v1 holds a file written by the release before codecs (commit
    51b27d8's ChunkFiles.write): key 7 of tiny_layout(), payload (i * 7 + 3) % 251. Readers with
    a codec configured read it too, and a disk tier rebuilt over it serves it."""
    layout = tiny_layout()
    expected = bytes((i * 7 + 3) % 251 for i in range(layout.bytes_per_chunk))
    root = tmp_path / "disk"
    shutil.copytree(V1_FIXTURE, root)
    for codec in ("none", "zstd"):
        files = ChunkFiles(root, layout.digest(), layout.bytes_per_chunk, "off",
                           encoder=ChunkEncoder(layout.digest(), layout.dtype,
                                                layout.bytes_per_chunk, codec))
        out = bytearray(layout.bytes_per_chunk)
        files.read_into(key(7), memoryview(out))
        assert bytes(out) == expected
    config = StoreConfig.parse({"tiers": [{"kind": "disk", "path": str(root),
                                           "capacity": "1MiB", "codec": "lz4"}]})
    tier = build_tier(config.tiers[0], layout)
    out = bytearray(layout.bytes_per_chunk)
    assert tier.get_into(key(7), memoryview(out)) and bytes(out) == expected
    tier.close()
