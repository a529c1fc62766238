"""kvtier inside vLLM: the KV connector. The only kvtier package that imports vllm.

Modules: `connector` (the KVConnectorBase_V1 shell), `scheduler` (what to load and store),
`worker` (moving bytes between vLLM's paged KV and chunk buffers), `config` (parsing
kv_connector_extra_config).
"""

from kvtier.integrations.vllm.connector import KVTierConnector

__all__ = ["KVTierConnector"]
