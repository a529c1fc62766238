"""kvtier: a tiered, content-addressed KV cache for LLM serving.

KV blocks live in a hierarchy of tiers (host RAM -> local disk -> shared storage) and are
handed back to the inference engine on a cache hit. See docs/architecture.md.
"""

__version__ = "0.1.0"
