"""The GPU tests' device (gpurig.Backend): a real CUDA device (skipped without one) or the CPU
stand-in, so that every test body also runs in CI."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from gpurig import BACKENDS, Backend


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> Iterator[Backend]:
    """A fresh device of each kind; at the end, what the stand-in's streams raised is raised."""
    device = Backend(request.param)
    yield device
    device.close()
