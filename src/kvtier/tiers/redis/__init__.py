"""The redis tier (Redis or Valkey, standalone or Cluster): `tier` (RedisTier), its config,
client, index of hits, writes, deletes owed after a fault, inventory and namespace
manifest.

Modules import redis-py as `redis` (absolute imports): this package's name never shadows it.
"""
