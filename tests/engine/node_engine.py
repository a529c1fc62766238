"""An engine in node mode in a process of its own, driven over a pipe: the engine that
tests/engine/test_node_failures.py kills with SIGKILL. (Not a test: run as a script.)

    python node_engine.py MODEL_DIR KV_TRANSFER_CONFIG_JSON HOLD_DIR

The engine is `vllm_harness.start_engine`'s (the same settings as the test's own engines,
so their tokens compare exactly), with vLLM's engine core and model runner in this process:
one SIGKILL ends the engine, with every connection to the node it held.

Commands on stdin, one JSON object a line, each answered with one JSON line on stdout:
  {"generate": [prompt, ...], "max_tokens": N} -> {"tokens": [[id, ...], ...]}
  {"reset": true}                              -> {"reset": true|false} (vLLM's prefix cache)
  {"counter": NAME}                            -> {"counter": value} (kvtier's, summed)
Holds, a fault injected (a copy that stalls, as a wedged worker's would): while
HOLD_DIR/stores exists, a store that was given its slot in the node's slab waits before
filling it (the Reserve's lease held) and says {"holding": "store"}; while HOLD_DIR/loads
exists, a load whose chunks the node lent (or this engine holds in place, their slots
locked) waits before copying them (the Borrow's lease or the locks held) and says
{"holding": "load"}. Removing the file lets it go on.
vLLM's own logs go to stderr: stdout is the protocol's.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # vllm_harness
from vllm_harness import greedy, start_engine

from kvtier.core.retention import DEFAULT_META, ChunkMeta
from kvtier.core.store import PendingPut
from kvtier.node.nodestore import NodeStore
from kvtier.testing.engines import kvtier_counter

_said = threading.Lock()
_out = os.fdopen(os.dup(1), "w")  # the protocol's stdout; fd 1 (vLLM's logs) goes to stderr
os.dup2(2, 1)


def say(message: dict[str, Any]) -> None:
    with _said:
        _out.write(json.dumps(message) + "\n")
        _out.flush()


def hold(flag: Path, kind: str) -> None:
    """Wait while `flag` exists, having said so."""
    if not flag.exists():
        return
    say({"holding": kind})
    while flag.exists():
        time.sleep(0.05)


def inject_holds(hold_dir: Path) -> None:
    lend_as_landed, putting = NodeStore.lend_as_landed, NodeStore.putting

    def held_lend(self: NodeStore, *args: Any, **kwargs: Any) -> Any:
        lending = lend_as_landed(self, *args, **kwargs)
        hold(hold_dir / "loads", "load")
        return lending

    @contextlib.contextmanager
    def held_putting(self: NodeStore, key: Any, spare: memoryview,
                     meta: ChunkMeta = DEFAULT_META) -> Iterator[PendingPut]:
        with putting(self, key, spare, meta) as put:
            if put.data is not None:
                hold(hold_dir / "stores", "store")
            yield put

    NodeStore.lend_as_landed = held_lend  # type: ignore[method-assign]
    NodeStore.putting = held_putting  # type: ignore[method-assign]


def main() -> None:
    model_dir, config, hold_dir = Path(sys.argv[1]), json.loads(sys.argv[2]), Path(sys.argv[3])
    overrides = json.loads(sys.argv[4]) if len(sys.argv) > 4 else {}  # LLM(...) arguments
    inject_holds(hold_dir)
    with start_engine(model_dir, config, processes=False, **overrides) as llm:
        say({"ready": os.getpid()})
        for line in sys.stdin:
            command = json.loads(line)
            if "generate" in command:
                outputs = llm.generate(command["generate"], greedy(command["max_tokens"]),
                                       use_tqdm=False)
                say({"tokens": [list(o.outputs[0].token_ids) for o in outputs]})
            elif command.get("reset"):
                say({"reset": bool(llm.reset_prefix_cache())})
            elif "counter" in command:
                say({"counter": kvtier_counter(command["counter"])})


if __name__ == "__main__":
    main()
