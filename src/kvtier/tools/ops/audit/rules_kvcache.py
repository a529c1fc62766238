"""Audit rules about the GPU KV cache: dtype, scales, context length, blocks, batching."""

from __future__ import annotations

from collections.abc import Iterator

from kvtier.tools.ops.audit.command import ServeCommand
from kvtier.tools.ops.audit.finding import Finding, Severity
from kvtier.tools.ops.audit.registry import AuditOptions, model_traits, rule
from kvtier.tools.ops.hardware import GpuProfile
from kvtier.tools.ops.kvdtypes import per_tensor_fp8
from kvtier.tools.ops.modelspec import parse_model_config
from kvtier.tools.ops.vllm_versions import format_version

# --calculate-kv-scales: deprecated (no effect) from v0.19; absent from the installed 0.32.0.
_SCALES_DEPRECATED = (0, 19, 0)
_SCALES_ABSENT = (0, 32, 0)
_LONG_CONTEXT = 128 * 1024  # --block-size 32 pays from here
_TRAFFIC_UNKNOWN = 128 * 1024  # ask for the traffic's p95-p99 from here
_SHORT_CONTEXT = 32 * 1024  # --block-size 32 is neutral or a slight loss below this
_LONG_PROMPTS = 32 * 1024  # without a prefill cap, long prompts starve decode
_GIB = 1024**3


@rule("fp8-kv-without-scales", "FP8 KV cache on a checkpoint without calibrated scales",
      reads=("--model-config",))
def fp8_kv(cmd: ServeCommand, _: AuditOptions) -> Iterator[Finding]:
    dtype = (cmd.value("--kv-cache-dtype") or "auto").lower()
    if not per_tensor_fp8(dtype):  # fp8_per_token_head, fp8_ds_mla compute their scales
        return
    quant = (cmd.model_config or {}).get("quantization_config") or {}
    if isinstance(quant, dict) and ("kv_cache_scheme" in quant or "kv_cache_quant_algo" in quant):
        return  # the checkpoint declares calibrated KV scales
    yield Finding(
        "fp8-kv-without-scales", Severity.WARNING,
        f"--kv-cache-dtype {dtype} and no calibrated k/v scales known for the checkpoint",
        "without k_scale/v_scale in the checkpoint vLLM uses scale 1.0, which clips large "
        "activations: subtle quality loss, mostly past 128k tokens of code context",
        "keep BF16 KV and win the memory back with offload, or use a checkpoint that ships "
        "KV scales (pass --model-config to let the audit check)",
    )


@rule("calculate-kv-scales-deprecated", "--calculate-kv-scales is deprecated / removed")
def calculate_kv_scales(cmd: ServeCommand, _: AuditOptions) -> Iterator[Finding]:
    if not cmd.has("--calculate-kv-scales"):
        return
    version = cmd.vllm_version
    removed = version is not None and version >= _SCALES_ABSENT
    yield Finding(
        "calculate-kv-scales-deprecated", Severity.ERROR if removed else Severity.WARNING,
        "--calculate-kv-scales is set" + (
            f" on {format_version(version)}" if version else ""),
        ("vLLM " + format_version(_SCALES_ABSENT) + " has no such flag: startup fails with "
         "an unrecognized argument") if removed else (
            "deprecated since ~" + format_version(_SCALES_DEPRECATED) + ": it has no effect, "
            "vLLM always loads scales from the checkpoint (or uses 1.0)"),
        "remove the flag; for FP8 KV use a checkpoint with calibrated k/v scales",
    )


@rule("enforce-eager-workaround", "--enforce-eager used as a fragmentation workaround",
      reads=("--model-config",))
def enforce_eager(cmd: ServeCommand, _: AuditOptions) -> Iterator[Finding]:
    if not cmd.has("--enforce-eager"):
        return
    hybrid = model_traits(cmd).hybrid
    yield Finding(
        "enforce-eager-workaround", Severity.INFO if hybrid else Severity.WARNING,
        "--enforce-eager is set" + (" (hybrid model)" if hybrid else ""),
        "it disables CUDA graphs; steady-state throughput drops by more than fragmentation "
        "costs (measured: prefix-hit turn 2.4 s -> 0.64 s after removing it)",
        "remove it; for fragmentation at long context use --block-size 32. Keep it only "
        "where the architecture needs it (some hybrid DeltaNet+attention models)",
    )


@rule("max-model-len-too-high", "--max-model-len far above what traffic needs",
      needs=("--typical-context",))
def max_model_len(cmd: ServeCommand, opts: AuditOptions) -> Iterator[Finding]:
    mml = cmd.number("--max-model-len")
    need = opts.typical_context_tokens
    if mml is None or need is None or mml <= 2 * need:
        return
    yield Finding(
        "max-model-len-too-high", Severity.WARNING,
        f"--max-model-len {mml:.0f} is {mml / need:.1f}x the typical context ({need} tokens)",
        "the scheduler reserves room for the longest allowed request, starving concurrency "
        "for the requests you actually get",
        f"set --max-model-len near the p95-p99 of real traffic, e.g. {need}",
    )


@rule("max-model-len-traffic-unknown", "a very long --max-model-len, the traffic's lengths "
      "not given", reads=("--typical-context", "--model-config"))
def max_model_len_traffic_unknown(cmd: ServeCommand, opts: AuditOptions) -> Iterator[Finding]:
    # The operator's guide (seed 000): "--max-model-len is 200k but typical requests are 8k,
    # the scheduler reserves capacity for 200k ... Tune --max-model-len to the 95th or 99th
    # percentile of real traffic". max-model-len-too-high judges it once the p95-p99 is known.
    if opts.typical_context_tokens is not None:
        return
    mml, said = cmd.number("--max-model-len"), ""
    if mml is None and not cmd.has("--max-model-len") and cmd.model_config is not None:
        mml = parse_model_config(cmd.model_config).max_position_embeddings
        said = " (no --max-model-len: vLLM takes the model's maximum)"
    if mml is None or mml < _TRAFFIC_UNKNOWN:
        return
    yield Finding(
        "max-model-len-traffic-unknown", Severity.INFO,
        f"--max-model-len {mml:.0f}{said}, and the context lengths of real traffic are not given",
        "the scheduler reserves room for the longest allowed request: when typical requests "
        "are far shorter (the operator's guide: 200k allowed, 8k typical) concurrency is "
        "starved for the requests you actually get",
        "size --max-model-len to the p95-p99 context length of real traffic, not the model's "
        "maximum; pass --typical-context TOKENS (that p95-p99) and the audit compares the two",
    )


@rule("block-size-long-context", "--block-size advice for very long or short contexts")
def block_size(cmd: ServeCommand, _: AuditOptions) -> Iterator[Finding]:
    mml, bs = cmd.number("--max-model-len"), cmd.number("--block-size") or 16
    if mml is None:
        return
    if mml >= _LONG_CONTEXT and bs < 32:
        yield Finding(
            "block-size-long-context", Severity.INFO,
            f"--max-model-len {mml:.0f} with block size {bs:g}",
            "larger KV blocks cut internal fragmentation; a measurable win past ~128k tokens",
            "add --block-size 32",
        )
    elif mml < _SHORT_CONTEXT and bs >= 32:
        yield Finding(
            "block-size-long-context", Severity.INFO,
            f"--block-size {bs:g} with --max-model-len {mml:.0f}",
            "below ~32k tokens larger blocks are neutral or a slight loss (coarser prefix hits)",
            "drop --block-size (default 16) unless measured otherwise",
        )


@rule("no-max-num-batched-tokens", "long prompts with chunked prefill off and no step cap",
      reads=("--gpu",))
def no_batched_tokens_cap(cmd: ServeCommand, opts: AuditOptions) -> Iterator[Finding]:
    # With chunked prefill on (vLLM's default since the V1 engine, and for contexts over 32k
    # before it) the step is already capped by vLLM's default max_num_batched_tokens: 8192
    # on H100/H200-class GPUs, 2048 on smaller ones, 16384 on >= 160 GiB (issue 14: so a long
    # --max-model-len alone is no finding). Only with chunked prefill off does vLLM
    # raise the cap to max_model_len, so one long prompt is prefilled in one huge step.
    mml = cmd.number("--max-model-len")
    if mml is None or mml < _LONG_PROMPTS or cmd.has("--max-num-batched-tokens"):
        return
    if not _chunked_prefill_off(cmd):
        return
    default = vllm_default_batched_tokens(opts.gpu)
    yield Finding(
        "no-max-num-batched-tokens", Severity.WARNING,
        f"--max-model-len {mml:.0f} with chunked prefill off and no --max-num-batched-tokens",
        f"without chunked prefill vLLM raises the step cap from its default ({default} on "
        f"{opts.gpu.name}) to max_model_len: a burst of long prompts is prefilled in huge "
        "steps that starve decode and spike tail TTFT",
        "turn chunked prefill back on (drop --no-enable-chunked-prefill) or add "
        "--max-num-batched-tokens 8192 (4096-8192 on H100/H200-class GPUs)",
    )


def vllm_default_batched_tokens(gpu: GpuProfile) -> int:
    """vLLM's default max_num_batched_tokens for `vllm serve` on `gpu` (arg_utils.py,
    get_batch_defaults, v0.32)."""
    if gpu.pcie_gen == 0:  # the CPU backend
        return 2048
    if gpu.hbm_bytes >= 160 * _GIB:
        return 16384
    if gpu.hbm_bytes >= 70 * _GIB and "a100" not in gpu.name.lower():
        return 8192
    return 2048


def _chunked_prefill_off(cmd: ServeCommand) -> bool:
    value = str(cmd.value("--enable-chunked-prefill")).lower()
    return cmd.has("--no-enable-chunked-prefill") or value in ("false", "0", "no")
