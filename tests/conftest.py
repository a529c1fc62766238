"""Fixtures shared by the core's tests; the helpers themselves live in tests/tierkit.py."""

from __future__ import annotations

import pytest

from kvtier.core.layout import KVLayout
from tierkit import tiny_layout


@pytest.fixture
def layout() -> KVLayout:
    """A 4 KiB-chunk layout (see tierkit.tiny_layout)."""
    return tiny_layout()
