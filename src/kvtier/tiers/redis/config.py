"""The redis tier's config model (kind "redis"); see kvtier/tiers/redis/tier.py for the tier.

In a module of its own (not redis.py) because the connection code (redis_client.py) and the
operator's inventory (redis_inventory.py) read it too.

Primitives: `RedisTierConfig`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal
from urllib.parse import parse_qsl, unquote, urlsplit

from pydantic import Field, field_validator, model_validator
from redis.connection import parse_url

from kvtier.config import ByteSize, EnvVarName
from kvtier.errors import FieldError
from kvtier.redaction import redact_text, url_credentials
from kvtier.tiers.encoding import EncodedTierSettings

# ttl_s goes to Redis in whole milliseconds: under 1 ms would be no TTL at all. No cache
# keeps an idle chunk for more than a year: a longer TTL is taken for a typo.
MIN_TTL_S = 0.001
MAX_TTL_S = 365 * 24 * 3600
_URL_EXAMPLE = "e.g. redis://127.0.0.1:6379/0"
MAX_PART_BYTES = 512 * 1024**2  # Redis's largest value (proto-max-bulk-len's default)
MIN_PART_BYTES = 1024  # the smallest part_bytes: readers take no smaller part for a writer's


class RedisTierConfig(EncodedTierSettings):
    """A Redis or Valkey server, or a Redis Cluster (see kvtier/tiers/redis/tier.py).

    Credentials never come from the command line or the URL: a password file, or an
    environment variable (`password_env`, else KVTIER_REDIS_PASSWORD, else REDIS_PASSWORD).
    `codec` and the encryption settings: `kvtier.tiers.encoding.EncodedTierSettings`.
    """

    kind: Literal["redis"]
    capacity: ByteSize = 0  # bytes the tier keeps per namespace; 0 = the server's maxmemory
    url: str = "redis://127.0.0.1:6379/0"  # standalone server; rediss:// for TLS; no password
    cluster_nodes: tuple[str, ...] = ()  # "host:port" of some Redis Cluster nodes (not with url)
    tls: bool = False  # TLS to the server or cluster nodes (as a rediss:// url does)
    tls_ca_file: Path | None = None  # CA bundle that signed the server's certificate
    username: str | None = None  # ACL user; None = "default"
    password_file: Path | None = None  # file whose first line is the password (mode 0600)
    password_env: EnvVarName | None = None  # env var holding the password (see class docstring)
    ttl_s: float | None = None  # expire chunks idle this long (1 ms to 365 days); None = never
    # The largest field of a chunk's hash; larger chunks are split. 1 MiB: the server copies
    # each field it is sent (HSET), a block of 8 MiB or more from fresh pages each time: 8 MiB
    # fields put an 8 MiB chunk at 0.6x raw SET, 1 MiB fields at 1.1-1.6x (its reads at 7-14x
    # raw GET, against 4x; docs/performance.md).
    part_bytes: ByteSize = 1024**2
    # Bounded as the s3 tier's are: a socket timeout past ~30 years (`1e15`) raised an
    # OverflowError from the first call, which no tier call catches (redis-py hands it to
    # settimeout).
    socket_timeout_ms: int = Field(200, ge=1, le=600_000)  # longest wait for a reply: "down"
    connect_timeout_ms: int = Field(200, ge=1, le=60_000)  # longest wait for a TCP/TLS connect
    # Longest wait for a lookup's reply (a batch of HEXISTS: in-memory work, one round trip),
    # on connections of its own: then a miss, and lookups of that server miss at once for a
    # backoff, while reads and writes go on under socket_timeout_ms. A lookup waits on a
    # request's path (the node's checks, a failed load's report); socket_timeout_ms raised
    # for large transfers held each one that long on a server that stopped answering. Unset:
    # socket_timeout_ms (a lookup over a link that slow transfers share waits behind their
    # bytes: a shorter deadline there turns hits into misses, tests/engine/
    # test_load_or_recompute.py's slow link).
    lookup_timeout_ms: int | None = Field(None, ge=1, le=60_000)

    @property
    def lookup_deadline_ms(self) -> int:
        """A lookup's reply deadline: `lookup_timeout_ms`, else `socket_timeout_ms`."""
        return self.lookup_timeout_ms or self.socket_timeout_ms
    # Longest backoff between retries of a down server; at most an hour (`.inf` grew the
    # backoff without end: a server back after a blip was skipped for days).
    retry_max_s: float = Field(30.0, gt=0, le=3600)
    key_prefix: str = "kvtier:"  # prefix of every key this tier writes
    io_threads: int = Field(4, ge=1, le=64)  # write-behind threads the store gives this tier

    @field_validator("url")
    @classmethod
    def _url_without_password(cls, url: str) -> str:
        # Any part of the URL: a userinfo-only check misses `?password=`, and redis-py
        # honours it over password_file (issue 12, item 8). ConfigError masks it when shown.
        if not url.startswith(("redis://", "rediss://")):  # as redis-py reads it: lowercase
            raise ValueError("a redis:// or rediss:// (TLS) URL")
        found = url_credentials(url)
        if found:
            raise ValueError(f"no password in the URL (found: {'; '.join(found)}): it would "
                             "show in process listings, logs and shell history; put it in a "
                             "file named by password_file, or an environment variable named "
                             "by password_env")
        return url

    @field_validator("url")
    @classmethod
    def _url_port_and_database(cls, url: str) -> str:
        # redis-py parses the URL only when the tier first connects (in a worker), and takes
        # a bad database path for 0 and port 0 for 6379: checked here, naming the field.
        parts = urlsplit(url)
        try:
            port_ok = parts.port is None or 1 <= parts.port <= 65535
        except ValueError:  # not a number, or above 65535
            port_ok = False
        if not port_ok:
            raise ValueError(f"a port from 1 to 65535 ({_URL_EXAMPLE})")
        try:
            options = parse_url(url)  # type: ignore[no-untyped-call]
        except ValueError as exc:  # a query value it cannot convert, e.g. ?db=x
            raise ValueError(f"a URL redis-py can parse ({exc}; {_URL_EXAMPLE})") from None
        # redis-py lets a query option override what the tier sets (socket_timeout: the
        # tier's deadline; ssl_cert_reqs=none: no certificate check), and hands one it does
        # not know to the connection, which raises on first use.
        others = sorted(key for key, _ in parse_qsl(parts.query, keep_blank_values=True)
                        if key != "db")
        if others:
            raise ValueError(f"no query option but db (found: {', '.join(others)}): the tier "
                             "sets its own timeouts and TLS (socket_timeout_ms, "
                             "connect_timeout_ms, tls, tls_ca_file)")
        path_db = unquote(parts.path).strip("/")
        if (path_db and not (path_db.isascii() and path_db.isdigit())) or options.get("db", 0) < 0:
            raise ValueError(f"a database number >= 0 as the path ({_URL_EXAMPLE})")
        # redis-py takes ?db= over the path's, silently: given twice, they must agree.
        if path_db and "db" in options and int(path_db) != options["db"]:
            raise ValueError(f"one database: the path's ({path_db}) or ?db= ({options['db']}), "
                             "not two")
        # An empty host (a template's unset variable: redis://:6379/0) is localhost to
        # redis-py: the tier would talk to whatever listens there.
        if not parts.hostname:
            raise ValueError(f"a host ({_URL_EXAMPLE})")
        return url

    @field_validator("cluster_nodes")
    @classmethod
    def _host_ports(cls, nodes: tuple[str, ...]) -> tuple[str, ...]:
        for node in nodes:
            host, _, port = node.rpartition(":")
            if "@" in node or "/" in node:  # "user:pw@host:port" would pass as a host
                raise ValueError(f"{redact_text(node)!r} is not host:port "
                                 "(no credentials here: use password_file or password_env)")
            if not host or not (port.isascii() and port.isdigit()):
                raise ValueError(f"{node!r} is not host:port")
            if not 1 <= int(port) <= 65535:
                raise ValueError(f"{node!r}: a port from 1 to 65535")
        return nodes

    @field_validator("ttl_s")
    @classmethod
    def _ttl_in_range(cls, ttl_s: float | None) -> float | None:
        # Infinity overflowed the conversion to milliseconds when the tier was built.
        if ttl_s is not None and not MIN_TTL_S <= ttl_s <= MAX_TTL_S:  # NaN fails this too
            raise ValueError(f"seconds from {MIN_TTL_S} (1 ms) to {MAX_TTL_S} (365 days), "
                             "or null: chunks never expire")
        return ttl_s

    @model_validator(mode="after")
    def _one_server_and_password_source(self) -> RedisTierConfig:
        # Either pair would leave one setting silently unused: the tier reaches a cluster
        # through cluster_nodes alone, and reads password_env only without password_file.
        # Each names the field that would go unused (a ValueError would name the whole tier).
        if self.cluster_nodes and "url" in self.model_fields_set:
            raise FieldError("url", self.url, "url or cluster_nodes, not both (url names "
                             "one standalone server, cluster_nodes a Redis Cluster)")
        if self.password_file is not None and self.password_env:
            raise FieldError("password_env", self.password_env,
                             "password_file or password_env, not both")
        # redis-py takes the URL's user over `username`, silently.
        url_user = unquote(urlsplit(self.url).username or "")
        if url_user and self.username is not None and self.username != url_user:
            raise FieldError("username", self.username, f"the url's user ({url_user!r}) or "
                             "username, not two different users")
        return self

    @model_validator(mode="after")
    def _ca_only_with_tls(self) -> RedisTierConfig:
        # A CA file with a plain redis:// URL is an error, never dropped silently: the
        # operator would believe the connection verified TLS while it is clear text.
        if self.tls_ca_file is not None and not self.tls and not self.url.startswith("rediss://"):
            raise ValueError("tls_ca_file is set but TLS is off: use a rediss:// url or tls: true")
        return self

    @field_validator("part_bytes")
    @classmethod
    def _part_size(cls, size: int) -> int:
        # Above 512 MiB (Redis's proto-max-bulk-len by default) a chunk that large was
        # written in one value the server refuses: every store of it failed.
        if not MIN_PART_BYTES <= size <= MAX_PART_BYTES:
            raise ValueError("1 KiB to 512 MiB (a few MiB is best; Redis allows 512 MiB a "
                             "value)")
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
