"""An engine the node refuses (its layout past max_layouts; /dev/shm full alike) misses on,
asking again every `retry_s`, and says so once: a warning, not one every `retry_s` for as
long as the refusal lasts (1,800 an hour per engine before). A failure after a welcome is
news again: logged.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path

import pytest
from nodekit import INFO, OTHER_LAYOUT, connect, key, node_tiers, put_chunks, wait_for

from kvtier.node.server import NodeServer

pytestmark = pytest.mark.timeout(120)


def warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "kvtier.node.client" and r.levelno >= logging.WARNING]


def test_an_engine_refused_again_and_again_warns_once(
        tmp_path: Path, caplog: pytest.LogCaptureFixture,
        in_process_node: Callable[..., AbstractContextManager[NodeServer]]):
    caplog.set_level(logging.INFO, logger="kvtier.node.client")
    with in_process_node(node_tiers(tmp_path, ram_chunks=8), max_layouts=1) as node:
        _, engine = connect(node.config.socket_path)
        assert put_chunks(engine, [0]) == [True]
        other_client, other = connect(node.config.socket_path, OTHER_LAYOUT, retry_s=0.05)

        def refused_four_times() -> bool:
            assert not other.contains(key(0))  # a miss each time, never an exception
            return int(node.status()["counters"]["refused"]) >= 4

        wait_for(refused_four_times, 30, "the node refusing the other layout 4 times")
        assert other_client.failures >= 4
        said = warnings(caplog)
        assert len(said) == 1, said  # before: one per refusal
        assert "max_layouts" in said[0]
        answers = [r for r in caplog.records if r.getMessage().endswith("answers again")]
        assert sum(r.levelno >= logging.INFO for r in answers) <= 1
    # The node gone: the engine it welcomed says so.
    wait_for(lambda: not engine.contains(key(0)), 10, "the stopped node missed")
    assert len(warnings(caplog)) == 2


def node_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name.startswith("kvtier.node.") and r.name != "kvtier.node.client"
            and r.levelno >= logging.WARNING]


def test_the_node_logs_why_it_refuses_an_engine_once(
        tmp_path: Path, caplog: pytest.LogCaptureFixture,
        in_process_node: Callable[..., AbstractContextManager[NodeServer]]):
    """The node's own log says why `refused` grows (the engine, its model, the reason and
    what to do), once while the reason stays: before, only a layout whose tiers could not
    open was logged, and a node at `max_layouts` refused its engines in silence."""
    caplog.set_level(logging.INFO, logger="kvtier.node")
    with in_process_node(node_tiers(tmp_path, ram_chunks=8), max_layouts=1) as node:
        _, engine = connect(node.config.socket_path)
        assert put_chunks(engine, [0]) == [True]
        _, other = connect(node.config.socket_path, OTHER_LAYOUT, retry_s=0.05,
                           engine="late-engine")

        def refused_three_times() -> bool:
            assert not other.contains(key(0))
            return int(node.status()["counters"]["refused"]) >= 3

        wait_for(refused_three_times, 30, "the node refusing the other layout 3 times")
        said = node_warnings(caplog)
        assert len(said) == 1, said
        for words in ("late-engine", INFO.model, "max_layouts",
                      "--max-layouts"):
            assert words in said[0], said[0]
