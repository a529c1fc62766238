"""The node freezes its heap once a layout's tiers are built (as vLLM freezes an engine's once
started): no full collection walks what they built, the maps that grow with what the tiers
hold among it (a disk tier's ring of 2 million keys: ~30 ms a collection, every connection's
thread stopped meanwhile). An in-process node."""

from __future__ import annotations

import gc
from collections import OrderedDict, deque
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path

from nodekit import connect, key, node_tiers

from kvtier.node.server import NodeServer

CONTAINERS = (dict, list, set, tuple, deque, OrderedDict)


def walked_from(root: object) -> list[object]:
    """What a full collection would walk (frozen objects are not) of the data `root` reaches:
    kvtier's objects and the containers they hold, not classes, modules or functions."""
    walked = {id(o) for o in gc.get_objects()}
    seen: set[int] = set()
    found, todo = [], [root]
    while todo:
        obj = todo.pop()
        if id(obj) in seen or not gc.is_tracked(obj) or not (
                type(obj) in CONTAINERS or type(obj).__module__.startswith("kvtier.")):
            continue
        seen.add(id(obj))
        if id(obj) in walked:
            found.append(obj)
        todo.extend(gc.get_referents(obj))
    return found


def test_a_layouts_tiers_as_built_are_out_of_the_collectors_walks(
        tmp_path: Path, in_process_node: Callable[..., AbstractContextManager[NodeServer]]
) -> None:
    with in_process_node(node_tiers(tmp_path, ram_chunks=4, disk_chunks=16)) as node:
        _, engine = connect(node.config.socket_path)
        assert not engine.contains(key(0))  # its first request's hello opens the tiers
        (layout,) = node.layouts.served().values()
        assert [type(t).__name__ for t in layout.store.tiers] == ["MemoryTier", "DiskTier"]
        assert walked_from(layout.store.tiers[0]) == []
        assert walked_from(layout.store.tiers[1]) == []
        engine.close()
