"""The workers' fingerprint, taken at vLLM's connector handshake, rebuilds the scheduler side
in their namespace (KVTierConnector.set_xfer_handshake_metadata). The scheduler it replaces
holds what only one may hold: with `pool_events` on an endpoint it binds (tcp://*:PORT, as a
router that connects to its engines configures it), the PUB socket. Built while the old one
was still open, the new scheduler's bind failed (EADDRINUSE) and the engine did not start.

The replaced side must also let go of what its probes opened: a redis tier's probe holds a
connection per TP rank's layout, a node's probe its connections to the node (and its mapping
of the node's RAM). Only the scheduler was closed, not its locator's probes: every engine
start left their connections open beside the new side's.

The shell's hooks are its own code (its __init__, which reads a VllmConfig, is skipped); its
scheduler sides are real ConnectorSchedulers, built as `_build_scheduler` builds them for a
fingerprint (the first test), or by `_build_scheduler` itself from vLLM's KV cache spec.
"""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

pytest.importorskip("vllm")

from redis_server import RedisServer
from s3_server import S3Endpoint
from vllm import SamplingParams
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.request import Request

from kvtier.core.fingerprint import ModelFingerprint
from kvtier.core.locator import ChunkLocator
from kvtier.integrations.vllm.config import ConnectorConfig
from kvtier.integrations.vllm.connector import KVTierConnector
from kvtier.integrations.vllm.messages import WorkerIdentity
from kvtier.integrations.vllm.scheduler.connector_scheduler import ConnectorScheduler
from kvtier.node.config import NodeConfig
from kvtier.node.server import running_node
from kvtier.tiers.storeconfig import StoreConfig

CHUNK, BLOCK = 64, 32


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def test_the_workers_namespace_rebuilds_a_scheduler_that_binds_its_pool_events() -> None:
    config = ConnectorConfig.parse({
        "tokens_per_chunk": CHUNK, "tiers": [{"kind": "memory", "capacity": "1MiB"}],
        "pool_events": {"endpoint": f"tcp://*:{_free_port()}", "pool": "p", "model": "m"}})
    built: list[str] = []

    def build(model_id: str, fingerprint: ModelFingerprint) -> ConnectorScheduler:
        built.append(fingerprint.digest)
        return ConnectorScheduler(config, block_size=BLOCK, model_id=model_id,
                                  layout_digest="0" * 32, weights_fingerprint=fingerprint.digest,
                                  locator=ChunkLocator({}, max_keys=64))

    shell = KVTierConnector.__new__(KVTierConnector)
    shell._vllm_config = SimpleNamespace(model_config=SimpleNamespace(model="m"))
    shell._identity = ModelFingerprint("a" * 32, 0)
    shell._build_scheduler = build  # type: ignore[method-assign]
    shell._scheduler = build("m", shell._identity)
    try:
        shell.set_xfer_handshake_metadata({0: WorkerIdentity("b" * 32, 0),
                                           1: WorkerIdentity("b" * 32, 0)})
        assert built == ["a" * 32, "b" * 32]  # the workers' namespace, one publisher
    finally:
        if shell._scheduler is not None:
            shell._scheduler.close()


def connector_shell(extra_config: dict[str, Any], tp_size: int = 2) -> KVTierConnector:
    """A scheduler-role shell whose side `_build_scheduler` builds for vLLM's spec of one
    full-attention group, `tp_size` tensor-parallel ranks (a layout each), in namespace a."""
    shell = KVTierConnector.__new__(KVTierConnector)
    shell._vllm_config = SimpleNamespace(
        model_config=SimpleNamespace(model="m", served_model_name=None),
        cache_config=SimpleNamespace(cache_dtype="auto"),
        parallel_config=SimpleNamespace(tensor_parallel_size=tp_size), kv_events_config=None)
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=16,
                             dtype=torch.bfloat16)
    shell._kv_cache_config = KVCacheConfig(num_blocks=16, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(["l0", "l1"], spec)])
    shell._kv_transfer_config = SimpleNamespace(kv_role="kv_both")
    shell._block_size = BLOCK
    shell._config = ConnectorConfig.parse({"tokens_per_chunk": CHUNK, **extra_config})
    shell._identity = ModelFingerprint("a" * 32, 0)
    shell._scheduler = shell._build_scheduler("m", shell._identity)
    return shell


def look_up(shell: KVTierConnector, request_id: str) -> int:
    """A prompt of two chunks looked up until the probes have answered: the tokens found."""
    request = Request(request_id, list(range(2 * CHUNK + 1)), SamplingParams(max_tokens=1),
                      None)
    deadline = time.monotonic() + 10
    while (found := shell.get_num_new_matched_tokens(request, 0)[0]) is None:
        assert time.monotonic() < deadline, "the slow probes never answered"
        time.sleep(0.01)
    return found


def wait_for(predicate: Callable[[], bool], what: str, timeout_s: float = 10) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def handshake(shell: KVTierConnector) -> None:
    """vLLM's handshake: both TP ranks' workers built the model in namespace "b" * 32."""
    shell.set_xfer_handshake_metadata({0: WorkerIdentity("b" * 32, 0),
                                       1: WorkerIdentity("b" * 32, 0)})


def replace_after_a_lookup(shell: KVTierConnector, count: Callable[[], int], what: str) -> None:
    """A lookup (each TP rank's layout's probe connects), then the handshake replaces the
    side: after the new side's lookup, `count` (what the probes hold open) comes back to one
    side's."""
    assert look_up(shell, "r1") == 0
    one_side = count()
    assert one_side >= 2  # a TP rank's layout's at least each
    old = shell._scheduler  # kept: closed must not wait for the collector
    handshake(shell)
    assert shell._scheduler is not old
    assert look_up(shell, "r2") == 0
    wait_for(lambda: count() == one_side, what)


@contextmanager
def node_socket(tag: str) -> Iterator[NodeConfig]:
    """The config of a node with a 1 MiB RAM tier, its socket in a directory of its own
    (AF_UNIX paths are short), its slabs removed after."""
    folder = Path(tempfile.mkdtemp(prefix="kvn-", dir="/tmp"))
    name = f"t{os.getpid()}-{tag}"
    try:
        yield NodeConfig(StoreConfig.parse({"tiers": [{"kind": "memory", "capacity": "1MiB"}]}),
                         folder / "node.sock", name=name)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
        for left in Path("/dev/shm").glob(f"kvtier-{name}*"):
            left.unlink(missing_ok=True)


def test_the_replaced_scheduler_closes_its_redis_probes_connections(
        redis_server: RedisServer) -> None:
    admin = redis_server.client()

    def connections() -> int:  # the scheduler's: the server's, less this one
        return len(admin.client_list()) - 1

    shell = connector_shell({"tiers": [
        {"kind": "redis", "url": redis_server.url, "capacity": "1MiB"}]})
    try:
        replace_after_a_lookup(shell, connections, "the old probes' connections to close")
    finally:
        if shell._scheduler is not None:
            shell._scheduler.close()
    wait_for(lambda: connections() == 0, "every probe's connection to close")


def test_the_replaced_scheduler_ends_its_s3_probes_lookup_threads(
        s3_session: S3Endpoint) -> None:
    def lookup_threads() -> int:  # each layout's tier asks its HEADs on threads of its own
        return sum(t.name.startswith("kvtier-s3-") for t in threading.enumerate())

    shell = connector_shell({"tiers": [
        {"kind": "s3", "capacity": "1MiB", **s3_session.settings()}]})
    try:
        replace_after_a_lookup(shell, lookup_threads, "the old probes' threads to end")
    finally:
        if shell._scheduler is not None:
            shell._scheduler.close()


def test_the_replaced_scheduler_closes_its_connections_to_the_node() -> None:
    """Node mode: each TP rank's layout has a client of the node, connected at its first
    lookup; the node counts the connections it serves."""
    with node_socket("rebuild") as config, running_node(config) as node:
        shell = connector_shell({"node": str(config.socket_path)})
        try:
            replace_after_a_lookup(shell, lambda: int(node.status()["connections"]),
                                   "the old side's connections to the node to end")
        finally:
            if shell._scheduler is not None:
                shell._scheduler.close()
        wait_for(lambda: node.status()["connections"] == 0, "every connection to end")


def test_a_scheduler_replaced_before_any_lookup_leaves_no_layout_on_the_node() -> None:
    """vLLM's handshake comes before any request: the side built first must not have greeted
    the node with its namespace's layouts (the node holds a RAM slab for each, for as long as
    it runs). Before: building the side asked its first layout's welcome (whether the node has
    tiers below RAM), which left that layout of a namespace no one uses on the node."""
    with node_socket("lazy") as config, running_node(config) as node:
        shell = connector_shell({"node": str(config.socket_path)})
        try:
            assert node.status()["layouts"] == {}
            handshake(shell)
            assert look_up(shell, "r1") == 0
            assert len(node.status()["layouts"]) == 2  # the workers' namespace's only
        finally:
            if shell._scheduler is not None:
                shell._scheduler.close()
