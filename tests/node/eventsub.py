"""A router's side of the node's KV events, for the tests: a ZMQ SUB socket that receives on
a thread of its own (as a router's does) and decodes every message with vLLM's own decoder.
(Not named conftest.py: imported by name, by tests/node and tests/engine.)

Primitives: `Subscriber`.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import msgspec
import zmq


class Subscriber:
    """A router's SUB socket, bound on 127.0.0.1 (the node connects, as vLLM's publisher does
    to llm-d's EPP) or connected to `endpoint` (a node that binds), receiving on its own
    thread; each message decoded by vLLM's decoder."""

    def __init__(self, endpoint: str | None = None) -> None:
        from vllm.distributed import kv_events  # the decoder under test (its import: ~5 s)

        self._kv_events = kv_events
        self._decoder = msgspec.msgpack.Decoder(kv_events.KVEventBatch)
        self.batches: list[tuple[str, int, Any]] = []  # (topic, seq, vLLM's KVEventBatch)
        self.frames: list[tuple[str, bytes]] = []  # (topic, payload) as received, for llmdrules
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._context = zmq.Context()
        self._sub = self._context.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        if endpoint is None:
            port = self._sub.bind_to_random_port("tcp://127.0.0.1")
            endpoint = f"tcp://127.0.0.1:{port}"
        else:
            self._sub.connect(endpoint)
        self.endpoint = endpoint
        self.handshakes = 0  # connections made with a node (a restarted node's: one more)
        self._monitor = self._sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
        self._thread = threading.Thread(target=self._receive, daemon=True)
        self._thread.start()

    def _receive(self) -> None:
        # Polled all the time, as a router's is: libzmq sends a subscriber's subscription
        # only when its socket is called, and a PUB drops what it sends before it arrives.
        poller = zmq.Poller()
        poller.register(self._sub, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        while not self._stop.is_set():
            ready = dict(poller.poll(20))
            if self._monitor in ready:
                self._monitor.recv_multipart()
                self.handshakes += 1
            if self._sub in ready:
                topic, seq, payload = self._sub.recv_multipart()
                batch = self._decoder.decode(payload)
                with self._lock:
                    self.batches.append((topic.decode(), int.from_bytes(seq, "big"), batch))
                    self.frames.append((topic.decode(), payload))

    def wait_connected(self, handshakes: int = 1, timeout_s: float = 30.0,
                       settle_s: float = 0.3) -> None:
        """Wait until `handshakes` publishers have connected, then `settle_s` more: a PUB
        drops what it sends before the subscription (sent after the handshake, taken in by
        the PUB's next send) has reached it. A node's first batch went out 3-9 ms after its
        publisher connected: too soon on a loaded machine.

        Raises:
            AssertionError: fewer handshakes within `timeout_s`.
        """
        deadline = time.monotonic() + timeout_s
        while self.handshakes < handshakes:
            assert time.monotonic() < deadline, f"{self.handshakes} of {handshakes} " \
                f"publishers connected within {timeout_s} s"
            time.sleep(0.01)
        time.sleep(settle_s)

    def events(self) -> list[tuple[str, Any]]:
        """Every event received so far, with its topic."""
        with self._lock:
            return [(topic, event) for topic, _, batch in self.batches for event in batch.events]

    def stored(self) -> dict[bytes, Any]:
        """Every block announced stored, as a one-block vLLM BlockStored of its own (an event
        announces a run of chunks: kvtier.tiers.eventblocks), by its hash."""
        blocks = {}
        for _, e in self.events():
            if not isinstance(e, self._kv_events.BlockStored):
                continue
            parent, size = e.parent_block_hash, e.block_size
            for j, block in enumerate(e.block_hashes):
                blocks[block] = self._kv_events.BlockStored(
                    block_hashes=[block], parent_block_hash=parent,
                    token_ids=e.token_ids[j * size:(j + 1) * size], block_size=size,
                    lora_id=None, medium=e.medium, lora_name=e.lora_name,
                    extra_keys=None if e.extra_keys is None else [e.extra_keys[j]],
                    locality=e.locality, ownership=e.ownership)
                parent = block
        return blocks

    def removed(self) -> list[bytes]:
        return [block for _, e in self.events() if isinstance(e, self._kv_events.BlockRemoved)
                for block in e.block_hashes]

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._sub.disable_monitor()
        self._monitor.close(linger=0)
        self._sub.close(linger=0)
        self._context.term()
