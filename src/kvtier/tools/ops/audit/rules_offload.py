"""Audit rules about KV offload itself: which flag, how big, which companions it needs."""

from __future__ import annotations

import json
from collections.abc import Iterator

from kvtier.core.tier import Locality
from kvtier.tiers.registry import TIER_CLASSES, tier_class
from kvtier.tools.ops.audit.command import ServeCommand
from kvtier.tools.ops.audit.finding import Finding, Severity
from kvtier.tools.ops.audit.registry import AuditOptions, model_traits, rule
from kvtier.tools.ops.flags import DISABLE_HMA
from kvtier.tools.ops.vllm_versions import (
    NATIVE_CONNECTORS,
    HmaVerdict,
    format_version,
    hma_verdict,
)

_GIB = 1024**3


@rule("cpu-offload-gb-not-kv", "--cpu-offload-gb offloads weights, not KV")
def cpu_offload_gb(cmd: ServeCommand, _: AuditOptions) -> Iterator[Finding]:
    if not cmd.number("--cpu-offload-gb"):
        return
    also_kv = " (KV offload is configured too)" if cmd.offloads else ""
    yield Finding(
        "cpu-offload-gb-not-kv", Severity.INFO if cmd.offloads else Severity.WARNING,
        f"--cpu-offload-gb {cmd.value('--cpu-offload-gb')} is set{also_kv}",
        "it moves model WEIGHTS (per GPU) to host RAM and streams them over PCIe every "
        "forward pass: prefill gets slower; it does not extend the KV cache at all",
        "for KV tiering use --kv-offloading-size <GiB total> --kv-offloading-backend native "
        "(or kvtier's connector); keep --cpu-offload-gb only if the weights do not fit in HBM",
    )


@rule("offload-size-per-gpu", "--kv-offloading-size sized per GPU (SGLang habit)",
      reads=("--gpu",))
def offload_size_per_gpu(cmd: ServeCommand, opts: AuditOptions) -> Iterator[Finding]:
    size, tp = cmd.number("--kv-offloading-size"), cmd.tp
    if size is None or tp < 2:
        return
    util = cmd.number("--gpu-memory-utilization") or 0.9
    # A CPU tier smaller than one GPU's KV budget per GPU only mirrors HBM; half of the
    # GPU's usable memory is a conservative lower bound on that budget.
    floor_gib = opts.gpu.hbm_bytes * util / 2 / _GIB
    if size / tp >= floor_gib:
        return
    yield Finding(
        "offload-size-per-gpu", Severity.WARNING,
        f"--kv-offloading-size {size:g} with TP={tp} gives each GPU {size / tp:.1f} GiB of "
        f"host cache, under {floor_gib:.0f} GiB: half of what one {opts.gpu.name} gives vLLM "
        f"at --gpu-memory-utilization {util:g}",
        "the flag is the TOTAL across TP ranks (SGLang's is per rank): a per-GPU number "
        "gives 1/TP of the intended tier, which mostly mirrors HBM and adds few hits",
        f"if {size:g} was meant per GPU, pass --kv-offloading-size {size * tp:g} "
        f"(= {size:g} x {tp}); `kvtier plan --from-sglang {size:g} --tp {tp}` does the math",
    )


@rule("offload-backend-without-size", "--kv-offloading-backend without --kv-offloading-size")
def offload_backend_without_size(cmd: ServeCommand, _: AuditOptions) -> Iterator[Finding]:
    # vLLM (config/vllm.py _post_init_kv_transfer_config, read in 0.21.0 and 0.33.0): "KV
    # offloading is only activated when kv_offloading_size is set"; the backend alone is
    # accepted and does nothing.
    if not cmd.has("--kv-offloading-backend") or cmd.has("--kv-offloading-size"):
        return
    backend = cmd.value("--kv-offloading-backend") or "native"
    yield Finding(
        "offload-backend-without-size", Severity.WARNING,
        f"--kv-offloading-backend {backend} without --kv-offloading-size",
        "vLLM turns offload on only when --kv-offloading-size is set: it starts without "
        "offload and says nothing",
        "add --kv-offloading-size <GiB, total across TP ranks>, e.g. `kvtier plan` sizes it",
    )


@rule("offload-size-replaces-connector",
      "--kv-offloading-size beside a --kv-transfer-config connector: vLLM replaces it")
def offload_size_replaces_connector(cmd: ServeCommand, _: AuditOptions) -> Iterator[Finding]:
    # vLLM 0.32, VllmConfig._post_init_kv_transfer_config: with --kv-offloading-size set, the
    # kv_connector of --kv-transfer-config is overwritten with the offload backend's own (and
    # kv_role with kv_both); the connector configured there is never loaded.
    named = str((cmd.transfer_config or {}).get("kv_connector") or "")
    if not cmd.has("--kv-offloading-size") or not named:
        return
    backend = (cmd.value("--kv-offloading-backend") or "native").lower()
    own = "LMCacheMPConnector" if backend == "lmcache" else "OffloadingConnector"
    if named in (own, "SimpleCPUOffloadConnector"):
        return
    yield Finding(
        "offload-size-replaces-connector", Severity.ERROR,
        f"--kv-offloading-size {cmd.value('--kv-offloading-size')} beside "
        f"--kv-transfer-config's {named}",
        f"vLLM makes --kv-offloading-size its own {own}: it overwrites kv_connector in "
        f"--kv-transfer-config, so {named} is never loaded, and says nothing",
        f"drop --kv-offloading-size (and --kv-offloading-backend) to run {named}"
        + (" (kvtier's tiers are sized in its kv_connector_extra_config)"
           if named == "KVTierConnector" else "")
        + f", or drop --kv-transfer-config to run {own}",
    )


@rule("offload-needs-hma-flag", "offload without --disable-hybrid-kv-cache-manager",
      reads=("--model-config", "--vllm-version"))
def offload_needs_hma(cmd: ServeCommand, _: AuditOptions) -> Iterator[Finding]:
    if not cmd.offloads or cmd.has(DISABLE_HMA):
        return
    traits = model_traits(cmd)
    for connector in cmd.connectors:
        verdict = _verdict(cmd, connector, traits.hybrid)
        if verdict.required is False:
            continue
        fix = f"add {DISABLE_HMA}" + (
            "" if verdict.required else ", or pass --vllm-version so the audit can decide"
            if cmd.vllm_version is None else " (it does no harm where vLLM needs none)")
        if traits.linear:  # the flag would stop vLLM itself (rules_state.py, issue 25)
            fix = ("do not add the flag: vLLM cannot run Mamba/linear-attention layers without "
                   "the hybrid manager; " + ("use vLLM v0.21.0+, whose native offload keeps it"
                                             if connector in NATIVE_CONNECTORS else
                                             "serve this model without this connector"))
        yield Finding(
            "offload-needs-hma-flag",
            Severity.ERROR if verdict.required else Severity.WARNING,
            f"{connector} is configured without {DISABLE_HMA}",
            f"{verdict.reason}; " + ("startup fails" if verdict.required else "where it "
                                     "does, startup fails")
            + f" with 'Connector {connector} does not support HMA but HMA is enabled'",
            fix,
        )
        return


def _verdict(cmd: ServeCommand, connector: str, hybrid: bool) -> HmaVerdict:
    """`hma_verdict` for one of `cmd`'s connectors, by how it was configured (up to v0.21
    vLLM turned the manager off for any --kv-transfer-config, not for the flags' connector)."""
    return hma_verdict(cmd.vllm_version, connector, hybrid,
                       via_transfer_config=connector != cmd.flags_connector)


@rule("hma-flag-unneeded", "--disable-hybrid-kv-cache-manager kept where not needed",
      reads=("--model-config", "--vllm-version"))
def hma_flag_unneeded(cmd: ServeCommand, _: AuditOptions) -> Iterator[Finding]:
    if not cmd.has(DISABLE_HMA) or cmd.vllm_version is None:
        return
    hybrid = model_traits(cmd).hybrid
    verdicts = [_verdict(cmd, c, hybrid) for c in cmd.connectors]
    # Where vLLM turns the manager off by itself the flag changes nothing: not this finding.
    if not verdicts or any(v.required is not False or not v.manager_on for v in verdicts):
        return
    yield Finding(
        "hma-flag-unneeded", Severity.INFO,
        f"{DISABLE_HMA} is set on {format_version(cmd.vllm_version)} with "
        f"{', '.join(cmd.connectors)}",
        f"{verdicts[0].reason}; with the manager off, sliding-window and Mamba layers are "
        "allocated like full attention, so hybrid models lose KV capacity",
        f"re-test without {DISABLE_HMA}; keep it only if startup still fails",
    )


@rule("offload-without-prefix-caching", "offload with prefix caching disabled")
def offload_without_prefix_caching(cmd: ServeCommand, _: AuditOptions) -> Iterator[Finding]:
    disabled = cmd.has("--no-enable-prefix-caching") or str(
        cmd.value("--enable-prefix-caching")).lower() in ("false", "0")
    if cmd.offloads and disabled:
        yield Finding(
            "offload-without-prefix-caching", Severity.ERROR,
            "KV offload is configured but prefix caching is disabled",
            "without prefix caching vLLM never looks up earlier KV, so the offload tier is "
            "written to and never hit: pure cost",
            "remove --no-enable-prefix-caching (or pass --enable-prefix-caching)",
        )


@rule("shared-storage-hash-seed", "KV storage shared between processes without PYTHONHASHSEED")
def shared_storage_hash_seed(cmd: ServeCommand, _: AuditOptions) -> Iterator[Finding]:
    seed = cmd.env.get("PYTHONHASHSEED")
    if seed is not None and seed.isdigit():
        return
    storage = _hash_keyed_storage(cmd)
    if storage is None:
        return
    what, sharing = storage
    yield Finding(
        "shared-storage-hash-seed", Severity.ERROR if sharing else Severity.WARNING,
        f"{what} without PYTHONHASHSEED fixed (it is {seed or 'unset'})"
        + (f"; shared: {sharing}" if sharing else
           "; sharing between instances cannot be ruled out from the input"),
        "vLLM and LMCache seed their block hashes from Python's hash seed; each process "
        "picks a random one, so identical prompts get different keys in every process "
        "sharing the storage: 0% shared hit rate" + (
            "" if sharing else "; a single instance misses only what it stored before a "
            "restart"),
        "set PYTHONHASHSEED=0 (any fixed number) in every instance's environment"
        + ("" if sharing else " if another instance uses the same storage") +
        "; kvtier's own keys are blake3 of the tokens and do not need it",
    )


@rule("kvtier-shared-block-size", "kvtier shared tier with vLLM's default block size")
def kvtier_shared_block_size(cmd: ServeCommand, _: AuditOptions) -> Iterator[Finding]:
    if "KVTierConnector" not in cmd.connectors or cmd.has("--block-size"):
        return
    extra = (cmd.transfer_config or {}).get("kv_connector_extra_config") or {}
    tiers = extra.get("tiers") if isinstance(extra, dict) else None
    tiers = tiers if isinstance(tiers, list) else []
    # Kinds other engines read too (a REMOTE class, kvtier.core.tier.Tier.locality).
    shared = sorted({kind for t in tiers if isinstance(t, dict)
                     and (kind := t.get("kind")) in TIER_CLASSES
                     and tier_class(kind).locality is Locality.REMOTE})
    if shared:
        yield Finding(
            "kvtier-shared-block-size", Severity.INFO,
            f"kvtier {' and '.join(shared)} tier without an explicit --block-size",
            "a kvtier chunk holds vLLM's blocks (chunk order LBH2TD-v2), so engines share "
            "chunks only at the same block size, and vLLM's default differs by platform "
            "(16 on CUDA, 128 on the CPU backend): a mixed fleet would see 0% shared hits",
            "pass the same --block-size (e.g. 16, or 128 with a CPU engine in the fleet) to "
            "every engine that shares the tier",
        )


@rule("offload-ep-eagle3", "offload + expert parallel + EAGLE3 (vLLM#40259)")
def offload_ep_eagle3(cmd: ServeCommand, _: AuditOptions) -> Iterator[Finding]:
    spec = (cmd.value("--speculative-config") or "").lower()
    if cmd.offloads and cmd.has("--enable-expert-parallel") and "eagle3" in spec:
        yield Finding(
            "offload-ep-eagle3", Severity.ERROR,
            "KV offload combined with --enable-expert-parallel and EAGLE3 speculative decoding",
            "known segfault in cuMemcpyDtoHAsync (vllm-project/vllm#40259, open 2026-05)",
            "drop one of the three (offload, expert parallel, EAGLE3) until #40259 is fixed",
        )


@rule("hybrid-spec-decode-prefix-hits", "hybrid model + speculative decoding (vLLM#40624)")
def hybrid_spec_decode(cmd: ServeCommand, _: AuditOptions) -> Iterator[Finding]:
    if cmd.has("--speculative-config") and "gemma-4" in (cmd.model or "").lower().replace(
            "gemma4", "gemma-4"):
        yield Finding(
            "hybrid-spec-decode-prefix-hits", Severity.WARNING,
            "Gemma-4 with speculative decoding (3+ attention groups in the hybrid manager)",
            "prefix cache hit rate drops to 0% (vllm-project/vllm#40624), so offload and "
            "prefix caching gain nothing",
            f"add {DISABLE_HMA} and lower --max-model-len to fit the non-hybrid allocation",
        )


def _hash_keyed_storage(cmd: ServeCommand) -> tuple[str, str | None] | None:
    """The storage keyed by vLLM's/LMCache's block hashes that outlives or spans processes,
    and the evidence that several processes share it (None: no evidence either way)."""
    cfg = cmd.transfer_config or {}
    extra = json.dumps(cfg.get("kv_connector_extra_config") or {})
    replicas = f"{cmd.replicas} replicas" if (cmd.replicas or 0) > 1 else None
    dp = cmd.number("--data-parallel-size") or 1
    engines = f"--data-parallel-size {dp:g} (one engine process each)" if dp > 1 else None
    if any(c in NATIVE_CONNECTORS for c in cmd.connectors):
        if "SharedStorageOffloadingSpec" in extra or "shared_storage_path" in extra:
            return ("OffloadingConnector with llm-d's shared-storage backend",
                    replicas or engines or "llm-d's shared_storage_path is shared by design")
        if '"type": "fs"' in extra:
            return ("OffloadingConnector with a file-system tier",
                    replicas or engines or _on_network_volume(cmd))
    if cmd.uses_lmcache:
        remote = cmd.env.get("LMCACHE_REMOTE_URL")
        if remote:
            return "LMCache with a remote store", f"remote store {remote} (Redis, ...)"
        if cmd.tp > 1:
            return f"LMCache with TP={cmd.tp} workers", f"{cmd.tp} worker processes"
        if cmd.env.get("LMCACHE_LOCAL_DISK"):
            return "LMCache with a local-disk tier", replicas or engines
    return None


def _on_network_volume(cmd: ServeCommand) -> str | None:
    """Evidence that an fs secondary tier's root_dir is on a volume other pods mount."""
    extra = (cmd.transfer_config or {}).get("kv_connector_extra_config") or {}
    tiers = extra.get("secondary_tiers") if isinstance(extra, dict) else None
    roots = [str(t.get("root_dir")) for t in (tiers if isinstance(tiers, list) else [])
             if isinstance(t, dict)
             and t.get("type") == "fs" and t.get("root_dir")]
    for root in roots:
        for mount in cmd.shared_mounts:
            if root == mount or root.startswith(mount.rstrip("/") + "/"):
                return f"root_dir {root} is on a network volume mounted at {mount}"
    return None
