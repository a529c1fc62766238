"""What the benchmarks stand in for hardware this machine lacks: a slow network on loopback
(kvtier.testing.netem: a delaying, bandwidth-capped TCP proxy, which the cache's engine tests
use too), a redis-server across it (`remote_redis`)
and a slow network filesystem (`fslatency`: an LD_PRELOAD shim adding latency to metadata
calls).
"""
