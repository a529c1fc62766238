"""Importing the connector (what vLLM does) loads none of the operator tools' dependencies
(pyproject's `tools` extra) and no kvtier.tools module: the other half of
tests/cache/test_package_border.py, here because it imports vLLM."""

from __future__ import annotations

from tierkit import run_probe, tools_dependencies


def test_importing_the_connector_loads_none_of_thetools_dependencies() -> None:
    """vLLM itself imports aiohttp: what counts is what kvtier adds after the vLLM modules
    the connector needs are loaded."""
    probe = (
        "import json, sys\n"
        "import vllm.distributed.kv_transfer.kv_connector.v1.base\n"
        "import vllm.v1.metrics.cache_hit_source\n"
        "before = set(sys.modules)\n"
        "import kvtier.integrations.vllm.connector, kvtier.integrations.vllm.plugin\n"
        "print(json.dumps(sorted(set(sys.modules) - before)))\n"
    )
    added = run_probe(probe)
    assert "kvtier.integrations.vllm.connector" in added  # the probe really ran
    roots = {name.split(".")[0] for name in added}
    assert roots.isdisjoint(tools_dependencies()), sorted(roots & set(tools_dependencies()))
    assert not [m for m in added if m.startswith("kvtier.tools")]
