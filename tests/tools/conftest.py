"""Fixtures for the tools' engine tests (marked `vllm`: `kvtier serve`'s OpenAI servers, the
disagg proxy, warm-up, inspect and gc over an engine's tiers); their helpers in serverkit.py
and tests/engine/vllm_harness.py.

Primitives: `tiny_model_dir` (session): the "test" preset model, generated once.
"""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The generated "test" model (random weights, decisive logits), as tests/engine has it."""
    from kvtier.testing.tinymodel import make_preset_model  # torch: only the engine tests'

    return make_preset_model("test", tmp_path_factory.mktemp("models"))
