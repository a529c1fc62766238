"""The workers' fingerprint, taken at vLLM's connector handshake, rebuilds the scheduler side
in their namespace (KVTierConnector.set_xfer_handshake_metadata). The scheduler it replaces
holds what only one may hold: with `pool_events` on an endpoint it binds (tcp://*:PORT, as a
router that connects to its engines configures it), the PUB socket. Built while the old one
was still open, the new scheduler's bind failed (EADDRINUSE) and the engine did not start.

The shell's hooks are its own code (its __init__, which reads a VllmConfig, is skipped); its
scheduler sides are real ConnectorSchedulers, built as `_build_scheduler` builds them for a
fingerprint.
"""

from __future__ import annotations

import socket
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from kvtier.core.fingerprint import ModelFingerprint
from kvtier.core.locator import ChunkLocator
from kvtier.integrations.vllm.config import ConnectorConfig
from kvtier.integrations.vllm.connector import KVTierConnector
from kvtier.integrations.vllm.messages import WorkerIdentity
from kvtier.integrations.vllm.scheduler.connector_scheduler import ConnectorScheduler

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
