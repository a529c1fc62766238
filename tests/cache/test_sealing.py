"""Per-tenant encryption at rest (kvtier.core.sealing, through ChunkEncoder) and its settings
(kvtier.tiers.encoding).

The story: a salted chunk is sealed under its tenant's key and opened only with it; another
tenant's key, another secret, tampered bytes, a swapped header or a chunk put back in clear
are all AuthFailures (a counted miss), never wrong KV; unsalted chunks stay in clear unless
`encrypt_unsalted`; the secret comes from a file or an environment variable only, and never
shows in an error, a repr or a log line.
"""

from __future__ import annotations

import logging
import os
import struct
from pathlib import Path

import numpy as np
import pytest
import xxhash
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from tierkit import key

from kvtier.core.chunkformat import ChunkEncoder, failure_of, read_header
from kvtier.core.layout import KVLayout
from kvtier.core.retention import ChunkMeta, tenant_id
from kvtier.core.sealing import Sealer
from kvtier.core.tier import Failure
from kvtier.errors import AuthFailure, ConfigError
from kvtier.tiers import build_tier
from kvtier.tiers.storeconfig import StoreConfig

SECRET = b"s3cr3t-operator-key-0123456789abcdefXYZ"
OTHER_SECRET = b"another-operator-key-0123456789abcdefXYZ"
LAYOUT = KVLayout(num_layers=1, num_kv_heads=2, head_size=64, dtype="bfloat16",
                  tokens_per_chunk=32)
PAYLOAD = bytes((i * 37 + 11) % 256 for i in range(LAYOUT.bytes_per_chunk))


def refresh_body_checksum(header: bytes, body: bytes) -> bytes:
    """`header` (version 2) with its body checksum set to `body`'s and its header checksum
    valid again: what someone who can write the storage can forge."""
    fields = bytearray(header[:104])  # the version 2 fields; the body checksum at 76
    struct.pack_into("<Q", fields, 76, xxhash.xxh3_64_intdigest(body))
    return (bytes(fields) + struct.pack("<Q", xxhash.xxh3_64_intdigest(bytes(fields)))
            ).ljust(len(header), b"\0")


def encoder(secret: bytes = SECRET, codec: str = "none",
            encrypt_unsalted: bool = False) -> ChunkEncoder:
    return ChunkEncoder(LAYOUT.digest(), LAYOUT.dtype, LAYOUT.bytes_per_chunk, codec,
                        Sealer(secret, encrypt_unsalted))


def open_chunk(enc: ChunkEncoder, k: bytes, header: bytes, body: bytes | memoryview,
               tenant: str | None) -> bytes:
    out = bytearray(LAYOUT.bytes_per_chunk)
    enc.decode(k, read_header(header, k, LAYOUT.digest()), memoryview(body), memoryview(out),
               tenant)
    return bytes(out)


@pytest.mark.parametrize("codec", ["none", "zstd"])
def test_a_salted_chunk_is_sealed_and_opens_only_under_its_tenants_key(codec: str) -> None:
    enc = encoder(codec=codec)
    sealed = enc.encode(key(1), memoryview(PAYLOAD), "tenant-a")
    assert not sealed.plain and PAYLOAD[:64] not in bytes(sealed.body)
    assert open_chunk(enc, key(1), sealed.header, sealed.body, "tenant-a") == PAYLOAD
    # The same key read for tenant b (as if b asked for a's chunk): no key for it.
    with pytest.raises(AuthFailure, match="key this reader does not hold") as err:
        open_chunk(enc, key(1), sealed.header, sealed.body, "tenant-b")
    assert failure_of(err.value) is Failure.NO_KEY  # not tampering: the chunk is kept
    # Tenant a again, but an engine with another secret.
    with pytest.raises(AuthFailure):
        open_chunk(encoder(OTHER_SECRET), key(1), sealed.header, sealed.body, "tenant-a")


def test_each_write_has_its_own_nonce() -> None:
    enc = encoder()
    # (a sealed body lives in the encoding thread's buffer: copied before the next encode)
    first, second = ((e.header, bytes(e.body)) for e in
                     (enc.encode(key(1), memoryview(PAYLOAD), "tenant-a") for _ in range(2)))
    assert first[1] != second[1]
    assert read_header(first[0], key(1), LAYOUT.digest()).nonce != \
        read_header(second[0], key(1), LAYOUT.digest()).nonce


def test_tampered_ciphertext_with_a_fixed_up_checksum_fails_authentication() -> None:
    """Whoever can write the storage can recompute xxh3 checksums; not the GCM tag."""
    enc = encoder()
    sealed = enc.encode(key(2), memoryview(PAYLOAD), "tenant-a")
    body = bytearray(sealed.body)
    body[10] ^= 0x01
    header = refresh_body_checksum(sealed.header, bytes(body))
    with pytest.raises(AuthFailure, match="authentication failed") as err:
        open_chunk(enc, key(2), header, body, "tenant-a")
    assert failure_of(err.value) is Failure.AUTH  # the right key: tampering, removed


def test_a_header_moved_onto_another_chunks_bytes_fails_authentication() -> None:
    enc = encoder()
    three = enc.encode(key(3), memoryview(PAYLOAD), "tenant-a")
    three_header = three.header
    four = enc.encode(key(4), memoryview(PAYLOAD[::-1]), "tenant-a")
    # key 4's body under key 3's header (checksum fixed up): another nonce, another AAD
    swapped = refresh_body_checksum(three_header, bytes(four.body))
    with pytest.raises(AuthFailure):
        open_chunk(enc, key(3), swapped, four.body, "tenant-a")


def test_a_sealed_chunk_replaced_by_one_in_clear_is_refused() -> None:
    """A chunk in clear, checksums valid, where the tier seals the tenant's chunks: refused,
    or anyone who can write the directory could plant KV for a tenant."""
    plain = ChunkEncoder(LAYOUT.digest(), LAYOUT.dtype, LAYOUT.bytes_per_chunk)
    forged = plain.encode(key(5), memoryview(PAYLOAD), "tenant-a")
    with pytest.raises(AuthFailure, match="in clear"):
        open_chunk(encoder(), key(5), forged.header, forged.body, "tenant-a")


def test_unsalted_chunks_stay_in_clear_unless_encrypt_unsalted() -> None:
    clear = encoder().encode(key(6), memoryview(PAYLOAD), None)
    assert clear.plain and bytes(clear.body) == PAYLOAD
    enc = encoder(encrypt_unsalted=True)
    sealed = enc.encode(key(6), memoryview(PAYLOAD), None)
    assert not sealed.plain
    assert open_chunk(enc, key(6), sealed.header, sealed.body, None) == PAYLOAD


def test_a_read_that_names_no_tenant_misses_and_keeps_the_chunk() -> None:
    """A sealed chunk read without its tenant (a caller that did not pass it): no key, a
    miss that leaves the chunk in place, never a decryption under another key."""
    enc = encoder()
    sealed = enc.encode(key(7), memoryview(PAYLOAD), "tenant-a")
    with pytest.raises(AuthFailure) as err:
        open_chunk(enc, key(7), sealed.header, sealed.body, None)
    assert failure_of(err.value) is Failure.NO_KEY


def test_no_key_material_in_reprs() -> None:
    sealer = Sealer(SECRET)
    tenant_key = sealer.key_for("tenant-a")
    assert tenant_key is not None
    for text in (repr(sealer), repr(tenant_key), str(tenant_key)):
        assert SECRET.decode() not in text and "tenant-a" not in text
        assert derived_key("tenant-a").hex() not in text


def derived_key(tenant: str, secret: bytes = SECRET) -> bytes:
    """The AES key kvtier derives for `tenant` (to check it never leaks anywhere)."""
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None,
                info=b"kvtier-seal-v1|" + tenant.encode()).derive(secret)


# -- settings ------------------------------------------------------------------------------

def disk(tmp_path: Path, **options: object) -> dict[str, object]:
    return {"kind": "disk", "path": str(tmp_path / "disk"), "capacity": "1MiB", **options}


def test_a_secret_given_inline_is_refused_without_showing_it(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as err:
        StoreConfig.parse({"tiers": [disk(tmp_path, encryption_secret=SECRET.decode())]})
    message = str(err.value)
    assert "tiers.0.disk.encryption_secret" in message and "never inline" in message
    assert "encryption_secret_file" in message and "encryption_secret_env" in message
    assert SECRET.decode() not in message


def test_the_secret_comes_from_a_file_or_an_environment_variable(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    secret_file = tmp_path / "secret"
    secret_file.write_bytes(SECRET + b"\n")
    os.chmod(secret_file, 0o600)
    for options in ({"encryption_secret_file": str(secret_file)},
                    {"encryption_secret_env": "KVTIER_TEST_SECRET"}):
        monkeypatch.setenv("KVTIER_TEST_SECRET", SECRET.decode())
        config = StoreConfig.parse({"tiers": [disk(tmp_path, **options)]})
        tier = build_tier(config.tiers[0], LAYOUT)
        assert tier.files.encoder.sealer is not None  # type: ignore[attr-defined]
        tier.close()


@pytest.mark.parametrize("problem", ["short file", "missing file", "unset env", "short env",
                                     "both", "unsalted without secret", "empty env name",
                                     "not an env name"])
def test_unusable_secrets_are_config_errors_that_never_show_the_secret(
        problem: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    short = tmp_path / "short"
    short.write_bytes(b"tooshort")
    monkeypatch.setenv("KVTIER_SHORT", "tooshort")
    monkeypatch.delenv("KVTIER_UNSET", raising=False)
    options = {
        "short file": {"encryption_secret_file": str(short)},
        "missing file": {"encryption_secret_file": str(tmp_path / "nope")},
        "unset env": {"encryption_secret_env": "KVTIER_UNSET"},
        "short env": {"encryption_secret_env": "KVTIER_SHORT"},
        "both": {"encryption_secret_file": str(short), "encryption_secret_env": "KVTIER_SHORT"},
        "unsalted without secret": {"encrypt_unsalted": True},
        "empty env name": {"encryption_secret_env": ""},
        "not an env name": {"encryption_secret_env": "a b=c"},
    }[problem]
    with pytest.raises(ConfigError) as err:
        config = StoreConfig.parse({"tiers": [disk(tmp_path, **options)]})
        build_tier(config.tiers[0], LAYOUT)
    assert "tooshort" not in str(err.value)
    assert "encrypt" in str(err.value)
    assert err.value.field.startswith(("config.tiers.0.disk.", "disk."))  # which tier


def test_no_key_material_in_logs_of_an_encrypting_tier(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """Writes, hits, a tampered chunk and another tenant's read, all logged at DEBUG: no
    secret, no derived key, no salt in any line."""
    monkeypatch.setenv("KVTIER_TEST_SECRET", SECRET.decode())
    config = StoreConfig.parse({"tiers": [disk(tmp_path,
                                               encryption_secret_env="KVTIER_TEST_SECRET",
                                               codec="zstd")]})
    # Every logger of kvtier at DEBUG: a command run in this process before (e.g. `kvtier
    # bench storage`) may have quieted "kvtier.tiers", which would silence this test.
    with caplog.at_level(logging.DEBUG), caplog.at_level(logging.DEBUG, logger="kvtier"), \
            caplog.at_level(logging.DEBUG, logger="kvtier.tiers"):
        tier = build_tier(config.tiers[0], LAYOUT)
        a, b = (ChunkMeta(tenant=tenant_id(f"salt-of-tenant-{t}")) for t in "ab")
        out = memoryview(bytearray(LAYOUT.bytes_per_chunk))
        assert tier.put(key(101), memoryview(PAYLOAD), a)
        assert tier.put(key(102), memoryview(PAYLOAD), a)
        assert tier.get_into(key(101), out, a)
        assert tier.get_into(key(101), out, b).failure is Failure.NO_KEY
        path = tier.files.path_of(key(102))  # type: ignore[attr-defined]
        data = bytearray(path.read_bytes())
        data[4096 + 10] ^= 1  # in the sealed body
        path.write_bytes(bytes(data))
        assert not tier.get_into(key(102), out, a)
        tier.close()
    text = caplog.text
    assert "encrypted at rest" in text  # the tier did log, and was heard
    tenant_a = tenant_id("salt-of-tenant-a")
    assert tenant_a is not None
    for secret in (SECRET.decode(), SECRET.hex(), derived_key(tenant_a).hex(),
                   "salt-of-tenant-a", "salt-of-tenant-b"):
        assert secret not in text


def test_sealed_compressed_chunks_of_any_size_open_without_a_new_buffer_each() -> None:
    """A zstd body's size differs chunk by chunk; the scratch buffer it is decrypted into was
    made anew (zeroed) whenever the size changed, i.e. on nearly every sealed get: a sealed
    zstd disk tier read at 0.57-0.68x the same tier in clear (`kvtier bench codecs`)."""
    import tracemalloc

    from kvtier.core import chunkformat

    enc = encoder(codec="zstd")
    rng = np.random.default_rng(0)
    payloads = [bytes(PAYLOAD[:n]) + rng.bytes(len(PAYLOAD) - n)  # less and less compressible
                for n in (len(PAYLOAD) // 2, len(PAYLOAD) // 4, len(PAYLOAD) // 8)]
    sealed = []
    for i, payload in enumerate(payloads):
        item = enc.encode(key(i), memoryview(payload), "tenant-a")
        sealed.append((item.header, bytes(item.body)))
    assert len({len(body) for _, body in sealed}) == len(sealed)  # three sizes
    out = bytearray(LAYOUT.bytes_per_chunk)

    def open_all() -> None:
        for i, (header, body) in enumerate(sealed):
            enc.decode(key(i), read_header(header, key(i), LAYOUT.digest()), memoryview(body),
                       memoryview(out), "tenant-a")
            assert out == payloads[i]

    open_all()  # the buffer grows to the largest body once
    tracemalloc.start()
    try:
        for _ in range(3):
            open_all()
        # what chunkformat allocated meanwhile and still holds: the old scratch buffer (the
        # codec's own temporaries come and go)
        held = tracemalloc.take_snapshot().filter_traces(
            [tracemalloc.Filter(True, chunkformat.__file__)])
    finally:
        tracemalloc.stop()
    assert sum(stat.size for stat in held.statistics("filename")) < 1024, \
        held.statistics("lineno")[:3]
