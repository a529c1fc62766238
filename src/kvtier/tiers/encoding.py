"""How a tier below RAM stores chunks at rest: its codec and its encryption settings.

The disk, shared-directory and redis tiers' config models subclass `EncodedTierSettings`
(their own fields come on top), and build their `ChunkEncoder` with `build_encoder`:

    {"kind": "disk", "path": "/mnt/nvme/kvtier", "capacity": "1TiB",
     "codec": "zstd",                                   # none | zstd | lz4 | fp8 (LOSSY)
     "encryption_secret_file": "/etc/kvtier/secret",    # or encryption_secret_env: "VAR"
     "encrypt_unsalted": false}

With a secret, the chunks of requests that carry a `cache_salt` are sealed with AES-256-GCM
under a key derived for that salt (`kvtier.core.sealing`). The secret is read from a file
(its bytes, a trailing newline dropped; mode 0600 advised) or an environment variable, when
the tier is built, never from the config itself: an inline `encryption_secret` is refused
(it would sit in config files, process listings and logs), and no error or log line shows it.

Primitives: `EncodedTierSettings`, `build_encoder`, `read_secret`.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from pydantic import field_validator, model_validator

from kvtier.config import EnvVarName
from kvtier.core.chunkformat import ChunkEncoder
from kvtier.core.codecs import CODEC_NAMES, LOSSY_CODECS, allowed_codecs, make_codec
from kvtier.core.layout import KVLayout
from kvtier.core.sealing import MIN_SECRET_BYTES, Sealer
from kvtier.errors import ConfigError, FieldError
from kvtier.tiers.storeconfig import TierSettings

log = logging.getLogger(__name__)
MASK = "***"
INLINE_REFUSED = (
    "never inline: a secret in the config sits in config files, process listings and logs; "
    "put it in a file named by encryption_secret_file (mode 0600) or an environment "
    "variable named by encryption_secret_env")


class EncodedTierSettings(TierSettings):
    """The settings of a tier that stores chunks outside the process (see module doc)."""

    # How chunks are compressed at rest: "none", lossless "zstd" / "lz4" (byte planes +
    # the library codec), or "fp8" (LOSSY: float8 e4m3 with per-group scales; outputs may
    # change). Read back whatever codec wrote them.
    codec: str = "none"
    # A file holding the operator's secret (>= 32 bytes) that per-tenant keys derive from:
    # chunks of requests with a cache_salt are encrypted at rest (AES-256-GCM) when set.
    encryption_secret_file: Path | None = None
    # ... or the name of an environment variable holding it (not the secret itself).
    encryption_secret_env: EnvVarName | None = None
    # Also encrypt chunks of requests without a cache_salt (under the empty salt's key).
    encrypt_unsalted: bool = False
    # Refused: the secret itself never goes in the config (INLINE_REFUSED).
    encryption_secret: None = None

    @model_validator(mode="before")
    @classmethod
    def _mask_inline_secret(cls, data: Any) -> Any:
        # The refusal below must not echo the secret: ConfigError shows the refused value.
        if isinstance(data, dict) and data.get("encryption_secret") is not None:
            return {**data, "encryption_secret": MASK}
        return data

    @field_validator("encryption_secret", mode="before")
    @classmethod
    def _refuse_inline_secret(cls, value: Any) -> None:
        if value is not None:
            raise ValueError(INLINE_REFUSED)
        return None

    @field_validator("codec")
    @classmethod
    def _known_codec(cls, codec: str) -> str:
        if codec not in CODEC_NAMES:
            raise ValueError(allowed_codecs())
        return codec

    @model_validator(mode="after")
    def _one_secret_source(self) -> EncodedTierSettings:
        # Each names the field to fix (a ValueError here would name the whole tier).
        if self.encryption_secret_file is not None and self.encryption_secret_env:
            raise FieldError("encryption_secret_env", self.encryption_secret_env,
                                  "encryption_secret_file or encryption_secret_env, not both")
        if self.encrypt_unsalted and not self.encrypts:
            raise FieldError("encrypt_unsalted", True, "encrypt_unsalted needs "
                                  "encryption_secret_file or encryption_secret_env")
        return self

    @property
    def encrypts(self) -> bool:
        """Whether a secret is configured (salted chunks are sealed)."""
        return self.encryption_secret_file is not None or bool(self.encryption_secret_env)


def read_secret(config: EncodedTierSettings) -> bytes | None:
    """The operator's secret, or None when the tier does not encrypt.

    Raises:
        ConfigError: the file is unreadable or too short, or the variable unset or too
            short (the message names the file or variable, never the secret).
    """
    if config.encryption_secret_file is not None:
        path = config.encryption_secret_file
        try:
            secret = path.read_bytes().rstrip(b"\r\n")
        except OSError as exc:
            raise ConfigError(f"{config.tier_name}.encryption_secret_file", str(path),
                              f"a readable file ({exc.strerror})") from None
        if len(secret) < MIN_SECRET_BYTES:
            raise ConfigError(f"{config.tier_name}.encryption_secret_file", str(path),
                              f"a file holding a secret of at least {MIN_SECRET_BYTES} bytes "
                              "(e.g. `head -c 48 /dev/urandom | base64 > FILE`)")
        if path.stat().st_mode & 0o077:
            log.warning("encryption secret file %s is readable by others; chmod 600 it", path)
        return secret
    if config.encryption_secret_env:
        name = config.encryption_secret_env
        value = os.environ.get(name, "").encode()
        if len(value) < MIN_SECRET_BYTES:
            raise ConfigError(f"{config.tier_name}.encryption_secret_env", name,
                              f"an environment variable holding a secret of at least "
                              f"{MIN_SECRET_BYTES} bytes ({'unset' if not value else 'too short'})")
        return value
    return None


def build_encoder(config: EncodedTierSettings, layout: KVLayout) -> ChunkEncoder:
    """The tier's ChunkEncoder for chunks of `layout`.

    Raises:
        ConfigError: a codec this layout's dtype cannot take (fp8 of int8 KV), or an unusable
            secret (`read_secret`).
    """
    try:
        make_codec(config.codec, layout.dtype)
    except ConfigError as exc:
        raise ConfigError(f"{config.tier_name}.codec", config.codec, exc.allowed) from None
    secret = read_secret(config)
    sealer = Sealer(secret, config.encrypt_unsalted) if secret is not None else None
    if config.codec in LOSSY_CODECS:
        log.warning("tier %r: codec %r is LOSSY: KV read back from this tier differs from what "
                    "was computed, and outputs may change", config.tier_name, config.codec)
    if sealer is not None:
        log.info("tier %r: chunks of salted requests%s are encrypted at rest (AES-256-GCM, a "
                 "key per cache salt)", config.tier_name,
                 " and unsalted ones" if config.encrypt_unsalted else "")
    return ChunkEncoder(layout.digest(), layout.dtype, layout.bytes_per_chunk, config.codec,
                        sealer)
