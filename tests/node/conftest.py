"""Fixtures for the node's tests: `kvtier node serve` processes and in-process nodes, each on a
socket of its own test's tmp_path and named after the test (so its /dev/shm slabs are its own),
and always killed and cleaned up at teardown. Helpers: tests/node/nodekit.py.

Primitives: `socket_path`, `node_name`, `start_node` (a process), `in_process_node`.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import pytest
from nodekit import NodeProcess, left_in_shm, short_dir, unique_name, write_config

from kvtier.node.config import NodeConfig
from kvtier.node.server import NodeServer, running_node
from kvtier.tiers.storeconfig import StoreConfig


@pytest.fixture
def socket_path(tmp_path: Path) -> Iterator[Path]:
    directory = short_dir(tmp_path)
    yield directory / "node.sock"
    if directory != tmp_path:
        shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
def node_name(tmp_path: Path) -> Iterator[str]:
    name = unique_name(tmp_path)
    yield name
    for path in left_in_shm(name):  # a node killed with SIGKILL leaves its slabs
        path.unlink(missing_ok=True)


@pytest.fixture
def start_node(tmp_path: Path, socket_path: Path, node_name: str
               ) -> Iterator[Callable[..., NodeProcess]]:
    """start_node(config, umask=0o022, args=()): a started `kvtier node serve` of the store config
    `config` (a dict) on `socket_path`; killed (SIGKILL) at teardown if still running."""
    started: list[NodeProcess] = []

    def start(config: dict[str, Any], umask: int = 0o022,
              args: tuple[str, ...] = ()) -> NodeProcess:
        path = write_config(tmp_path / "node.json", config)
        node = NodeProcess(path, socket_path, node_name, tmp_path / "node.log", umask, args)
        started.append(node)
        return node.start()

    yield start
    for node in started:
        node.kill()


@pytest.fixture
def in_process_node(socket_path: Path, node_name: str
                    ) -> Callable[..., AbstractContextManager[NodeServer]]:
    """in_process_node(config, max_layouts=4): `running_node` of the store config `config`,
    for the tests where the process boundary is not what is tested."""

    def run(config: dict[str, Any], max_layouts: int = 4) -> AbstractContextManager[NodeServer]:
        return running_node(NodeConfig(StoreConfig.parse(config), socket_path, name=node_name,
                                       max_layouts=max_layouts))

    return run
