"""kvtier node: one cache per node, shared by its engines, surviving their restarts, off their
interpreter.

  server.py    `NodeServer`: the tier stack per KV layout, its RAM slab in shared memory,
               one thread per engine connection, what each request does to the stores
  config.py    `NodeConfig`: the node's settings, validated once (the tools read it too)
  layouts.py   the layouts it serves, each built at its first engine's Hello
               (`ServedLayouts`): its tiers opened, started, its RAM slab recovered
  leasebook.py  `LeaseBook`: the engines' connections and their leases, which end with
               the connection, a Release, the lease timeout or a quarantine
  leases.py    what a lease holds (a lending, or `Puts`: reserved slots) and how one ends
  connection.py  the listening socket and a connection's requests, dispatched in order
  hostfiles.py   the node's name lock and slabs in /dev/shm, its socket's file
  counters.py  `NodeCounters`: the node's own counters
  client.py    `NodeStore` (the connector's store in node mode), `NodeProbe` (its lookups)
  hangups.py   the node's hang-ups of an engine's idle connections, watched by one thread
               (a restarted node's old slab let go though the engine asks nothing)
  stream.py    a Borrow's reply read in parts as the node's reads land (`LentStream`)
  protocol.py  the control messages (msgspec), one round trip per load or step of stores
  links.py     `NodeLinks`: the links of its tiers below RAM, measured by the node (the
               engines' prior for a load from below its RAM)
  events.py    `NodeEvents`: the tiers' KV events for routers, once for the node's engines
               (`--events-endpoint`), in vLLM's wire format (eventwire.py, without vLLM)
  descriptions.py  a model's chunks' token ids for those events, kept while a tier holds
               the chunk
  metrics.py   `NodeCollector`: the node's own Prometheus metrics (kvtier_node_*), read at
               each scrape of `kvtier node serve --metrics-port`

The node imports the cache (core, tiers), never vLLM: engines reach it through the connector
(`"node": SOCKET` in kv_connector_extra_config).
"""
