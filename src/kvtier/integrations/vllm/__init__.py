"""kvtier inside vLLM: the KV connector. The only kvtier package that imports vllm.

Modules: `connector` (the KVConnectorBase_V1 shell), `scheduler` (what to load and store),
`worker` (moving bytes between vLLM's paged KV and chunk buffers), `config` (the connector's
settings schema: parsing kv_connector_extra_config), `resets` (vLLM's cache reset once the
blocks kvtier keeps for ended requests' stores are released: `reset_prefix_cache`,
`release_held_blocks`, for RL loops).

`KVTierConnector` is imported on first use (PEP 562 `__getattr__`): vLLM finds it with
`kv_connector_module_path: "kvtier.integrations.vllm"` and getattr, while importing
`kvtier.integrations.vllm.config` (the CLI, the benches) loads neither vllm nor torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvtier.integrations.vllm.connector import KVTierConnector

from kvtier.integrations.vllm.resets import release_held_blocks, reset_prefix_cache

__all__ = ["KVTierConnector", "release_held_blocks", "reset_prefix_cache"]


def __getattr__(name: str) -> Any:
    if name == "KVTierConnector":
        from kvtier.integrations.vllm.connector import KVTierConnector

        return KVTierConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
