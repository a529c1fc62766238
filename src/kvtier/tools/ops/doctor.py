"""`kvtier doctor`: is this machine ready to serve with kvtier, and what will vLLM receive?

Primitives:
    Check                       -- one result: name, status ("ok", "warn", "fail", "skip"),
                                   detail (kvtier.tools.ops.machine, with the machine's own checks)
    read_store(path)            -- a kvtier config file -> the store dict (tiers...)
    store_from_flags(...)       -- the same from --memory/--disk/--shared/--redis
    check_vllm(), check_connector(module), check_store_config(store),
    check_chunk_size(store) (tokens_per_chunk against vLLM's default block here),
    check_tier_paths(store), check_memory(store), check_redis(store), ping_redis(config),
    check_node(store) (node mode: the node answers; /dev/shm's room)
    run_doctor(store, connector_module) -> list[Check]
    machine_doctor(connector_module) -> (list[Check], next steps)
                                -- no config given: the installation and the machine

Nothing it prints holds a credential: URLs are redacted (kvtier.redaction), and Redis is
reached with the tier's own password_file/password_env, never a password in a URL.

No check raises for an unhealthy machine: failures come back as Check(status="fail").
vLLM and the connector are probed without importing vLLM into this process (the connector
is imported in a child Python with a timeout, so a CUDA init hang cannot stall the doctor).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

import yaml

from kvtier.config import parse_model
from kvtier.core.stall import call_within
from kvtier.core.tier import Medium
from kvtier.errors import ConfigError, NodeUnavailable
from kvtier.integrations.vllm.config import (
    CONNECTOR_CLASS,
    CONNECTOR_MODULE,
    ConnectorConfig,
    chunk_sizes_allowed,
    kvtier_transfer_config,
)
from kvtier.integrations.vllm.versions import running_vllm
from kvtier.redaction import redact, redact_text
from kvtier.tiers.files import directories
from kvtier.tiers.redis.config import RedisTierConfig
from kvtier.tiers.registry import TIER_CLASSES, config_model, tier_class
from kvtier.tiers.s3.config import S3TierConfig
from kvtier.tiers.shmslab import SHM_DIR
from kvtier.tools.ops.chunkfit import engine_blocks, misfits
from kvtier.tools.ops.machine import Check as Check  # re-exported: doctor's result type
from kvtier.tools.ops.machine import Status, check_host_ram, check_pinned_memory
from kvtier.tools.ops.machine import check_vllm as check_vllm  # re-exported
from kvtier.tools.ops.serving import default_disk_path, default_tiers, is_cpu_backend
from kvtier.units import format_size, parse_size

CONNECTOR_IMPORT_TIMEOUT_S = 120.0
REDIS_TIMEOUT_S = 1.0
# What a capacity split by rank means (StoreConfig.per_rank): one engine's, whatever its TP
# size; a capacity not split is one quota for the whole directory.
PER_ENGINE = "per engine: the total of its TP ranks, each holds 1/TP"
WHOLE_DIRECTORY = "the whole directory's quota"


def read_store(path: str | Path) -> dict[str, Any]:
    """Read a kvtier config file (YAML or JSON): a store ({tiers: ...}) or a connector
    extra config ({store: {tiers: ...}}). Returns the store dict, unvalidated.

    Raises:
        ConfigError: unreadable file, bad syntax, or no `tiers` list.
    """
    try:
        text = Path(path).read_text()
        data = json.loads(text) if str(path).endswith(".json") else yaml.safe_load(text)
    except (OSError, ValueError, yaml.YAMLError) as exc:
        raise ConfigError("config", str(path), f"a readable YAML or JSON file ({exc})") from exc
    if isinstance(data, dict) and isinstance(data.get("store"), dict):
        data = data["store"]
    if isinstance(data, dict) and isinstance(data.get("node"), str):  # node mode
        return data
    if not isinstance(data, dict) or not isinstance(data.get("tiers"), list):
        raise ConfigError("config", str(path), "a mapping with a `tiers` list (or `node`: the "
                                               "socket of a kvtier node)")
    return data


def store_from_flags(
    memory: str | None = None, disks: tuple[str, ...] = (), shared: tuple[str, ...] = (),
    redis_url: str | None = None,
) -> dict[str, Any]:
    """Build a store dict from CLI flags; disks and shared dirs are "PATH:SIZE".

    Raises:
        ConfigError: for a "PATH:SIZE" without a size, or when no tier is given.
    """
    tiers: list[dict[str, Any]] = []
    if memory:
        tiers.append({"kind": "memory", "capacity": memory})
    for kind, specs in (("disk", disks), ("shared", shared)):
        for spec in specs:
            path, sep, size = spec.rpartition(":")
            if not sep or not path:
                raise ConfigError(f"--{kind}", spec, "PATH:SIZE, e.g. /mnt/nvme/kvtier:1TiB")
            tiers.append({"kind": kind, "path": path, "capacity": size})
    if redis_url:
        tiers.append({"kind": "redis", "url": redis_url, "capacity": "0"})
    if not tiers:
        raise ConfigError("tiers", None, "a config file or at least one of --memory, --disk, "
                          "--shared, --redis")
    return {"tiers": tiers}


def check_connector(module: str = CONNECTOR_MODULE, attr: str = CONNECTOR_CLASS) -> Check:
    """Can vLLM import `module.attr`? Probed in a child interpreter with a timeout."""
    code = f"import importlib; getattr(importlib.import_module({module!r}), {attr!r})"
    try:
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              timeout=CONNECTOR_IMPORT_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return Check("connector", "fail", f"importing {module} took over "
                     f"{CONNECTOR_IMPORT_TIMEOUT_S:g} s")
    if proc.returncode == 0:
        return Check("connector", "ok", f"{module}.{attr} imports")
    last = (proc.stderr.strip().splitlines() or ["unknown error"])[-1]
    return Check("connector", "fail", f"{module}.{attr}: {last}")


def check_store_config(store: Mapping[str, Any]) -> Check:
    """Does the store dict validate as the connector's extra config (ConnectorConfig)?"""
    try:
        ConnectorConfig.parse(store, where="store")
    except ConfigError as exc:
        return Check("config", "fail", str(exc))
    if store.get("node"):
        return Check("config", "ok", f"node mode: the tiers of the node at {store['node']}")
    return Check("config", "ok", f"{len(store['tiers'])} tier(s) valid")


def check_chunk_size(store: Mapping[str, Any]) -> list[Check]:
    """A tokens_per_chunk set in the config against vLLM's default block size on this
    machine's vLLM build (kvtier.tools.ops.chunkfit; unknown without vLLM: CUDA's and the CPU
    backend's both), so that a size the engine would refuse at start is said ahead. A
    warning, not a failure: doctor sees no command line, whose --block-size may divide it
    (`kvtier audit` judges the command line). Nothing for an invalid config
    (check_store_config reports it) or a chunk size left to the connector."""
    try:
        config = ConnectorConfig.parse(store, where="store")
    except ConfigError:
        return []
    if not config.tokens_per_chunk_set:
        return []
    tokens = config.tokens_per_chunk
    on_cpu = is_cpu_backend() if running_vllm() is not None else None
    blocks = engine_blocks(None, on_cpu)
    bad = misfits(tokens, blocks)
    if not bad:
        return [Check("tokens_per_chunk", "ok", f"{tokens}: a multiple of "
                      + " and of ".join(b.source for b in blocks))]
    return [Check("tokens_per_chunk", "warn",
                  f"{tokens} is not a multiple of {bad[0].source}: the engine refuses it at "
                  f"start unless its --block-size divides {tokens}. Allowed: "
                  + chunk_sizes_allowed(tokens, bad[0].size))]


def check_node(store: Mapping[str, Any]) -> list[Check]:
    """In node mode (`node`: a socket), does a node answer there, and with what? The shared
    memory its RAM tier lives in (/dev/shm) has room for what it holds."""
    socket_path = store.get("node")
    if not socket_path:
        return []
    from kvtier.node.client import node_status  # the node's client: only in node mode

    name = f"node {socket_path}"
    try:
        status: dict[str, Any] = node_status(str(socket_path), timeout_s=REDIS_TIMEOUT_S * 5)
    except NodeUnavailable as exc:
        return [Check(name, "fail", f"no node answers ({exc}): start one with `kvtier node "
                                    f"serve --config node.yaml --socket {socket_path}`")]
    layouts = status.get("layouts", {})
    held = sum(t["capacity_bytes"] for layout in layouts.values() for t in layout["tiers"][:1])
    checks = [Check(name, "ok", f"node {status['node']} answers: {len(status['engines'])} "
                                f"engine(s), {len(layouts)} layout(s), RAM {format_size(held)}")]
    shm = shutil.disk_usage(SHM_DIR) if SHM_DIR.is_dir() else None
    if shm is not None:
        checks.append(Check(f"shared memory {SHM_DIR}", "ok" if shm.free > 0 else "warn",
                            f"{format_size(shm.free)} free of {format_size(shm.total)}; the "
                            f"node's RAM slabs take {format_size(_slab_bytes(layouts))}"))
    return checks


def _slab_bytes(layouts: Mapping[str, Any]) -> int:
    """What the node's slabs take in /dev/shm: their files' sizes (the slots, and a record and
    a stamp a slot: `shmslab.slab_file_bytes`, as `kvtier plan --node-engines` sizes them),
    or the RAM tier's capacity where a file is not to be seen here. Before, the capacity
    alone: 2.7% short at 4 KiB chunks."""
    taken = 0
    for layout in layouts.values():
        try:
            taken += Path(layout["shm_path"]).stat().st_size
        except OSError:
            taken += sum(t["capacity_bytes"] for t in layout["tiers"][:1])
    return taken


def check_tier_paths(store: Mapping[str, Any]) -> list[Check]:
    """Each tier whose class `has_path`: directory writable (or creatable) with room for its
    capacity, answering within `directories.CHECK_TIMEOUT_S` (a dead hard-mounted NFS server
    blocks every call into it for ever: the doctor says so rather than hang)."""
    out = []
    for tier in _tiers(store):
        cls = tier_class(tier["kind"])
        if not cls.has_path or "path" not in tier:
            continue
        name = f"tier {tier.get('name') or tier['kind']}: {tier['path']}"
        scope = PER_ENGINE if cls.capacity_split_by_rank else WHOLE_DIRECTORY
        answered, check = call_within(
            partial(_check_dir, name, Path(str(tier["path"])), tier.get("capacity", 0), scope,
                    read_only_ok=tier["kind"] == "shared"),
            directories.CHECK_TIMEOUT_S, "kvtier-doctor-path")
        out.append(check if answered and check is not None else Check(
            name, "fail", f"did not answer within {directories.CHECK_TIMEOUT_S:g} s (a dead "
                          "mount?): kvtier leaves this tier out while it does not"))
    return out


def check_memory(store: Mapping[str, Any]) -> Check:
    """The tiers in host RAM (medium CPU) together fit in the host's available RAM."""
    want = sum(_size(t.get("capacity", 0)) for t in _tiers(store)
               if tier_class(t["kind"]).medium is Medium.CPU)
    if not want:
        return Check("host memory", "skip", "no memory tier")
    avail = _mem_available()
    if avail is None:
        return Check("host memory", "skip", "MemAvailable unknown on this OS")
    status: Status = "ok" if want <= avail else "fail"
    return Check("host memory", status, f"memory tiers want {format_size(want)} "
                 f"({PER_ENGINE}), {format_size(avail)} available")


def check_redis(store: Mapping[str, Any]) -> list[Check]:
    """Each tier whose class `has_server` answers within REDIS_TIMEOUT_S, reached as the tier
    reaches it (`ping_redis`: a Redis/Valkey server; a server of another protocol is skipped).
    A tier whose settings are invalid (e.g. a password in its URL) fails without a connection
    attempt."""
    out = []
    for index, tier in enumerate(store.get("tiers", [])):
        kind = tier.get("kind") if isinstance(tier, Mapping) else None
        if kind not in TIER_CLASSES or not tier_class(kind).has_server:
            continue
        name = f"{kind} {_s3_target(tier) if kind == 's3' else _redis_target(tier)}"
        try:
            config = parse_model(config_model(kind), dict(tier), f"store.tiers.{index}.{kind}")
        except ConfigError as exc:
            out.append(Check(name, "fail", str(exc)))
            continue
        if isinstance(config, S3TierConfig):
            out.append(ping_s3(config))
            continue
        out.append(ping_redis(config) if isinstance(config, RedisTierConfig) else
                   Check(name, "skip", "the doctor speaks the Redis and S3 protocols only"))
    return out or [Check("redis", "skip", "no redis tier configured")]


def ping_redis(config: RedisTierConfig) -> Check:
    """PING a redis tier's server (every node of a Cluster) the way the tier connects: its
    URL or cluster nodes, TLS and CA file, ACL user, password from password_file or the
    environment (never the URL); with REDIS_TIMEOUT_S timeouts. Credentials are never in the
    result (kvtier.redaction)."""
    import redis  # local: only doctor runs with a redis tier need it

    from kvtier.tiers.redis.client import connect, read_password

    name = f"redis {_redis_target(config.model_dump())}"
    timeout_ms = int(REDIS_TIMEOUT_S * 1000)
    quick = config.model_copy(update={"socket_timeout_ms": timeout_ms,
                                      "connect_timeout_ms": timeout_ms})
    try:
        password = read_password(config)
    except ConfigError as exc:
        return Check(name, "fail", str(exc))
    try:
        client = connect(quick, password)
        try:
            client.ping()
        finally:
            client.close()
    except (redis.RedisError, OSError, ValueError) as exc:
        return Check(name, "fail", f"unreachable: {redact_text(str(exc))}")
    how = [f"{len(config.cluster_nodes)} cluster node(s)"] if config.cluster_nodes else []
    if config.tls or config.url.startswith("rediss://"):
        how.append("TLS")
    if config.username or password is not None:
        how.append(f"as user {config.username or 'default'} with a password")
    return Check(name, "ok", "PING answered" + (f" ({', '.join(how)})" if how else ""))


def ping_s3(config: S3TierConfig) -> Check:
    """HEAD an s3 tier's bucket the way the tier connects: its endpoint, region, TLS
    verification and CA file, credentials from `credentials_file`/`profile` or the standard
    places; with REDIS_TIMEOUT_S timeouts. Says where the credentials came from, never them."""
    from kvtier.tiers.s3.client import S3Errors, connect, credentials_source, open_session

    name = f"s3 {_s3_target(config.model_dump())}"
    quick = config.model_copy(update={"connect_timeout_s": REDIS_TIMEOUT_S,
                                      "request_timeout_s": REDIS_TIMEOUT_S})
    try:
        session = open_session(config)
        errors = S3Errors()
    except ConfigError as exc:
        return Check(name, "fail", str(exc))
    client = connect(quick, session, 1)
    try:
        refused, listed = _bucket_answer(client, config, errors)
    except errors.down as exc:
        return Check(name, "fail", f"unreachable: {redact_text(type(exc).__name__)}")
    finally:
        client.close()
    if refused:
        return Check(name, "fail", f"the bucket check answered {refused} (403: the "
                     "credentials are refused; 404: no such bucket)")
    if not listed and config.capacity > 0:
        return Check(name, "fail", "a HEAD of the bucket refused (no s3:ListBucket), which "
                     "the capacity's listing needs")
    tls = "TLS verified" if (config.endpoint_url or "https:").startswith("https:") and \
        config.tls_verify else "no TLS verification"
    return Check(name, "ok", f"bucket answered ({tls}; credentials from "
                 f"{credentials_source(session)}"
                 f"{'' if listed else '; no s3:ListBucket: its objects answered'})")


def _bucket_answer(client: Any, config: S3TierConfig, errors: Any) -> tuple[str, bool]:
    """What refused the tier's credentials ("": nothing), and whether the bucket's HEAD
    answered (False: refused to credentials the server knows, as the tier starts anyway:
    `refusal_of_credentials`). Raises: `errors.down`."""
    from kvtier.tiers.s3.client import error_code, is_refused, refusal_of_credentials

    try:
        client.head_bucket(Bucket=config.bucket)
    except errors.answered as exc:
        if not is_refused(exc):
            return error_code(exc), False
        refused = refusal_of_credentials(lambda: client.get_object(
            Bucket=config.bucket, Key=f"{config.key_prefix}/absent-{uuid.uuid4().hex}"),
            errors.answered)
        return (f"{error_code(exc)}, then {refused}" if refused else ""), False
    return "", True


def _s3_target(tier: Mapping[str, Any]) -> str:
    """An s3 tier's endpoint and bucket, for display (redacted)."""
    return redact(f"{tier.get('endpoint_url') or 'aws'}/{tier.get('bucket', '?')}")


def _redis_target(tier: Mapping[str, Any]) -> str:
    """What a redis tier connects to, for display: its cluster nodes or its URL, redacted."""
    nodes = tier.get("cluster_nodes")
    if nodes:
        return redact_text(",".join(str(node) for node in nodes))
    return redact(str(tier.get("url") or "redis://127.0.0.1:6379/0"))


def run_doctor(store: Mapping[str, Any], connector_module: str = CONNECTOR_MODULE) -> list[Check]:
    """Every check, in the order an operator fixes them; any URL in them redacted."""
    checks = [check_vllm(), check_connector(connector_module), check_store_config(store),
              *check_chunk_size(store), *check_node(store), check_memory(store),
              *check_tier_paths(store), *check_redis(store)]
    return [Check(redact_text(c.name), c.status, redact_text(c.detail)) for c in checks]


def machine_doctor(connector_module: str = CONNECTOR_MODULE) -> tuple[list[Check], list[str]]:
    """No config given: check the installation (vLLM's build against this host's GPUs, the
    connector importable, pinned memory) and the machine (RAM, the default disk tier's
    directory), then say what to pass next. Returns (checks, next steps)."""
    disk = default_disk_path()
    # The two probes each start a child Python (vLLM's import, torch's CUDA init): together,
    # so the doctor takes the longer of the two, not their sum.
    with ThreadPoolExecutor(max_workers=2) as pool:
        connector = pool.submit(check_connector, connector_module)
        pinned = pool.submit(check_pinned_memory)
        checks = [check_vllm(), connector.result(), pinned.result(), check_host_ram(),
                  _check_dir(f"default disk tier: {disk}", disk, 0, PER_ENGINE)]
    return [Check(redact_text(c.name), c.status, redact_text(c.detail)) for c in checks], \
        next_steps()


def next_steps() -> list[str]:
    """The commands to run next, with the tier sizes `kvtier serve` would pick here."""
    try:
        tiers = default_tiers(cpu=is_cpu_backend())
    except (ConfigError, OSError):
        tiers = []
    # The flags are named after the kinds (store_from_flags); a tier with a path is PATH:SIZE.
    flags = " ".join(f"--{t['kind']} {t['path']}:{t['capacity']}"
                     if tier_class(t["kind"]).has_path else f"--{t['kind']} {t['capacity']}"
                     for t in tiers)
    return [f"check a tier layout: kvtier doctor {flags or '--memory SIZE --disk PATH:SIZE'} "
            "(or kvtier doctor CONFIG.yaml); these are the sizes kvtier serve picks here",
            "size the tiers for a model: kvtier plan MODEL_DIR --tp N --host-ram SIZE",
            "check a serve command before deploying it: kvtier audit 'vllm serve ...'"]


def transfer_config_json(store: Mapping[str, Any]) -> str:
    """The exact `--kv-transfer-config` JSON vLLM would receive for `store`.

    Raises:
        ConfigError: when the store config is invalid (check_store_config says why).
    """
    return json.dumps(kvtier_transfer_config(store), separators=(",", ":"))


def _check_dir(name: str, path: Path, capacity: Any, scope: str,
               read_only_ok: bool = False) -> Check:
    """`read_only_ok`: the tier serves an existing directory it cannot write (a shared
    tier on a read-only mount: the hits other nodes wrote), a warning, not a failure."""
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        return Check(name, "fail", f"{existing} is not a directory")
    try:
        with tempfile.NamedTemporaryFile(dir=existing, prefix=".kvtier-doctor-"):
            pass
    except OSError as exc:
        if read_only_ok and existing == path:
            return Check(name, "warn", f"read-only ({exc.strerror or exc}): served read-only, "
                         "its hits loaded, nothing stored")
        return Check(name, "fail", f"cannot write in {existing}: {exc.strerror or exc}")
    free = shutil.disk_usage(existing).free
    want = _size(capacity)
    where = "" if existing == path else f" (will be created under {existing})"
    if want > free:
        return Check(name, "fail", f"capacity {format_size(want)} but only "
                     f"{format_size(free)} free{where}")
    if not want:
        return Check(name, "ok", f"writable, {format_size(free)} free{where}")
    return Check(name, "ok", f"writable, {format_size(free)} free for "
                 f"{format_size(want)} ({scope}){where}")


def _tiers(store: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """The entries of `store`'s tiers of a known kind (check_store_config reports the rest)."""
    return [t for t in store.get("tiers", [])
            if isinstance(t, Mapping) and t.get("kind") in TIER_CLASSES]


def _size(value: Any) -> int:
    try:
        return parse_size(value, "capacity")
    except ConfigError:
        return 0  # check_store_config reports the bad value


def _mem_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
