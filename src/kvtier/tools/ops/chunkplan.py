"""What a model with state layers costs in kvtier's tiers: the chunk size kvtier will use and
the bytes of each chunk, KV and state apart.

Primitives:
    ChunkPlan                      -- the chunk size, how it was picked, bytes per chunk (frozen)
    plan_chunks(spec, kv_dtype, tp, on_cpu, block_size, tokens_per_chunk)
                                   -- the ChunkPlan of a model with state layers, else None

The rule (issue 25): vLLM's GPU pool keeps ONE copy of a sequence's states, whatever its
length; kvtier's tiers store, with every chunk, the states vLLM keeps at the chunk's end
(groups.py), so a session of T tokens on a tier is ceil(T / tokens_per_chunk) chunks of
(chunk KV + one full copy of the states): state bytes grow with the chunks. The chunk size
is the connector's own choice (`ConnectorConfig.for_block_size`): the operator's
tokens_per_chunk, which must be a multiple of vLLM's block size, else the smallest multiple of
the block from 256 tokens up. The block is the one vLLM's "align" mamba cache mode sets
(statesize.align_block_size): an attention page must hold a state page.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtier.integrations.vllm.config import TOKENS_PER_CHUNK, ConnectorConfig
from kvtier.tools.ops.attention_kernels import DEFAULT_BLOCK_SIZE
from kvtier.tools.ops.modelspec import ModelSpec, attention_token_bytes, kv_footprint
from kvtier.tools.ops.statesize import align_block_size

# vLLM's block size before alignment and its attention backend's smallest kernel block:
# FlashAttention on CUDA (16, MultipleOf(16)); the CPU backend (128, MultipleOf(32)). Not
# modelled: FA4's fixed page for head size 256 on Blackwell, the 128 floor of MLA hybrids.
CUDA_BLOCK, CUDA_KERNEL_BASE = DEFAULT_BLOCK_SIZE, 16
CPU_BLOCK, CPU_KERNEL_BASE = 128, 32


@dataclass(frozen=True, slots=True)
class ChunkPlan:
    """kvtier's chunks of one model with state layers; bytes on ONE tensor-parallel rank."""

    block_size: int  # vLLM's attention block size in align mode
    tokens_per_chunk: int  # the chunk kvtier stores
    operator_set: bool  # tokens_per_chunk came from the operator (else the connector's pick)
    kv_bytes_per_token: int  # attention layers' KV of one token
    state_bytes_per_seq: int  # every state layer's state of one sequence (one copy)
    tp: int  # ranks

    @property
    def chunk_kv_bytes(self) -> int:
        """KV in one chunk (one rank)."""
        return self.kv_bytes_per_token * self.tokens_per_chunk

    @property
    def chunk_bytes(self) -> int:
        """One chunk on one rank: its KV and a full copy of the states at its end."""
        return self.chunk_kv_bytes + self.state_bytes_per_seq

    @property
    def how(self) -> str:
        """How tokens_per_chunk was picked, e.g. "1 block of 544 (align mode)"."""
        blocks = self.tokens_per_chunk // self.block_size
        what = f"{blocks} block{'s' if blocks > 1 else ''} of {self.block_size} (align mode)"
        if self.operator_set:
            return f"{what}, set by the operator"
        return f"{what}: the smallest multiple of the block from {TOKENS_PER_CHUNK} tokens up"

    def chunks(self, tokens: int) -> int:
        """Chunks a session of `tokens` tokens takes on a tier."""
        return -(-tokens // self.tokens_per_chunk)

    def session_bytes(self, tokens: int) -> int:
        """A session of `tokens` tokens on a kvtier tier, on one rank: every chunk carries
        its own copy of the states."""
        return self.chunks(tokens) * self.chunk_bytes


def plan_chunks(spec: ModelSpec, kv_dtype: str = "bf16", tp: int = 1, on_cpu: bool = False,
                block_size: int | None = None,
                tokens_per_chunk: int | None = None) -> ChunkPlan | None:
    """The chunks kvtier stores for `spec`, or None when it has no state layers (its
    `tokens_per_chunk` is checked against vLLM's block all the same: the plan's kvtier
    command sets it, and an attention-only model's engine refuses it at start-up too).

    Args:
        on_cpu: vLLM's CPU backend (its default block and kernel alignment differ).
        block_size: `--block-size` given to vLLM; None for the platform's default.
        tokens_per_chunk: the operator's kvtier tokens_per_chunk; None to let kvtier pick.
    Raises:
        ConfigError: a tokens_per_chunk that is not a positive multiple of vLLM's block size
            (the connector refuses it at start-up the same way).
    """
    if spec.state is None or not spec.state_layers:
        if tokens_per_chunk is not None:  # printed in the kvtier command: checked alike
            ConnectorConfig.parse({"tokens_per_chunk": tokens_per_chunk}).check_block_size(
                block_size or (CPU_BLOCK if on_cpu else CUDA_BLOCK))
        return None
    fp = kv_footprint(spec, kv_dtype, tp)
    attn_token = attention_token_bytes(spec, kv_dtype, tp)
    base = CPU_KERNEL_BASE if on_cpu else CUDA_KERNEL_BASE
    asked = block_size or (CPU_BLOCK if on_cpu else CUDA_BLOCK)
    block = align_block_size(attn_token, spec.state.bytes_per_rank(tp), asked, base)
    extra = {} if tokens_per_chunk is None else {"tokens_per_chunk": tokens_per_chunk}
    config = ConnectorConfig.parse(extra).for_block_size(block)
    return ChunkPlan(block_size=block, tokens_per_chunk=config.tokens_per_chunk,
                     operator_set=config.tokens_per_chunk_set,
                     kv_bytes_per_token=fp.bytes_per_token,
                     state_bytes_per_seq=fp.state_bytes_per_seq, tp=tp)
