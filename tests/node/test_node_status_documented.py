"""docs/node.md says what `kvtier node status` shows: every key of a node's status (and of a
layout's), and every counter, is named there in backticks. Before this test the page named
neither `borrows`, `lent_chunks`, `reserved_chunks`, `committed_chunks` nor `lookups`, which
the status and /metrics showed an operator first; deploy.md's metric list is checked in
tests/connector/test_doc_metrics.py."""

from __future__ import annotations

import re
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path

from nodekit import connect, node_tiers, put_chunks

from kvtier.node.server import NodeServer

NODE_MD = Path(__file__).resolve().parents[2] / "docs" / "node.md"


def test_node_md_names_every_key_and_counter_of_the_status(
        tmp_path: Path,
        in_process_node: Callable[..., AbstractContextManager[NodeServer]]) -> None:
    with in_process_node(node_tiers(tmp_path, ram_chunks=4)) as node:
        client, store = connect(node.config.socket_path)
        assert put_chunks(store, [0]) == [True]  # a layout, for its keys
        status = node.status()
        client.close()
    named = set(re.findall(r"`(\w+)`", NODE_MD.read_text()))
    [layout] = status["layouts"].values()
    shown = {*status, *status["counters"], *layout, *status["borrow_seconds"]}
    assert shown - named == set()
