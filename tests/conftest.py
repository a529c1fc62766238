"""Fixtures shared by the core's tests; the helpers themselves live in tests/tierkit.py."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import tierkit
from redis_server import REDIS_SERVER, SKIP_REASON, RedisClusterNodes, RedisServer
from tierkit import tiny_layout

from kvtier.core.layout import KVLayout

# Engines started by the tests (in-process LLM and servers) get the core binding they would
# have without a KV connector: vLLM's CPU backend otherwise reserves one more core for any
# connector, which on a 2-core machine slows every step several-fold (see kvtier.tools.ops.serving).
os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")


@pytest.fixture
def layout() -> KVLayout:
    """A 4 KiB-chunk layout (see tierkit.tiny_layout)."""
    return tiny_layout()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests parametrized with kind="redis" (the tier contract suite) need redis-server."""
    for item in items:
        callspec = getattr(item, "callspec", None)
        if callspec is not None and callspec.params.get("kind") == "redis":
            item.add_marker(pytest.mark.redis)


@pytest.fixture(scope="session")
def redis_session(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """One redis-server for the whole session (tests share it through `redis_url`)."""
    if REDIS_SERVER is None:
        pytest.skip(SKIP_REASON)
    server = RedisServer(tmp_path_factory.mktemp("redis-session")).start()
    yield server
    server.stop()


@pytest.fixture
def redis_url(redis_session: RedisServer) -> Iterator[str]:
    """The URL of an empty redis-server on 127.0.0.1 (the session's, flushed)."""
    redis_session.client().flushall()
    yield redis_session.url


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A redis-server of this test's own (to kill, slow down or restart), killed after it."""
    if REDIS_SERVER is None:
        pytest.skip(SKIP_REASON)
    server = RedisServer(tmp_path / "redis").start()
    yield server
    server.stop()


@pytest.fixture
def redis_cluster(tmp_path: Path) -> Iterator[RedisClusterNodes]:
    """A 3-node Redis Cluster on 127.0.0.1, killed after the test."""
    if REDIS_SERVER is None:
        pytest.skip(SKIP_REASON)
    cluster = RedisClusterNodes(tmp_path / "cluster")
    try:
        yield cluster.start()
    finally:
        cluster.stop()


@pytest.fixture(autouse=True)
def _redis_for_kind_redis(request: pytest.FixtureRequest) -> Iterator[None]:
    """Give tierkit the server address when a test is parametrized with kind="redis"."""
    callspec = getattr(request.node, "callspec", None)
    if callspec is None or callspec.params.get("kind") != "redis":
        yield
        return
    tierkit.REDIS_URL = request.getfixturevalue("redis_url")
    yield
    tierkit.REDIS_URL = None
