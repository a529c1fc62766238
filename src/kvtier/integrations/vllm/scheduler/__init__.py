"""The connector's scheduler side, in vLLM's engine-core process: what to load and what to
store, decided per step without touching KV bytes or blocking on I/O.

`connector_scheduler.ConnectorScheduler` answers vLLM's scheduler hooks; its collaborators
each own a part of the decision: `requeststate` (each request's keys and blocks, with
`request_keys`, and `plannedkeys`: key -> the requests that have it), `loadplan` (how much of
a hit to load, inline or not: `offer`, `loadcost`, `stepcost`, `holders`), `storeplan` (what
each step stores), `loadfailures` (what keeps a failed load out of the cache), `losthits` (why
found tokens were not loaded), `statelayers` (hit ends of models with state layers) and
`routerevents` (KV events for routers, from `events`).

It imports nothing of `worker/`: the two sides share only the messages between them
(`..messages`, `..transfers`) and the engine's description (`..config`, `..groups`,
`..metrics`). tests/cache/test_package_border.py checks it.
"""
