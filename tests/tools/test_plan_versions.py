"""vLLM version parsing and the hybrid-manager decision table."""

from __future__ import annotations

import pytest

from kvtier.errors import ConfigError
from kvtier.tools.ops.vllm_versions import hma_verdict, parse_version


@pytest.mark.parametrize("text, version", [
    ("0.21.0", (0, 21, 0)), ("v0.20.2", (0, 20, 2)), ("0.11.1rc2", (0, 11, 1)),
    ("0.19.0+cu130", (0, 19, 0)), ("0.14", (0, 14, 0)),
])
def test_parse_version(text, version):
    assert parse_version(text) == version


def test_parse_version_rejects_garbage():
    with pytest.raises(ConfigError):
        parse_version("latest")


@pytest.mark.parametrize("version, connector, hybrid, required", [
    ((0, 17, 0), "OffloadingConnector", False, False),  # HMA not default yet
    ((0, 18, 0), "OffloadingConnector", False, True),
    ((0, 20, 2), "OffloadingConnector", True, True),
    ((0, 21, 0), "OffloadingConnector", True, False),  # native + HMA since v0.21.0
    ((0, 21, 0), "LMCacheConnectorV1", False, True),
    ((0, 21, 0), "LMCacheConnectorV1", True, True),
    ((0, 21, 0), "KVTierConnector", False, False),  # SupportsHMA
    ((0, 21, 0), "KVTierConnector", True, False),
    (None, "OffloadingConnector", False, None),
])
def test_hma_verdict(version, connector, hybrid, required):
    assert hma_verdict(version, connector, hybrid).required is required
