"""Audit rules about `--block-size` against the kernel blocks of vLLM's CUDA attention
backends (vLLM 0.33; the table and the source it comes from: kvtier.tools.ops.attention_kernels).

Primitives: `named_backend(cmd)`, `attention_choice(cmd, options)` (what vLLM picks for this
command line, shared with the offload block-size rule), and the rules
`block-size-kernel-split` and `block-size-no-kernel`.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

from kvtier.tools.ops.attention_kernels import (
    BLOCK_OUTERMOST_LAYOUTS,
    CUDA_BACKENDS,
    BackendChoice,
    choose_backend,
)
from kvtier.tools.ops.audit.command import ServeCommand
from kvtier.tools.ops.audit.finding import Finding, Severity
from kvtier.tools.ops.audit.registry import AuditOptions, model_traits, on_cpu_backend, rule
from kvtier.tools.ops.vllm_versions import V033

_SPLIT, _NO_KERNEL = "block-size-kernel-split", "block-size-no-kernel"


def named_backend(cmd: ServeCommand) -> str | None:
    """The backend the operator named: `--attention-backend`, or `backend` in
    `--attention-config` (JSON or the dotted flag); None for vLLM's choice."""
    named = cmd.value("--attention-backend") or cmd.value("--attention-config.backend")
    raw = cmd.value("--attention-config")
    if not named and raw:
        try:
            cfg = json.loads(raw)
        except (json.JSONDecodeError, RecursionError):
            cfg = None
        named = cfg.get("backend") if isinstance(cfg, dict) else None
    return str(named) if named else None


def attention_choice(cmd: ServeCommand, options: AuditOptions) -> BackendChoice | None:
    """The attention backend vLLM 0.33 uses for `cmd` on `options.gpu` and its kernel block;
    None off CUDA, for a malformed `--block-size` (`malformed-flag-value` reports it), or
    where the choice is not modelled (kvtier.tools.ops.attention_kernels.choose_backend)."""
    if on_cpu_backend(cmd, options):
        return None
    raw = (cmd.value("--block-size") or "").strip()
    if cmd.has("--block-size") and not (raw.isdigit() and int(raw) > 0):
        return None
    kv_dtype = (cmd.value("--kv-cache-dtype") or "auto").strip().lower()
    return choose_backend(options.gpu.sm_major, model_traits(cmd).mla, kv_dtype,
                          int(raw) if raw else None, named_backend(cmd))


def _applies(cmd: ServeCommand) -> bool:
    """The table is vLLM 0.33's: judge that release or an unknown one, and only a
    `--block-size` the operator set (vLLM's own default is always a size the kernel takes)."""
    version = cmd.vllm_version
    return cmd.has("--block-size") and (version is None or version >= V033)


def _who(choice: BackendChoice, cmd: ServeCommand, options: AuditOptions) -> str:
    assert choice.backend is not None
    if choice.named:
        return f"--attention-backend {choice.backend.name}"
    guess = " (MLA guessed from the model's name)" if model_traits(cmd).mla and \
        cmd.model_config is None else ""
    return f"{choice.backend.name}, the backend vLLM picks on {options.gpu.name}{guess},"


@rule(_SPLIT, "--block-size above the attention kernel's block: split, or refused with a "
      "block-outermost KV layout", reads=("--gpu", "--model-config"))
def kernel_split(cmd: ServeCommand, options: AuditOptions) -> Iterator[Finding]:
    choice = attention_choice(cmd, options) if _applies(cmd) else None
    if choice is None or choice.backend is None or choice.splits <= 1:
        return
    block, kernel, n = choice.block_size, choice.kernel_block, choice.splits
    name, takes = choice.backend.name, choice.backend.describe()
    who = _who(choice, cmd, options)
    layout = cmd.env.get("VLLM_KV_CACHE_LAYOUT", "").strip().upper()
    if layout in BLOCK_OUTERMOST_LAYOUTS:
        yield Finding(
            _SPLIT, Severity.ERROR,
            f"--block-size {block} with VLLM_KV_CACHE_LAYOUT={layout}: {who} takes kernel "
            f"blocks of {takes} tokens, so each block must be split into {n} of {kernel}",
            "a block-outermost layout puts the other layers' pages between a block's kernel "
            f"blocks; vLLM 0.33 refuses at start-up: '{name} needs {kernel}-token kernel "
            f"blocks, which packed {block}-token KV cache blocks cannot be split into'",
            f"reduce --block-size to {kernel}, or set VLLM_KV_CACHE_LAYOUT to a layer-compact "
            "layout (e.g. LBNHC), as vLLM's error says",
        )
        return
    yield Finding(
        _SPLIT, Severity.INFO,
        f"--block-size {block} is above the largest kernel block {who} takes ({takes}): vLLM "
        f"splits each block into {n} kernel blocks of {kernel} tokens",
        f"it works: the KV manager, prefix caching and offload keep {block}-token blocks and "
        f"the kernel reads {kernel}-token ones ({n}x wider block tables); with a "
        "block-outermost VLLM_KV_CACHE_LAYOUT (BLHNC, BLNHC, BHLNC) vLLM would refuse to start",
        f"keep it if {block}-token blocks are wanted for the cache (fewer, larger offload "
        f"blocks); else --block-size {kernel} is what the kernel reads",
    )


@rule(_NO_KERNEL, "--block-size no attention kernel takes, or one that rules out the "
      "fastest backend", reads=("--gpu", "--model-config"))
def no_kernel(cmd: ServeCommand, options: AuditOptions) -> Iterator[Finding]:
    choice = attention_choice(cmd, options) if _applies(cmd) else None
    if choice is None or choice.dtype_refused:  # the dtype, not the block: not this rule's
        return
    block, backend = choice.block_size, choice.backend
    if backend is None:
        kind = "MLA" if model_traits(cmd).mla else "attention"
        takes = "; ".join(f"{n}: {CUDA_BACKENDS[n].describe()}" for n in choice.precluded)
        yield Finding(
            _NO_KERNEL, Severity.ERROR,
            f"--block-size {block}: no {kind} backend vLLM has on {options.gpu.name} takes it "
            f"({takes})",
            "vLLM refuses to start ('No valid attention backend found ... block_size not "
            "supported')",
            "drop --block-size (vLLM then uses 16, or the size its kernel needs) or use a "
            "multiple of 16",
        )
    elif choice.kernel_block is None:
        yield Finding(
            _NO_KERNEL, Severity.ERROR,
            f"--attention-backend {backend.name} with --block-size {block}: it takes kernel "
            f"blocks of {backend.describe()} tokens",
            "vLLM refuses the backend the operator named ('block_size not supported')",
            f"use a block size {backend.name} takes (e.g. {backend.preferred_block()}), or "
            "drop --attention-backend",
        )
    elif choice.precluded:
        first = CUDA_BACKENDS[choice.precluded[0]]
        yield Finding(
            _NO_KERNEL, Severity.WARNING,
            f"--block-size {block} rules out {', '.join(choice.precluded)} on "
            f"{options.gpu.name}: vLLM falls back to {backend.name}",
            f"vLLM logs '--block-size {block} precluded higher-priority backend(s) ... which "
            "may result in reduced performance'",
            f"drop --block-size (vLLM then uses {first.name} at {first.preferred_block()}), "
            f"or use a size {first.name} takes ({first.describe()})",
        )
