"""Real engines failing on a `kvtier node`: one killed with SIGKILL in the middle of a load and
a store, two storing the same chunks at once (issue 43).

A real node (`kvtier node serve`, RAM only) and two real engines in node mode with the same
settings (so their tokens compare exactly): engine 1 in a process of its own (node_engine.py,
driven over a pipe: the one killed), engine 2 in the test's process. Where a case needs an
engine caught mid-transfer, a hook holds engine 1's copy (node_engine.py's holds: a stalled
worker) with the node's lease taken, and the test acts then:
  - engines 1 and 2 store one prompt's chunks at once: engine 1 holds its reserved slots
    while engine 2 computes the prompt and reserves and fills its own; both answer the same
    tokens, the node keeps one copy of each chunk and lends it;
  - engine 1 computes a prompt (its chunks committed), then is caught with a load of them
    under way (read in place: it stored them, so it holds their slots by their locks, no
    lease) and a store's slots reserved (a lease), and is killed: the kernel drops its locks,
    the node ends its lease once it sees the connection gone, serves on, and engine 2 hits
    what engine 1 committed (with engine 1's tokens), never the slots it reserved and did not
    fill.
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from node_engine_pair import MAX_TOKENS, Engine1, engine_pair
from test_node_mode import CHUNK, HITS, loadable, ram_chunks
from vllm_harness import metric, random_prompts, token_ids

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "node"))  # nodekit
from nodekit import NodeProcess, short_dir, unique_name, wait_for

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeProcess]:
    tmp = tmp_path_factory.mktemp("node")
    config = tmp / "node.yaml"
    config.write_text(yaml.safe_dump({"tiers": [{"kind": "memory", "capacity": "64MiB"}]}))
    node = NodeProcess(config, short_dir(tmp) / "node.sock", unique_name(tmp), tmp / "node.log")
    try:
        yield node.start()
    finally:
        node.kill()


@pytest.fixture(scope="module")
def engines(tiny_model_dir: Path, node: NodeProcess,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Engine1, Any]]:
    with engine_pair(tiny_model_dir, node, tmp_path_factory.mktemp("engine1")) as pair:
        yield pair


def stored_chunks(prompt_len: int) -> int:
    """Chunks a run stores: its computed tokens (prompt + all answer tokens but the last)."""
    return (prompt_len + MAX_TOKENS - 1) // CHUNK


def test_two_engines_storing_the_same_chunks_at_once_keep_one_copy(
        engines: tuple[Engine1, Any], node: NodeProcess) -> None:
    one, two = engines
    [prompt] = random_prompts([400], seed=51)
    before, chunks = node.status()["counters"], ram_chunks(node)
    one.hold("stores")
    one.send({"generate": [prompt], "max_tokens": MAX_TOKENS})
    assert one.read() == {"holding": "store"}  # its slots reserved, none filled yet
    # Engine 2 finds nothing committed: it computes the prompt and stores it too.
    hits = metric(two, HITS)
    [answer] = token_ids(two, [prompt], MAX_TOKENS)
    assert metric(two, HITS) == hits
    one.release("stores")
    assert one.read() == {"tokens": [answer]}

    wait_for(lambda: node.status()["leases"] == 0, 30, "both engines' stores committed")
    counters = node.status()["counters"]
    # Both reserved a slot for every chunk (neither knew of the other's); one copy is kept.
    assert counters["reserved_chunks"] - before["reserved_chunks"] == 2 * stored_chunks(400)
    assert ram_chunks(node) - chunks == stored_chunks(400)
    two.reset_prefix_cache()  # vLLM's own cache: the next run must come from the node
    assert token_ids(two, [prompt], MAX_TOKENS) == [answer]
    assert metric(two, HITS) - hits == loadable(400)


def test_an_engine_killed_mid_load_and_mid_store_leaks_nothing(
        engines: tuple[Engine1, Any], node: NodeProcess) -> None:
    one, two = engines
    first, fresh, more = random_prompts([900, 500, 100], seed=52)
    [computed] = one.generate([first])
    wait_for(lambda: not node.status()["leases"], 30, "engine 1's stores committed")
    one.send({"reset": True})  # its own prefix cache: `longer` must load from the node
    assert one.read() == {"reset": True}
    # `longer` loads `first`'s chunks (its load held, their slots locked: read in place),
    # `fresh` is computed (its store held, slots reserved): both in flight when engine 1 dies.
    longer = {"prompt_token_ids": first["prompt_token_ids"] + more["prompt_token_ids"]}
    one.hold("loads")
    one.hold("stores")
    one.send({"generate": [longer, fresh], "max_tokens": MAX_TOKENS})
    assert {one.read()["holding"], one.read()["holding"]} == {"load", "store"}
    status = node.status()
    assert status["leases"] >= 1 and one.connected(node)
    one.process.send_signal(signal.SIGKILL)
    one.process.wait(timeout=30)

    # Each of its connections (scheduler, load and store threads) ends on its own: the one
    # holding the leases may be handled before another is.
    wait_for(lambda: node.status()["leases"] == 0 and not one.connected(node), 30,
             "the killed engine's leases and connections ended")
    after = node.status()
    assert after["counters"]["disconnects_with_leases"] > status["counters"][
        "disconnects_with_leases"]
    assert node.process is not None and node.process.poll() is None  # the node serves on

    # Engine 2 hits what engine 1 committed, with engine 1's tokens.
    hits = metric(two, HITS)
    assert token_ids(two, [first], MAX_TOKENS) == [computed]
    assert metric(two, HITS) - hits == loadable(900)
    # Slots engine 1 reserved and never filled hold nothing: `fresh` is a miss, computed...
    hits = metric(two, HITS)
    [answer] = token_ids(two, [fresh], MAX_TOKENS)
    assert metric(two, HITS) == hits
    # ...and stored by engine 2 into the slots given back: a hit with the same tokens.
    wait_for(lambda: not node.status()["leases"], 30, "engine 2's stores committed")
    two.reset_prefix_cache()
    assert token_ids(two, [fresh], MAX_TOKENS) == [answer]
    assert metric(two, HITS) - hits == loadable(500)
