"""The redis tier (Redis or Valkey, standalone or Cluster): `tier` (RedisTier), its config,
client, chunk names, reads, writes, index of hits, deletes owed after a fault, inventory and
namespace manifest.

Modules import redis-py as `redis` (absolute imports): this package's name never shadows it.
"""
