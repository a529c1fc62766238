"""The audit rule registry and the audit run.

Primitives:
    AuditOptions           -- what the audit knows beyond the command (GPU, typical context)
    Rule, rule(id, summary, needs=..., reads=...) -- register a check:
                              `(cmd, options) -> Iterable[Finding]`
    all_rules()            -- every registered rule (rule modules are imported on first use)
    run_audit(cmd, options) -> list[Finding], most severe first
    model_traits(cmd)      -- what the audit can tell about the served model
    on_cpu_backend(cmd, options) -- the server runs on vLLM's CPU backend, not CUDA
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from kvtier.tools.ops.audit.command import ServeCommand
from kvtier.tools.ops.audit.finding import Finding
from kvtier.tools.ops.hardware import GPU_PROFILES, GpuProfile
from kvtier.tools.ops.modelspec import parse_model_config

# One line per rule module; each registers its rules with @rule when imported.
RULE_MODULES: tuple[str, ...] = (
    "kvtier.tools.ops.audit.rules_arguments",
    "kvtier.tools.ops.audit.rules_input",
    "kvtier.tools.ops.audit.rules_state",
    "kvtier.tools.ops.audit.rules_offload",
    "kvtier.tools.ops.audit.rules_native",
    "kvtier.tools.ops.audit.rules_lmcache",
    "kvtier.tools.ops.audit.rules_kvcache",
    "kvtier.tools.ops.audit.rules_kernels",
    "kvtier.tools.ops.audit.rules_env",
    "kvtier.tools.ops.audit.rules_versions",
    "kvtier.tools.ops.audit.rules_sleep",
)
# Model names whose layers mix attention kinds (sliding+full, linear/Mamba+full).
_HYBRID_NAME = re.compile(
    r"qwen3[._-]?[56]|qwen3-next|gemma-?[234]|gpt-oss|jamba|nemotron-h|granite-4|mamba|"
    r"falcon-h1|minimax|zamba|bamba|plamo|lfm2", re.IGNORECASE)
# Of those, the names whose models hold Mamba / linear-attention state.
_LINEAR_NAME = re.compile(
    r"qwen3[._-]?[56]|qwen3-next|jamba|nemotron-h|granite-4|mamba|falcon-h1|minimax|zamba|"
    r"bamba|plamo|lfm2", re.IGNORECASE)
# Of those, the state family (statesize.StateFamily) a name tells; first match wins.
_FAMILY_NAMES = (
    ("gdn", re.compile(r"qwen3[._-]?[56]|qwen3-next", re.IGNORECASE)),
    ("short_conv", re.compile(r"lfm2", re.IGNORECASE)),
    ("mamba2", re.compile(r"nemotron-h|granite-4|falcon-h1|zamba|bamba|mamba-?2|mamba-codestral",
                          re.IGNORECASE)),
    ("mamba1", re.compile(r"jamba|mamba", re.IGNORECASE)),
)
# Model names whose models use MLA (DeepSeek-V2/V3/R1, Kimi K2); not the R1 distills.
_MLA_NAME = re.compile(r"deepseek[-_]?(v2|v3|r1)(?!.*distill)|kimi[-_]?k2", re.IGNORECASE)
# Variables only vLLM's CPU backend reads: their presence says the server runs on CPUs.
CPU_BACKEND_ENV = ("VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND",
                   "VLLM_CPU_NUM_OF_RESERVED_CPU")


@dataclass(frozen=True, slots=True)
class AuditOptions:
    """Context the command line does not carry."""

    gpu: GpuProfile = GPU_PROFILES["h100"]  # the GPU the server runs on
    typical_context_tokens: int | None = None  # p95/p99 prompt+output length of real traffic


CheckFn = Callable[[ServeCommand, AuditOptions], Iterable[Finding]]


@dataclass(frozen=True, slots=True)
class Rule:
    """One registered check."""

    id: str  # stable id, shown in findings and usable in CI allow-lists
    summary: str  # one line: the pitfall it catches
    check: CheckFn
    # `kvtier audit` options without which the rule never fires, e.g. ("--typical-context",)
    needs: tuple[str, ...] = ()
    # options the rule reads when given and otherwise guesses (e.g. from the model's name)
    reads: tuple[str, ...] = ()


_RULES: dict[str, Rule] = {}


def rule(rule_id: str, summary: str, needs: tuple[str, ...] = (),
         reads: tuple[str, ...] = ()) -> Callable[[CheckFn], CheckFn]:
    """Register the decorated function as rule `rule_id` (see `Rule` for `needs`/`reads`)."""

    def register(fn: CheckFn) -> CheckFn:
        if rule_id in _RULES:
            raise ValueError(f"audit rule {rule_id!r} registered twice")
        _RULES[rule_id] = Rule(rule_id, summary, fn, needs, reads)
        return fn

    return register


def all_rules() -> tuple[Rule, ...]:
    """Every rule, in registration order."""
    for name in RULE_MODULES:
        importlib.import_module(name)
    return tuple(_RULES.values())


def run_audit(cmd: ServeCommand, options: AuditOptions | None = None) -> list[Finding]:
    """Run every rule on `cmd`; findings sorted most severe first, then by rule order."""
    opts = options or AuditOptions()
    findings = [f for r in all_rules() for f in r.check(cmd, opts)]
    return sorted(findings, key=lambda f: -f.severity)


@dataclass(frozen=True, slots=True)
class ModelTraits:
    """What the audit can tell about the served model."""

    hybrid: bool  # mixes attention kinds: the hybrid-manager and LMCache pitfalls apply
    known: bool  # True when read from config.json, False when guessed from the name
    linear: bool = False  # has Mamba / linear-attention layers (state, not per-token KV)
    mla: bool = False  # DeepSeek-style latent attention: vLLM picks MLA kernels
    # "gdn", "short_conv", "mamba2" or "mamba1" (statesize.py); None: no state layers, or
    # state layers of no known family (MiniMax, PLaMo)
    state_family: str | None = None


def model_traits(cmd: ServeCommand) -> ModelTraits:
    """Hybrid or not: from `cmd.model_config` when given, else from the model's name."""
    if cmd.model_config is not None:
        spec = parse_model_config(cmd.model_config)
        linear = spec.state_layers > 0
        # Llama 4's chunked layers: vLLM turns the hybrid manager off for them by itself, so
        # a connector sees one full-attention group (modelspec.ModelSpec.chunked_attention)
        return ModelTraits(hybrid=spec.hybrid and not spec.chunked_attention, known=True,
                           linear=linear,
                           mla=spec.mla is not None,
                           state_family=spec.state.family if linear and spec.state else None)
    name = cmd.model or ""
    linear = bool(_LINEAR_NAME.search(name))
    family = next((f for f, pattern in _FAMILY_NAMES if pattern.search(name)), None)
    return ModelTraits(hybrid=bool(_HYBRID_NAME.search(name)), known=False, linear=linear,
                       mla=bool(_MLA_NAME.search(name)), state_family=family if linear else None)


def on_cpu_backend(cmd: ServeCommand, options: AuditOptions) -> bool:
    """The server runs on vLLM's CPU backend: `--gpu cpu`, or an environment only the CPU
    backend reads."""
    return options.gpu.pcie_gen == 0 or any(name in cmd.env for name in CPU_BACKEND_ENV) or (
        cmd.env.get("VLLM_TARGET_DEVICE", "").lower() == "cpu")
