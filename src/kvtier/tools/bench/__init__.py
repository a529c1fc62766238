"""The engines of the `kvtier bench` commands (one module a command, with the helpers only it
uses: `codecs_*`, `subjects`, `*_baseline`), over the serving harness (`serving/`: workloads
against an OpenAI endpoint, their records and reports) and the emulators of hardware this
machine lacks (`emulators/`: a slow network, a remote redis, a slow filesystem). The commands'
argument parsing lives in `kvtier.tools.cli` (bench_*.py).
"""
