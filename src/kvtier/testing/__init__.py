"""What kvtier is tested against, importable without the operator tools' dependencies: the
generated models (`tinymodel`), offline vLLM engines on the CPU backend (`engines`), vLLM 0.33's
KV cache views built by its own rules without vLLM (`vllmviews`) and a CPU stand-in for a GPU
under the device mover (`standin`), and a slow network on loopback (`netem`: a delaying,
bandwidth-capped TCP proxy). The cache's tests import these, never `kvtier.tools`; the
benchmarks use them too. The cache itself imports nothing of them
(tests/cache/test_package_border.py).
"""
