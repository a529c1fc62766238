"""The scheduler looks up chunks in the namespace its workers store them in, in a real vLLM (CPU
backend) with kvtier.

The namespace is named by the model's fingerprint (core/fingerprint.py), which both sides
compute from vLLM's copy of the model's config. vLLM's model code edits that config as a worker
builds the model (PaliGemma's text_config.architectures, TeleChat2's hidden_act, ...), in the
worker's copy only: a tensor-parallel engine's scheduler, which builds no model, fingerprinted
the config unedited, its probes named another namespace than the workers' tiers, and after a
restart no prompt stored before was ever a hit. The workers now tell the scheduler their
fingerprint as the engine starts (vLLM's connector handshake) and it takes theirs.

The fault, injected: the engine's core runs in this process (one copy of the config), so the
test edits a KV-relevant key of the config after the worker registered its KV caches and
before the scheduler side is built (vLLM builds them in that order): the scheduler then
fingerprints another config than the worker's, as the scheduler of a tensor-parallel engine
does. The model is built by then, so its KV is unchanged.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from vllm_harness import (
    kvtier_transfer_config,
    metric,
    random_prompts,
    settle,
    start_engine,
    token_ids,
)

from kvtier.integrations.vllm.connector import KVTierConnector

pytestmark = pytest.mark.vllm

PROMPTS = random_prompts([300, 260], seed=47)


def test_a_restart_finds_what_the_workers_stored(tiny_model_dir: Path, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Engine A stores the prompts to a disk tier and stops; engine B, the same, serves them
    from it. Within one engine the scheduler's index (what the workers report stored) finds
    them whatever the namespace; after a restart only its probes of the tier can."""
    register = KVTierConnector.register_kv_caches

    def register_then_edit(self: KVTierConnector, kv_caches: Any) -> None:
        register(self, kv_caches)
        config = self._vllm_config.model_config.hf_config
        config.rms_norm_eps = config.rms_norm_eps * 2  # a key the fingerprint reads

    monkeypatch.setattr(KVTierConnector, "register_kv_caches", register_then_edit)
    root = tmp_path / "disk"
    transfer = kvtier_transfer_config([{"kind": "disk", "path": str(root),
                                        "capacity": "64MiB"}], 64)
    with start_engine(tiny_model_dir, transfer) as llm:
        first = token_ids(llm, PROMPTS)
        settle([root])
    with start_engine(tiny_model_dir, transfer) as llm:
        again = token_ids(llm, PROMPTS)
        hits = metric(llm, "vllm:external_prefix_cache_hits")
    assert hits > 0, "the scheduler looked up another namespace than the workers stored in"
    assert again == first
