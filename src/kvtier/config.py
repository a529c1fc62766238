"""kvtier's typed configuration, validated once at the edge (CLI, YAML/JSON, vLLM extra config).

A store is an ordered list of tiers, fastest first. Sizes accept ints or strings like "8GiB".
Any invalid value raises `ConfigError` naming the field, the value and what is allowed.

Example (YAML):
    tiers:
      - {kind: memory, capacity: 8GiB}
      - {kind: disk, path: /mnt/nvme/kvtier, capacity: 200GiB}
      - {kind: shared, path: /mnt/shared/kvtier, capacity: 2TiB, eviction: lru}

Primitives: `StoreConfig` (with `.parse`, `.load`), `MemoryTierConfig`, `DiskTierConfig`,
`SharedTierConfig`, `RedisTierConfig`, `TierConfig`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, Literal, get_args

import yaml
from pydantic import (
    BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, field_validator, model_validator,
)

from kvtier.errors import ConfigError
from kvtier.units import parse_size

ByteSize = Annotated[int, BeforeValidator(lambda v: parse_size(v, "capacity")), Field(ge=0)]


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class _TierBase(_Frozen):
    name: str | None = None  # unique name in the store; defaults to `kind`
    capacity: ByteSize  # bytes this tier may hold, e.g. "8GiB"
    eviction: Literal["lru", "arc"] = "lru"  # which chunk leaves first when full
    admit_after: int = Field(1, ge=1)  # store a chunk only on its N-th offer (1 = always)

    @property
    def tier_name(self) -> str:
        return self.name or self.kind  # type: ignore[attr-defined]


class MemoryTierConfig(_TierBase):
    """Host RAM: one preallocated slab of fixed-size slots (pinned when CUDA is present)."""

    kind: Literal["memory"]
    pin: Literal["auto", "on", "off"] = "auto"  # page-locked memory for async GPU copies


class DiskTierConfig(_TierBase):
    """A local directory (NVMe): one file per chunk, bounded, indexed at start-up."""

    kind: Literal["disk"]
    path: Path  # directory; created 0700 when missing
    o_direct: Literal["auto", "on", "off"] = "auto"  # bypass the page cache when supported
    io_threads: int = Field(4, ge=1, le=64)  # parallel reads/writes against this directory


class SharedTierConfig(_TierBase):
    """A POSIX directory shared by many processes and nodes (NFS, CephFS, Lustre, ...)."""

    kind: Literal["shared"]
    path: Path  # the shared directory; created 0700 when missing (see group_shared)
    group_shared: bool = False  # create directories 0770 / files 0660 for a shared group
    scan_interval_s: float = Field(30.0, gt=0)  # how often usage is re-measured for the quota
    io_threads: int = Field(4, ge=1, le=64)  # parallel reads/writes against this directory


class RedisTierConfig(_TierBase):
    """A Redis or Valkey server, or a Redis Cluster (see kvtier/tiers/redis.py).

    Credentials never come from the command line or the URL: a password file, or an
    environment variable (`password_env`, else KVTIER_REDIS_PASSWORD, else REDIS_PASSWORD).
    """

    kind: Literal["redis"]
    capacity: ByteSize = 0  # bytes the tier keeps per namespace; 0 = the server's maxmemory
    url: str = "redis://127.0.0.1:6379/0"  # standalone server; rediss:// for TLS; no password
    cluster_nodes: tuple[str, ...] = ()  # "host:port" of some Redis Cluster nodes (replaces url)
    tls: bool = False  # TLS to the server or cluster nodes (as a rediss:// url does)
    tls_ca_file: Path | None = None  # CA bundle that signed the server's certificate
    username: str | None = None  # ACL user; None = "default"
    password_file: Path | None = None  # file whose first line is the password (mode 0600)
    password_env: str | None = None  # env var holding the password (see class docstring)
    ttl_s: float | None = Field(None, gt=0)  # expire chunks idle this long; None = never
    part_bytes: ByteSize = 8 * 1024**2  # largest value written; larger chunks are split
    socket_timeout_ms: int = Field(200, ge=1)  # longest wait for a reply before "down"
    connect_timeout_ms: int = Field(200, ge=1)  # longest wait for a TCP/TLS connect
    retry_max_s: float = Field(30.0, gt=0)  # longest backoff between retries of a down server
    key_prefix: str = "kvtier:"  # prefix of every key this tier writes
    io_threads: int = Field(4, ge=1, le=64)  # write-behind threads the store gives this tier

    @field_validator("url")
    @classmethod
    def _url_without_password(cls, url: str) -> str:
        from urllib.parse import urlsplit

        parts = urlsplit(url)
        if parts.scheme not in ("redis", "rediss"):
            raise ValueError("a redis:// or rediss:// (TLS) URL")
        if parts.password is not None:
            raise ValueError("no password in the URL: it would show in process listings, logs "
                             "and shell history; use password_file or password_env")
        return url

    @field_validator("cluster_nodes")
    @classmethod
    def _host_ports(cls, nodes: tuple[str, ...]) -> tuple[str, ...]:
        for node in nodes:
            host, _, port = node.rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(f"{node!r} is not host:port")
        return nodes

    @model_validator(mode="after")
    def _ca_only_with_tls(self) -> RedisTierConfig:
        # A CA file with a plain redis:// URL used to be dropped silently: the operator
        # believed the connection was verified TLS while it was clear text.
        if self.tls_ca_file is not None and not self.tls and not self.url.startswith("rediss://"):
            raise ValueError("tls_ca_file is set but TLS is off: use a rediss:// url or tls: true")
        return self

    @field_validator("part_bytes")
    @classmethod
    def _part_size(cls, size: int) -> int:
        if size < 1024:
            raise ValueError("at least 1 KiB (a few MiB is best; Redis allows 512 MiB a value)")
        return size

    @field_validator("key_prefix")
    @classmethod
    def _no_braces(cls, prefix: str) -> str:
        if "{" in prefix or "}" in prefix:
            raise ValueError("no '{' or '}': the tier uses them as Redis Cluster hash tags")
        return prefix

    @field_validator("eviction")
    @classmethod
    def _lru_only(cls, eviction: str) -> str:
        if eviction != "lru":
            raise ValueError("'lru' (the tier's index orders chunks by last use)")
        return eviction


TierConfig = Annotated[
    MemoryTierConfig | DiskTierConfig | SharedTierConfig | RedisTierConfig,
    Field(discriminator="kind"),
]


class StoreConfig(_Frozen):
    """A tiered store: tiers in order, fastest first, and its write-behind settings."""

    tiers: list[TierConfig] = Field(min_length=1)  # fastest first
    write_queue_depth: int = Field(64, ge=1)  # chunks waiting per lower tier before drops
    # Threads for parallel reads and lookups; the vLLM worker reads this many chunks at once
    # (8 read the VM disk 25-30% faster than 4: docs/performance.md).
    io_threads: int = Field(8, ge=1, le=64)

    # A field validator (not a model validator) so the ConfigError names "tiers" rather than
    # the whole config (tests/unit/test_config.py).
    @field_validator("tiers")
    @classmethod
    def _unique_names(cls, tiers: list[TierConfig]) -> list[TierConfig]:
        names = [t.tier_name for t in tiers]
        for name in names:
            if names.count(name) > 1:
                raise ValueError(f"tier name {name!r} is used twice; give tiers distinct names")
        return tiers

    @classmethod
    def parse(cls, data: Any, where: str = "config") -> StoreConfig:
        """Validate a dict (from JSON, YAML or vLLM's kv_connector_extra_config).

        Raises:
            ConfigError: naming `where.field`, the value and what is allowed.
        """
        return parse_model(cls, data, where)

    @classmethod
    def load(cls, path: str | Path) -> StoreConfig:
        """Read and validate a YAML or JSON file.

        Raises:
            ConfigError: unreadable file, bad syntax or an invalid value.
        """
        try:
            text = Path(path).read_text()
            data = json.loads(text) if str(path).endswith(".json") else yaml.safe_load(text)
        except (OSError, ValueError, yaml.YAMLError) as exc:
            raise ConfigError("config file", str(path), f"a readable YAML or JSON file ({exc})")
        return cls.parse(data, where=str(path))


_TIER_KINDS = [get_args(t.model_fields["kind"].annotation)[0]
               for t in (MemoryTierConfig, DiskTierConfig, SharedTierConfig, RedisTierConfig)]


def parse_model(model: type[BaseModel], data: Any, where: str) -> Any:
    """Validate `data` into `model`, turning the first pydantic error into a ConfigError."""
    try:
        return model.model_validate(data)
    except ConfigError as exc:  # raised by parse_size inside a validator
        raise ConfigError(f"{where}.{exc.field}", exc.value, exc.allowed) from None
    except ValidationError as exc:
        error = exc.errors()[0]
        loc, value, allowed = error["loc"], error.get("input"), error["msg"]
        cause = error.get("ctx", {}).get("error")
        if isinstance(cause, ConfigError):
            allowed = cause.allowed
        elif isinstance(cause, ValueError):
            allowed = str(cause)
        if error["type"] == "missing":
            value, allowed = None, "a value is required here"
        if error["type"] == "union_tag_invalid":
            loc, value = (*loc, "kind"), error["ctx"]["tag"]
            allowed = f"one of {error['ctx']['expected_tags']}"
        elif error["type"] == "union_tag_not_found":  # no `kind` at all: say which exist
            loc, value = (*loc, "kind"), None
            allowed = "a tier kind, one of " + ", ".join(repr(k) for k in _TIER_KINDS)
        field = ".".join(str(part) for part in (where, *loc))
        if error["type"] == "extra_forbidden":
            allowed = "unknown field; allowed fields: " + ", ".join(_fields_at(model, error["loc"]))
        raise ConfigError(field, value, allowed) from None


def _fields_at(model: type[BaseModel], loc: tuple[Any, ...]) -> list[str]:
    """Names of the fields allowed where an unknown one was found (best effort)."""
    if len(loc) >= 3 and loc[0] == "tiers":
        for tier in (MemoryTierConfig, DiskTierConfig, SharedTierConfig, RedisTierConfig):
            if tier.__name__.lower().startswith(str(loc[2])):
                return sorted(tier.model_fields)
    return sorted(model.model_fields)
