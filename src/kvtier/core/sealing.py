"""Per-tenant encryption at rest: each tenant's AES-256-GCM key.

A request's `cache_salt` names its tenant; the salt is already part of every chunk key
(`kvtier.core.keys.Namespace`), so different tenants never share a chunk. A tier learns a
chunk's tenant from the call itself: its `ChunkMeta.tenant` (kvtier.core.retention), the
`tenant_id` of the salt (a hash: the salt never reaches a tier), passed to every write and
to every read of the chunk (the vLLM worker takes it from the scheduler's plan, loads and
prefetches alike). With a secret configured on a tier below RAM, a salted request's chunks
are sealed there with AES-256-GCM under a key derived for that tenant alone:
HKDF-SHA256(secret, info="kvtier-seal-v1|" + tenant). The stored header carries the key's id
(HKDF(secret, info="kvtier-kid-v1|" + tenant), 8 bytes: it names the key without revealing
it or the tenant), a random 96-bit nonce per write, and is itself the AEAD's associated data,
so a header swapped onto another chunk's bytes fails authentication
(`kvtier.core.chunkformat`). A reader without the tenant's key (another tenant, another
secret) is a counted miss (`KeyNotHeld`: the chunk is kept, another reader may hold the
key); a chunk that fails authentication under the right key is a counted miss and is
removed (`AuthFailure`).

Chunks of requests without a salt stay in clear unless the tier sets `encrypt_unsalted`
(then they are sealed under the key of the empty tenant, "").

No key material is ever logged, printed, raised or counted: `TenantKey`'s repr shows its id
only, and the secret lives in `Sealer` alone.

Primitives: `Sealer`, `TenantKey`, `SEAL_OVERHEAD`, `MIN_SECRET_BYTES`; its failures,
`AuthFailure` and `KeyNotHeld`, are in kvtier.errors.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from kvtier.errors import AuthFailure

MIN_SECRET_BYTES = 32  # an operator secret shorter than this is refused
KEY_ID_BYTES = 8
NONCE_BYTES = 12  # AES-GCM's standard 96-bit nonce, random per write
TAG_BYTES = 16
SEAL_OVERHEAD = TAG_BYTES  # sealed bytes = plaintext + the GCM tag
_MAX_TENANTS = 4096  # derived keys kept per Sealer (HKDF costs ~20 us)


@dataclass(frozen=True, slots=True)
class TenantKey:
    """One tenant's AES-256-GCM key. Its repr shows the key id only."""

    key_id: bytes  # KEY_ID_BYTES, stored in the header
    aead: Any = field(repr=False)  # cryptography's AESGCM over the derived key

    def seal_into(self, nonce: bytes, plain: bytes | memoryview, aad: bytes,
                  out: memoryview) -> None:
        """Write the ciphertext + tag of `plain` into `out` (len(plain) + TAG_BYTES long)."""
        self.aead.encrypt_into(nonce, plain, aad, out)

    def open_into(self, nonce: bytes, sealed: memoryview, aad: bytes,
                  out: bytearray | memoryview) -> None:
        """Decrypt `sealed` (ciphertext + tag) into `out` (len(sealed) - TAG_BYTES long).

        Raises:
            AuthFailure: authentication failed (the bytes, the header or the key differ).
        """
        from cryptography.exceptions import InvalidTag

        try:
            self.aead.decrypt_into(nonce, sealed, aad, out)
        except (InvalidTag, ValueError):
            raise AuthFailure("authentication failed (tampered chunk or header)") from None


class Sealer:
    """Derives and caches each tenant's `TenantKey` from the operator's secret. Thread-safe.

    Raises (constructor): ValueError when the secret is shorter than MIN_SECRET_BYTES (the
    tier config turns it into a ConfigError without showing it).
    """

    def __init__(self, secret: bytes, encrypt_unsalted: bool = False) -> None:
        if len(secret) < MIN_SECRET_BYTES:
            raise ValueError(f"an encryption secret of at least {MIN_SECRET_BYTES} bytes")
        self._secret = secret
        self.encrypt_unsalted = encrypt_unsalted
        self._lock = threading.Lock()
        self._keys: OrderedDict[str, TenantKey] = OrderedDict()

    def __repr__(self) -> str:
        return f"Sealer(encrypt_unsalted={self.encrypt_unsalted})"

    def key_for(self, tenant: str | None) -> TenantKey | None:
        """The key a chunk of `tenant` (`ChunkMeta.tenant`) is sealed under, or None when it
        is stored in clear (the default tenant, and `encrypt_unsalted` off)."""
        if not tenant and not self.encrypt_unsalted:
            return None
        salt = tenant or ""
        with self._lock:
            key = self._keys.get(salt)
            if key is not None:
                self._keys.move_to_end(salt)
                return key
        key = self._derive(salt)
        with self._lock:
            self._keys[salt] = key
            while len(self._keys) > _MAX_TENANTS:
                self._keys.popitem(last=False)
        return key

    def _derive(self, salt: str) -> TenantKey:
        from cryptography.hazmat.primitives import hashes
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM
        from cryptography.hazmat.primitives.kdf.hkdf import HKDF

        def hkdf(label: bytes, length: int) -> bytes:
            return HKDF(algorithm=hashes.SHA256(), length=length, salt=None,
                        info=label + salt.encode()).derive(self._secret)

        return TenantKey(hkdf(b"kvtier-kid-v1|", KEY_ID_BYTES),
                         AESGCM(hkdf(b"kvtier-seal-v1|", 32)))


def new_nonce() -> bytes:
    """A random 96-bit nonce (one per write: random nonces stay safe for ~2^32 writes of
    one tenant key, far more than a cache rewrites)."""
    return os.urandom(NONCE_BYTES)
