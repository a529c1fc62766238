"""vLLM's KV cache groups as kvtier stores them (the hybrid KV cache manager, `SupportsHMA`).

vLLM splits a model's layers into KV cache groups, each with its own block table: one group
for a plain model; with the hybrid manager on, one per kind of layer, e.g. Gemma 3's
sliding-window layers and full-attention layers. Block ids come from one pool, so a block id
names one block of one group; block 0 is vLLM's null block, which stands for a block a group
does not keep (a sliding-window group frees the blocks that leave its window).

A kvtier chunk holds every layer of every group, group by group (groups in vLLM's order, the
layers of a group in its order), in the byte order of paged.py; a chunk's block ids are the
groups' block ids for its tokens, concatenated (`ChunkGroups.flat`). With more than one group
the namespace says how the layers are grouped (`label`), so that a chunk is never read with
another grouping.

What a prefix hit needs of each group:
  - full attention: every block of the prefix;
  - sliding window (window W): the blocks of the last W tokens; vLLM allocates null blocks
    below them, which a load skips. A chunk is stored only while every block of it is held
    (none null): that holds for a chunk stored by the step that completes it whenever
    tokens_per_chunk <= W (a block leaves the window only W tokens after it), and a hit ending
    at a later chunk needs no block of it that left the window sooner;
  - Mamba/SSM, short-convolution and linear-attention state: one state per request, of which a
    hit needs the state at the hit's last token (vLLM's "align" prefix caching keeps one per
    block boundary that ends a step): not stored by kvtier, and models with such layers are
    refused (models.py).

Primitives: `ChunkGroups`, `chunk_groups`, `NULL_BLOCK`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvtier.integrations.vllm.models import HMA_ALTERNATIVE, refuse

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import KVCacheConfig

NULL_BLOCK = 0  # vLLM's BlockPool.null_block: never a request's own block


@dataclass(frozen=True, slots=True)
class ChunkGroups:
    """The KV cache groups of a model, as kvtier's chunks cover them."""

    layer_names: tuple[tuple[str, ...], ...]  # per group, vLLM's layer names in its order
    # Per group, its kind: "full", or "sliding:<window tokens>".
    kinds: tuple[str, ...]

    @property
    def count(self) -> int:
        return len(self.layer_names)

    @property
    def num_layers(self) -> int:
        return sum(len(names) for names in self.layer_names)

    @property
    def layer_order(self) -> list[str]:
        """Every layer, in chunk order (group by group)."""
        return [name for names in self.layer_names for name in names]

    @property
    def min_window(self) -> int | None:
        """The smallest sliding window, in tokens; None without sliding-window groups."""
        windows = [int(kind.split(":")[1]) for kind in self.kinds if kind.startswith("sliding")]
        return min(windows) if windows else None

    def label(self) -> str | None:
        """How layers are grouped, for the keys' namespace; None for one group (chunks as
        before the hybrid manager)."""
        if self.count == 1:
            return None
        return "kv-groups=" + ",".join(f"{kind}x{len(names)}" for kind, names
                                       in zip(self.kinds, self.layer_names))

    @staticmethod
    def flat(per_group: tuple[list[int], ...] | list[list[int]], first: int,
             count: int) -> tuple[int, ...]:
        """The block ids of blocks [first, first + count) of every group, concatenated."""
        return tuple(b for ids in per_group for b in ids[first: first + count])


def chunk_groups(model: str, kv_cache_config: KVCacheConfig) -> ChunkGroups:
    """The groups of `kv_cache_config`, checked.

    Raises:
        ConfigError: naming the model, for a group kvtier cannot store (a state group, a
            kind of attention not tried) or groups of unequal block sizes or KV shapes.
    """
    from vllm.v1.kv_cache_interface import AttentionSpec, FullAttentionSpec, SlidingWindowSpec

    groups = kv_cache_config.kv_cache_groups
    kinds: list[str] = []
    for group in groups:
        spec = group.kv_cache_spec
        if not isinstance(spec, AttentionSpec):
            raise refuse(model, f"a {type(spec).__name__} KV cache group, not per-token K "
                         "and V", HMA_ALTERNATIVE)
        if isinstance(spec, SlidingWindowSpec) and type(spec) is SlidingWindowSpec:
            kinds.append(f"sliding:{spec.sliding_window}")
        elif isinstance(spec, FullAttentionSpec) and (
                type(spec) is FullAttentionSpec or type(spec).__name__ == "MLAAttentionSpec"):
            kinds.append("full")
        else:
            raise refuse(model, f"a {type(spec).__name__} KV cache group (kvtier stores full "
                         "and sliding-window attention groups)", HMA_ALTERNATIVE)
    first = groups[0].kv_cache_spec
    for group in groups[1:]:
        spec = group.kv_cache_spec
        assert isinstance(spec, AttentionSpec) and isinstance(first, AttentionSpec)
        if (spec.block_size, spec.num_kv_heads, spec.head_size, spec.dtype) != (
                first.block_size, first.num_kv_heads, first.head_size, first.dtype):
            raise refuse(model, "KV cache groups of different block sizes or KV shapes ("
                         + ", ".join(f"{type(g.kv_cache_spec).__name__} block "
                                     f"{g.kv_cache_spec.block_size}" for g in groups) + ")",
                         HMA_ALTERNATIVE)
    return ChunkGroups(layer_names=tuple(tuple(g.layer_names) for g in groups),
                       kinds=tuple(kinds))
