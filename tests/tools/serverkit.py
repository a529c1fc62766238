"""Helpers for the tools' engine tests: vLLM OpenAI servers started as `kvtier serve` starts
them (kvtier.tools.ops.serving and .server), with the engine tests' small settings
(tests/engine/vllm_harness.py), and their HTTP API. (Not named conftest.py: imported by name.)

Primitives:
  - `server_command(model_dir, extra)`: a kvtier OpenAI server's command, tests' settings.
  - `post(url, body)`, `complete(server, prompt)`, `scrape(server, name)`: a server's
    /v1/completions, /reset_prefix_cache and /metrics.
  - `vllm_processes_on(port)`: the vLLM processes still serving a port (none, once stopped).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import sys
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "engine"))  # vllm_harness

from vllm_harness import BLOCK_SIZE, MAX_MODEL_LEN, NUM_BLOCKS

from kvtier.tools.ops.server import free_port
from kvtier.tools.ops.serving import ServeCommand, ServeConfig, build_command

RESERVED = "VLLM_CPU_NUM_OF_RESERVED_CPU"  # cores vLLM's CPU worker leaves to the others


def server_command(model_dir: Path, extra: dict[str, Any], *, kv_role: str = "kv_both",
                   memory_utilization: float = 0.3,
                   served_model_name: tuple[str, ...] = ()) -> ServeCommand:
    """The `kvtier serve` command of an OpenAI server with kvtier's `extra` config and the
    tests' small settings; dev mode on (its /reset_prefix_cache endpoint empties vLLM's own
    cache). `memory_utilization`: the share of the NUMA node's memory vLLM checks is free at
    start-up (lower it to run two servers at once). `served_model_name`: vLLM's
    --served-model-name (default: the directory).

    The model runner runs in the engine core's process (VLLM_ENABLE_V1_MULTIPROCESSING=0:
    vLLM's "uni" executor, as tests/engine's in-process engines have it): one process fewer
    to import vLLM in, 5-10 s of each start. `kvtier serve` itself keeps vLLM's own worker
    process, which the cases here do not look into (the tests of `kvtier serve`'s processes
    start it as users do: test_bench_serve.py, test_demo*.py)."""
    command = build_command(ServeConfig(
        model=str(model_dir), extra_config=extra, port=free_port(), cpu=True, kv_role=kv_role,
        served_model_name=served_model_name,
        vllm_args=("--block-size", str(BLOCK_SIZE), "--num-gpu-blocks-override",
                   str(NUM_BLOCKS), "--gpu-memory-utilization", str(memory_utilization),
                   "--max-model-len", str(MAX_MODEL_LEN), "--enforce-eager", "--seed", "0")))
    # The model runner's threads as vLLM's worker process binds them (its cores, less those
    # reserved): more threads round a prefill differently with its batch's shape.
    reserved = int(command.env.get(RESERVED, os.environ.get(RESERVED, "1")))
    threads = max(1, len(os.sched_getaffinity(0)) - reserved)
    return dataclasses.replace(command, env={**command.env, "VLLM_SERVER_DEV_MODE": "1",
                                             "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                                             "OMP_NUM_THREADS": str(threads)})


def post(url: str, body: dict[str, Any] | None = None, timeout_s: float = 300) -> Any:
    """POST `body` as JSON (or nothing); the decoded JSON reply, or its text."""
    data = json.dumps(body).encode() if body is not None else b""
    request = urllib.request.Request(url, data=data, method="POST",
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        text = response.read().decode()
    return json.loads(text) if text.strip().startswith("{") else text


def complete(server: Any, prompt: list[int], *, model: str | None = None, max_tokens: int = 16,
             **extra: Any) -> str:
    """Greedy completion of a prompt given as token ids; the generated text. `model`
    defaults to the one on the server's command line."""
    if model is None:
        model = server.command.argv[server.command.argv.index("--model") + 1]
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, **extra}
    return str(post(server.url + "/v1/completions", body)["choices"][0]["text"])


def scrape(server: Any, name: str) -> float:
    """A counter from the server's /metrics, summed over its label sets (0 if absent)."""
    with urllib.request.urlopen(server.url + "/metrics", timeout=60) as response:
        text = response.read().decode()
    pattern = re.compile(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.e+-]+)$", re.MULTILINE)
    return sum(float(v) for v in pattern.findall(text))


def vllm_processes_on(port: int) -> list[int]:
    """Pids whose command line serves `port`."""
    needle = f"--port\0{port}\0".encode()
    pids = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            data = cmdline.read_bytes()
        except OSError:
            continue
        if needle in data and b"vllm" in data:
            pids.append(int(cmdline.parent.name))
    return pids
