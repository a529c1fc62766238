"""kvtier's vLLM plugin: `KVTierConnector` by name, with no `kv_connector_module_path`.

vLLM runs every `vllm.general_plugins` entry point in each of its processes (API server,
engine core, workers) before it builds a connector; pyproject.toml declares `register` as
kvtier's, so after `pip install kvtier` the config
    {"kv_connector": "KVTierConnector", "kv_role": "kv_both", "kv_connector_extra_config": ...}
finds the connector in vLLM's own registry. The module path keeps working. Registering only
names the module: vllm and torch are imported when vLLM builds the connector, not here.

Primitives: `register`.
"""

from __future__ import annotations

import contextlib

from kvtier.integrations.vllm.config import CONNECTOR_CLASS, CONNECTOR_MODULE


def register() -> None:
    """Add KVTierConnector to vLLM's connector registry (safe to call more than once:
    vLLM may load plugins again in a process)."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    # ValueError: "already registered", by an earlier call in this process.
    with contextlib.suppress(ValueError):
        KVConnectorFactory.register_connector(CONNECTOR_CLASS, CONNECTOR_MODULE, CONNECTOR_CLASS)
