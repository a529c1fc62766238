"""Two real engines on one `kvtier node`, as the node drills need them: engine 1 in a process
of its own (node_engine.py, driven over a pipe: the one a test holds, freezes or kills),
engine 2 in the test's process. Both in node mode with the same settings, so that their
tokens compare exactly. (Not a test: imported by name by test_node_failures.py and
test_node_lease_expiry_e2e.py.)

Primitives: `Engine1`, `engine_pair`, `ENGINE_SETTINGS`, `MAX_TOKENS`, `START_S`.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from test_node_mode import CHUNK
from vllm_harness import start_engine, transfer_config

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "node"))  # nodekit
from nodekit import Lines, NodeProcess

from kvtier.node.client import engine_pid

MAX_TOKENS = 16
# vLLM 0.32's CPU attention on its AMX path (bf16 with blocks of a multiple of 32 tokens, the
# only sizes it takes: cpu_attn._get_attn_isa) died with SIGILL inside
# cpu_attention_with_kv_cache in these engines, 5 runs of 6 on 2026-11-29 (a crash in vLLM's
# kernel, not kvtier's; 0 of 3 the next day). Where that path would be taken, the engines
# compute in float32 (its "vec" path): the drill runs on every CPU.
AMX_ATTENTION = bool(torch.cpu._is_amx_tile_supported())
ENGINE_SETTINGS: dict[str, Any] = {"dtype": "float32"} if AMX_ATTENTION else {}
START_S = 300  # engine 1's start: vLLM imported afresh beside engine 2's start (2 cores)


@dataclass
class Engine1:
    """node_engine.py as a subprocess: commands in, JSON lines out; holds by files."""

    process: subprocess.Popen[str]
    hold_dir: Path
    lines: Lines  # its stdout's

    def read(self, timeout_s: float = 120) -> dict[str, Any]:
        line = self.lines.next(timeout_s, "engine 1")
        assert line, f"engine 1 exited ({self.process.poll()})"
        message: dict[str, Any] = json.loads(line)
        return message

    def send(self, command: dict[str, Any]) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps(command) + "\n")
        self.process.stdin.flush()

    def generate(self, prompts: list[dict[str, Any]]) -> list[list[int]]:
        self.send({"generate": prompts, "max_tokens": MAX_TOKENS})
        tokens: list[list[int]] = self.read()["tokens"]
        return tokens

    def hold(self, kind: str) -> None:
        (self.hold_dir / kind).touch()

    def release(self, kind: str) -> None:
        (self.hold_dir / kind).unlink()

    def connected(self, node: NodeProcess) -> bool:
        """Whether the node lists a connection of this process."""
        return self.process.pid in map(engine_pid, node.status()["engines"])


@contextlib.contextmanager
def engine_pair(model_dir: Path, node: NodeProcess, work_dir: Path
                ) -> Iterator[tuple[Engine1, Any]]:
    """Engine 1 (a process) and engine 2 (this process) on `node`, started side by side;
    engine 1's holds and temp dir in `work_dir` (empty or absent). Loads are asynchronous
    (on the worker's load thread), so that a held load and a held store (the store thread)
    can both be caught at once. Engine 1 is killed at the end, whatever its state."""
    # Tails off, as vllm_harness.kvtier_transfer_config: the cases count chunk-sized hits.
    config = transfer_config({"node": str(node.socket_path), "tokens_per_chunk": CHUNK,
                              "load_when": "always", "load_mode": "async",
                              "lookup_timeout_s": 1.0, "tail_chunks": False})
    hold_dir, temp = work_dir / "holds", work_dir / "engine1-tmp"
    hold_dir.mkdir(parents=True)
    # Its temp dir the test's: killed, it leaves its engine's (vLLM's rendezvous file).
    temp.mkdir()
    process = subprocess.Popen(
        [sys.executable, str(Path(__file__).with_name("node_engine.py")), str(model_dir),
         json.dumps(config), str(hold_dir), json.dumps(ENGINE_SETTINGS)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, start_new_session=True,
        env={**os.environ, "TMPDIR": str(temp)})
    assert process.stdout is not None
    one = Engine1(process, hold_dir, Lines(process.stdout))
    try:
        with start_engine(model_dir, config, **ENGINE_SETTINGS) as two:
            assert one.read(START_S) == {"ready": process.pid}
            yield one, two
    finally:
        with contextlib.suppress(ProcessLookupError):
            process.kill()
        process.wait(timeout=30)
        for pipe in (process.stdin, process.stdout):
            if pipe is not None:
                pipe.close()
