"""An engine's mapping of its node's RAM slab is registered for DMA where CUDA is there
(kvtier/node/dma.py): a real in-process node, a `NodeClient` as an engine's worker holds one;
the mapping it made is pinned memory to torch, and a chunk the node holds copies to the GPU
with its bytes. Without CUDA nothing is registered (the CPU engines' case, which CI runs).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gpurig import NEEDS_CUDA

from kvtier.core.keys import ChunkKey
from kvtier.core.layout import KVLayout
from kvtier.node.client import NodeClient, NodeProbe, NodeStore
from kvtier.node.config import NodeConfig
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
