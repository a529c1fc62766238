"""The redis tier's connection to a Redis/Valkey server or a Redis Cluster (see tier.py):
the password, a client with the tier's timeouts, TCP keepalive and redis-py's retries off, and
which errors mean "the server is not answering".

A call blocks at most `socket_timeout_ms` on an open connection, `connect_timeout_ms` +
`socket_timeout_ms` on a new one: redis-py's own retries are off, as they would multiply that.
Lookups have a client of their own, whose reply deadline is `lookup_timeout_ms` (tier.py).
Credentials: `password_file` or an environment variable (config.py); never the URL or argv.
TLS: `rediss://` or `tls: true`, verified against `tls_ca_file` or the system CAs.
For a Cluster, start the servers with `cluster-require-full-coverage no`, so that a dead node
costs only the chunks of its slots (with the default `yes` the whole cluster refuses queries once
it notices). A resharding is followed: lookups, reads and deletes follow its ASK and MOVED
redirections (redis-py), and a put into a migrating slot its ASK (write.py).

TCP keepalive (`KEEPALIVE_OPTIONS`), set by the tier whatever redis-py's version: redis-py
before 8 (pyproject allows >= 5) leaves it off, 8 turns it on with its own timers. Without
it a pooled connection whose peer vanished without a FIN or RST (a NAT or firewall that
dropped the flow, a node powered off) stays open for ever, and the next call on it waits out
`socket_timeout_ms` before the server is taken for down; with keepalive the kernel probes an
idle connection and closes a dead one within about a minute and a half (so the next call
fails at once, or takes a fresh connection), and the probes keep a NAT's idle timer (often
350 s) from dropping a healthy flow. redis-py's
`health_check_interval` is not used: it PINGs before a call on a connection idle that long,
a round trip on the read's path, and with redis-py's retries off a failed PING fails the
call just as the call itself would.

Primitives: `Client`, `UNAVAILABLE`, `KEEPALIVE_OPTIONS`, `read_password`, `connect`,
`check_server_limits`, `wrong_type`.
"""

from __future__ import annotations

import logging
import os
import socket
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.exceptions import ClusterDownError, RedisClusterException, SlotNotCoveredError
from redis.retry import Retry

from kvtier.errors import ConfigError
from kvtier.tiers.redis.config import RedisTierConfig

# The tier's logger, not this module's: operators filter on "kvtier.tiers.redis.tier" for the tier.
log = logging.getLogger("kvtier.tiers.redis.tier")
Client = redis.Redis | RedisCluster
# Errors that mean "the server is not answering" (AuthenticationError is a ConnectionError).
UNAVAILABLE = (redis.ConnectionError, redis.TimeoutError, ClusterDownError, SlotNotCoveredError,
               OSError)
PASSWORD_ENVS = ("KVTIER_REDIS_PASSWORD", "REDIS_PASSWORD")
# Bytes asked of the socket per recv (redis-py's default: 64 KiB). A thread reading beside the
# model runner must win the GIL back after every recv, which a busy runner hands over only each
# `sys.getswitchinterval()` (5 ms): 32 MiB in 64 KiB reads took 2.3 s against 28 ms alone,
# in 2 MiB reads 0.24 s (docs/performance.md, "I/O threads' cores, and the GIL").
READ_SIZE = 2 * 1024**2
# TCP keepalive of an idle connection: the first probe after 60 s idle, then one each 10 s;
# 3 unanswered close it (~90 s). Options a platform lacks are left to its defaults.
# (macOS names the idle time TCP_KEEPALIVE.)
KEEPALIVE_OPTIONS: dict[int, int] = {
    getattr(socket, name): value
    for name, value in (("TCP_KEEPIDLE" if hasattr(socket, "TCP_KEEPIDLE") else "TCP_KEEPALIVE",
                         60), ("TCP_KEEPINTVL", 10), ("TCP_KEEPCNT", 3))
    if hasattr(socket, name)}


def wrong_type(exc: BaseException) -> bool:
    """Whether `exc` is the server's WRONGTYPE reply: the value at one of the tier's names is
    of another type than the tier stores there (another application's, a hand-made one)."""
    return isinstance(exc, redis.ResponseError) and str(exc).startswith("WRONGTYPE")


def read_password(config: RedisTierConfig) -> str | None:
    """The password: `password_file`'s first line, else the environment (`password_env`, or
    KVTIER_REDIS_PASSWORD, then REDIS_PASSWORD), else None.

    Raises:
        ConfigError: the file is unreadable or empty, or `password_env` names an unset variable.
    """
    if config.password_file is not None:
        try:
            lines = config.password_file.read_text().splitlines()
        except OSError as exc:
            raise ConfigError("password_file", str(config.password_file),
                              f"a readable file ({exc.strerror})") from None
        if not lines or not lines[0]:
            raise ConfigError("password_file", str(config.password_file),
                              "a file whose first line is the password")
        if config.password_file.stat().st_mode & 0o077:
            log.warning("redis password file %s is readable by others; chmod 600 it",
                        config.password_file)
        return lines[0]
    names = (config.password_env,) if config.password_env else PASSWORD_ENVS
    for name in names:
        if os.environ.get(name):
            return os.environ[name]
    if config.password_env:
        raise ConfigError("password_env", config.password_env, "a set environment variable")
    return None


def connect(config: RedisTierConfig, password: str | None, *,
            socket_timeout_ms: int | None = None) -> Client:
    """A client for the server or cluster `config` names, with its timeouts and no retries;
    `socket_timeout_ms`: a reply's deadline other than the config's (the lookups' client).

    A standalone client connects on first use; a cluster client asks a node for the slot map
    now.

    Raises:
        redis.ConnectionError: no cluster node answered.
    """
    common: dict[str, Any] = {
        "username": config.username, "password": password,
        "socket_timeout": (socket_timeout_ms or config.socket_timeout_ms) / 1000,
        "socket_connect_timeout": config.connect_timeout_ms / 1000,
        "retry": Retry(NoBackoff(), 0),
        "socket_read_size": READ_SIZE,
        "socket_keepalive": True,
        "socket_keepalive_options": KEEPALIVE_OPTIONS,
    }
    if config.tls_ca_file is not None:
        common["ssl_ca_certs"] = str(config.tls_ca_file)
    if not config.cluster_nodes:
        url = config.url
        if config.tls and url.startswith("redis://"):  # `tls: true` must not mean plaintext
            url = "rediss://" + url.removeprefix("redis://")
        if not url.startswith("rediss://"):
            common.pop("ssl_ca_certs", None)
        return redis.Redis.from_url(url, **common)
    nodes = [ClusterNode(host, int(port))
             for host, _, port in (node.rpartition(":") for node in config.cluster_nodes)]
    try:
        return RedisCluster(startup_nodes=nodes, ssl=config.tls, require_full_coverage=False,
                            **common)
    except RedisClusterException as exc:  # "cannot be connected": no node answered
        raise redis.ConnectionError(str(exc)) from exc


def check_server_limits(client: redis.Redis, tier_name: str, part_bytes: int,
                        read_bytes: int) -> None:
    """Warn when the server's own limits cut a tier's values: its largest part (`part_bytes`)
    above the server's `proto-max-bulk-len` (it closes the connection on each put of one), a
    chunk's read reply (`read_bytes`) above its hard `client-output-buffer-limit` for normal
    clients (it closes it on each read). Either reads as the server down, again and again.
    Skipped when CONFIG is refused (an ACL user without it, a managed server). Raises
    nothing."""
    try:
        found = {**client.config_get("proto-max-bulk-len"),
                 **client.config_get("client-output-buffer-limit")}
    except (redis.RedisError, OSError):
        return
    limits = str(found.get("client-output-buffer-limit") or "").split()
    try:
        bulk = int(found.get("proto-max-bulk-len") or 0)
        hard = int(limits[limits.index("normal") + 1]) if "normal" in limits[:-1] else 0
    except ValueError:  # not this server's format: no warning rather than a wrong one
        return
    if bulk and part_bytes > bulk:
        log.warning("redis tier %r: a chunk's largest part (%d bytes) is above the server's "
                    "proto-max-bulk-len (%d): it drops the connection on each put of one, taken "
                    "for the server down; set part_bytes <= %d", tier_name, part_bytes, bulk,
                    bulk)
    if hard and read_bytes > hard:
        log.warning("redis tier %r: a chunk's read (%d bytes) is above the server's hard "
                    "client-output-buffer-limit for normal clients (%d): it drops the "
                    "connection on each read, taken for the server down; raise it",
                    tier_name, read_bytes, hard)
