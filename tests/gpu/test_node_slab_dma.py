"""An engine's mapping of its node's RAM slab is registered for DMA where CUDA is there
(kvtier/node/dma.py): a real in-process node, a `NodeClient` as an engine's worker holds one;
the mapping it made is pinned memory to torch, and a chunk the node holds copies to the GPU
with its bytes. Without CUDA nothing is registered (the CPU engines' case, which CI runs).

The end of a registration (`unregister_for_dma`, called as the client lets a slab go) runs
on every machine: CUDA's two calls replaced by a recording stand-in (no GPU to register
with), the client's own path around them is the real one. It must come once, after the last
view of the slab is gone (a copy may still read from one), and before the mapping is unmapped
(CUDA keeps pages no longer mapped otherwise).
"""

from __future__ import annotations

import gc
import mmap
import time
from pathlib import Path

import pytest
import torch
from gpurig import NEEDS_CUDA

from kvtier.core.keys import ChunkKey
from kvtier.core.layout import KVLayout
from kvtier.node import client as node_client
from kvtier.node.client import NodeClient
from kvtier.node.config import NodeConfig
from kvtier.node.nodestore import NodeStore
from kvtier.node.probe import NodeProbe
from kvtier.node.server import running_node
from kvtier.tiers.manifest import NamespaceInfo
from kvtier.tiers.storeconfig import StoreConfig

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_size=64, dtype="float16",
                  tokens_per_chunk=256)
KEY = ChunkKey(b"\x01" * 16)


def _client(tmp_path: Path) -> tuple[NodeClient, NodeStore]:
    client = NodeClient(str(tmp_path / "node.sock"), LAYOUT, NamespaceInfo("m", "", 0),
                        timeout_s=10)
    return client, NodeStore(client, LAYOUT.bytes_per_chunk)


def _config(tmp_path: Path) -> NodeConfig:
    return NodeConfig(StoreConfig.parse({"tiers": [
        {"kind": "memory", "capacity": 4 * LAYOUT.bytes_per_chunk}]}),
        tmp_path / "node.sock", name=f"dma-{tmp_path.name[-24:]}", keep_ram=False)


@NEEDS_CUDA
@pytest.mark.gpu
def test_the_engines_mapping_of_the_slab_is_registered_and_dmas_whole_chunks(
        tmp_path: Path) -> None:
    with running_node(_config(tmp_path)):
        client, store = _client(tmp_path)
        payload = bytes(range(256)) * (LAYOUT.bytes_per_chunk // 256)
        assert store.put(KEY, memoryview(payload))
        assert NodeProbe([client]).contains_many([KEY]) == [True]
        assert client.dma_registered
        with store.borrow(KEY, memoryview(bytearray(LAYOUT.bytes_per_chunk))) as view:
            assert view is not None
            host = torch.frombuffer(view.data, dtype=torch.uint8)
            assert host.is_pinned()
            device = host.to("cuda", non_blocking=True)
            torch.cuda.synchronize()
        assert bytes(device.cpu().numpy()) == payload


def test_without_cuda_nothing_is_registered(tmp_path: Path) -> None:
    with running_node(_config(tmp_path)):
        client, store = _client(tmp_path)
        assert store.put(KEY, memoryview(bytes(LAYOUT.bytes_per_chunk)))
        assert client.dma_registered is torch.cuda.is_available()


class _Registrar:
    """CUDA's host registration, recorded: what was registered, what was unregistered and
    whether its mapping was still mapped then (its bytes readable). It keeps the mappings'
    ids, not the mappings: a reference would keep one mapped."""

    def __init__(self) -> None:
        self.registered: list[int] = []
        self.unregistered: list[tuple[int, bool]] = []

    def register(self, mapping: mmap.mmap) -> bool:
        self.registered.append(id(mapping))
        return True

    def unregister(self, mapping: mmap.mmap) -> None:
        try:
            mapped = len(torch.frombuffer(mapping, dtype=torch.uint8)) == len(mapping)
        except (ValueError, TypeError):  # closed: unmapped already
            mapped = False
        self.unregistered.append((id(mapping), mapped))


def _unregistered_soon(registrar: _Registrar, count: int) -> bool:
    deadline = time.monotonic() + 10
    while len(registrar.unregistered) < count and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.01)
    return len(registrar.unregistered) >= count


@pytest.mark.filterwarnings("ignore:The given buffer is not writable")
def test_a_slab_let_go_is_unregistered_after_its_last_view_and_before_its_unmap(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    registrar = _Registrar()
    monkeypatch.setattr(node_client, "register_for_dma", registrar.register)
    monkeypatch.setattr(node_client, "unregister_for_dma", registrar.unregister)
    payload = bytes(range(256)) * (LAYOUT.bytes_per_chunk // 256)
    with running_node(_config(tmp_path)):
        client, store = _client(tmp_path)
        assert store.put(KEY, memoryview(payload))
        assert client.dma_registered and len(registrar.registered) == 1
        with store.borrow(KEY, memoryview(bytearray(LAYOUT.bytes_per_chunk))) as view:
            assert view is not None
            # A copy in flight from the slab: a tensor of its bytes outlives the client.
            host = torch.frombuffer(view.data, dtype=torch.uint8)
        client.close()
        del view
        gc.collect()
        assert registrar.unregistered == []  # a view is left: still registered
        assert bytes(host.numpy()) == payload
        del host
        assert _unregistered_soon(registrar, 1)
        assert registrar.unregistered == [(registrar.registered[0], True)]
