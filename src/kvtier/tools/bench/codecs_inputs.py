"""What `kvtier bench codecs` measures (its config) and where its chunks of KV come from
(a tier directory's chunk files, or synthetic bf16), shared by the bench (bench/codecs.py) and
the engine run that generates KV (bench/codecs_engine.py).

Primitives: `CodecsConfig`, `OutputEffect`, `read_chunk_files`, `synthetic_chunks`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvtier.core.chunkformat import HEADER_BYTES, read_header
from kvtier.core.keys import ChunkKey
from kvtier.core.layout import DTYPE_BYTES
from kvtier.errors import ConfigError, CorruptChunk


@dataclass(frozen=True, slots=True)
class CodecsConfig:
    """What one run measures."""

    kv_dir: Path | None = None  # chunk files to measure; None: generate (or synthetic)
    synthetic: bool = False  # normal bf16 instead of an engine's KV
    dtype: str = "bfloat16"  # the KV dtype of the chunks in kv_dir (the others' are bf16)
    prompts: int = 8  # prompts the engine runs (generated KV and the fp8 outputs check)
    prompt_tokens: int = 640  # tokens per prompt
    max_tokens: int = 16  # tokens generated per prompt (fp8 outputs check)
    max_chunks: int = 64  # chunks measured at most
    trials: int = 3  # timed passes per figure; the median is reported
    work_dir: Path = Path(".")  # where temp tiers go (the filesystem measured)
    ttft_tokens: int = 0  # > 0: also time a disk hit of this many tokens per codec (engines)
    ttft_reps: int = 5  # timed disk hits per codec
    ttft_codecs: tuple[str, ...] = ("none", "zstd", "lz4")

    def validate(self) -> None:
        """Raises ConfigError naming the first bad field."""
        if self.dtype not in DTYPE_BYTES:
            raise ConfigError("dtype", self.dtype, f"one of {sorted(DTYPE_BYTES)}")
        for name in ("prompts", "prompt_tokens", "max_tokens", "max_chunks", "trials"):
            if getattr(self, name) < 1:
                raise ConfigError(name, getattr(self, name), "an integer >= 1")
        if self.kv_dir is None and self.dtype != "bfloat16":  # was measured as if it were
            raise ConfigError("dtype", self.dtype, "bfloat16 without --kv-dir: the generated "
                              "model's KV and --synthetic's chunks are bf16")
        if self.kv_dir is not None and not Path(self.kv_dir).is_dir():
            raise ConfigError("kv_dir", str(self.kv_dir), "a kvtier disk or shared directory")


@dataclass(frozen=True, slots=True)
class OutputEffect:
    """fp8 hits against the miss path's exact KV, over `prompts` prompts."""

    prompts: int
    identical_prompts: int  # prompts whose every generated token matched
    token_agreement: float  # matching tokens / generated tokens (position by position)
    logprob_delta_mean: float  # |delta| of the chosen tokens' logprobs, positions that agree
    logprob_delta_max: float


def read_chunk_files(root: Path, max_chunks: int) -> tuple[list[bytes], str]:
    """Payloads of the chunk files stored as is under `root` (every layout; the largest
    layout's, when several): (payloads, layout digest). Files with a codec are skipped."""
    by_layout: dict[str, list[bytes]] = {}
    for path in sorted(Path(root).rglob("*.kvc")):
        digest = path.parent.parent.parent.name
        data = path.read_bytes()
        try:
            header = read_header(data[:HEADER_BYTES], ChunkKey(bytes.fromhex(path.stem)), digest)
        except (CorruptChunk, ValueError):
            continue  # not a chunk of kvtier's layout, or corrupt
        if header.plain and len(by_layout.setdefault(digest, [])) < max_chunks:
            by_layout[digest].append(data[HEADER_BYTES:HEADER_BYTES + header.payload_bytes])
    if not by_layout:
        raise ConfigError("kv_dir", str(root), "a directory holding kvtier chunk files "
                          "stored without a codec")
    digest = max(by_layout, key=lambda d: len(by_layout[d]) * len(by_layout[d][0]))
    return by_layout[digest], digest


def synthetic_chunks(count: int, chunk_bytes: int = 1 << 20) -> list[bytes]:
    """Normal-distributed bf16, a scale per 64 values (heads of different magnitudes)."""
    import ml_dtypes

    rng = np.random.default_rng(0)
    out = []
    for _ in range(count):
        n = chunk_bytes // 2
        scale = rng.choice([0.05, 0.5, 4.0], size=n // 64).repeat(64)
        out.append((rng.standard_normal(n) * scale).astype(ml_dtypes.bfloat16).tobytes())
    return out
