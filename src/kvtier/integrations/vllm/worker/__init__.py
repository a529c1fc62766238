"""The connector's worker side, in each vLLM worker process: moving KV bytes between vLLM's
paged KV cache and kvtier's store.

`connector_worker.ConnectorWorker` answers vLLM's worker hooks; it runs a mover per device
kind (`mover.ChunkMover`): `cpu` (host memory: vLLM's CPU backend) and `streams` (a device,
ordered by streams and events through the `device` protocol), over `paged` (vLLM's paged KV
seen as chunks) and the store as `chunkstore` describes it.

It imports nothing of `scheduler/`: the two sides share only the messages between them
(`..messages`, `..transfers`) and the engine's description (`..groups`, `..kvformat`,
`..metrics`). The movers, `paged` and `device` import no vLLM (scripts/gpu-check.sh runs them
where vLLM is not installed).
"""
