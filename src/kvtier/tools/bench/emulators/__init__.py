"""What the benchmarks stand in for hardware this machine lacks: a slow network on loopback
(`netem`: a delaying, bandwidth-capped TCP proxy), a redis-server across it (`remote_redis`)
and a slow network filesystem (`fslatency`: an LD_PRELOAD shim adding latency to metadata
calls).
"""
