"""`kvtier bench codecs`: what each codec and encryption cost and save on real chunks of KV.

Where the chunks come from (`KVSource`):
  - `--kv-dir DIR`: the chunk files of a kvtier disk or shared directory (stored as is, i.e.
    written without a codec): the KV of whatever model filled it, e.g. a production one;
  - default: the bench generates them: it runs the generated test model through vLLM (CPU)
    with a RAM tier of two chunks over a disk tier with the LOSSY fp8 codec and a shared
    tier stored as is; the shared tier's files are the KV measured. The same run measures
    fp8's effect on outputs: every prompt's greedy tokens and their logprobs on the miss
    path (exact KV) against a hit read back from the fp8 disk tier (token agreement,
    logprob deltas). Random weights: the ratios are NOT those of a trained model's KV.
  - `--synthetic`: normal-distributed bf16 (no engine; a smoke test of the command).
With `--ttft TOKENS`, a disk-tier hit's TTFT with each codec too (bench/codecs_ttft.py).

Per codec (and the lossless codecs without the byte-plane split, for comparison): stored
ratio, file ratio (4 KiB header, 4 KiB-aligned body) and the effective capacity gain of a file
tier (1 / file ratio), compress and decompress GB/s of payload on one thread. Encryption:
ChunkEncoder GB/s sealed vs in clear, and a disk tier's put/get GB/s with each setting, all in
the same run (target: sealed >= ENCRYPTION_TARGET of in clear).

Primitives: `CodecsConfig`, `CodecsResult`, `run_codecs_bench`, `ENCRYPTION_TARGET`.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from kvtier.core.chunkformat import ChunkEncoder, read_header, stored_size
from kvtier.core.codecs import CODEC_NAMES, Codec, Lz4Codec, ZstdCodec, make_codec
from kvtier.core.keys import ChunkKey
from kvtier.core.layout import DTYPE_BYTES, KVLayout
from kvtier.core.retention import ChunkMeta, tenant_id
from kvtier.core.sealing import Sealer
from kvtier.tools.bench.codecs_inputs import (
    CodecsConfig,
    OutputEffect,
    read_chunk_files,
    synthetic_chunks,
)

GB = 1e9
ENCRYPTION_TARGET = 0.8  # issue 15: an encrypted tier >= 0.8x the same tier in clear
BENCH_SECRET = b"kvtier-bench-codecs-not-a-secret-0123456789"  # a bench's own, never an operator's
BENCH_META = ChunkMeta(tenant=tenant_id("kvtier-bench-tenant"))  # whose chunks are sealed


@dataclass(frozen=True, slots=True)
class CodecFigures:
    """One codec on the measured chunks."""

    codec: str
    lossy: bool
    ratio: float  # stored bytes / payload bytes
    file_ratio: float  # file bytes / a chunk file's bytes stored as is
    capacity_gain: float  # chunks a file tier holds with the codec / without
    compress_gbps: float  # payload GB/s, one thread
    decompress_gbps: float


@dataclass(frozen=True, slots=True)
class SealFigures:
    """One setting's encode/decode (ChunkEncoder) and disk tier put/get GB/s."""

    setting: str  # e.g. "zstd, sealed"
    encode_gbps: float
    decode_gbps: float
    tier_put_gbps: float
    tier_get_gbps: float


@dataclass(slots=True)
class CodecsResult:
    config: CodecsConfig
    source: str  # where the chunks came from
    chunks: int
    chunk_bytes: int
    codecs: list[CodecFigures] = field(default_factory=list)
    sealing: list[SealFigures] = field(default_factory=list)
    fp8_outputs: OutputEffect | None = None
    ttft: list[Any] = field(default_factory=list)  # codecs_ttft.TtftFigures, per codec
    machine: dict[str, Any] = field(default_factory=dict)

    def write_json(self, path: Path) -> None:
        data = asdict(self)
        data["config"] = {k: str(v) if isinstance(v, Path) else v
                          for k, v in data["config"].items()}
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(data, indent=2))


# -- timing ------------------------------------------------------------------------------

def _median_gbps(nbytes: int, trials: int, run: Callable[[], None]) -> float:
    times = []
    for _ in range(trials):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return nbytes / statistics.median(times) / GB


def measure_codec(name: str, codec: Codec, chunks: Sequence[bytes],
                  trials: int) -> CodecFigures:
    views = [memoryview(c) for c in chunks]
    payload = sum(len(c) for c in chunks)
    encoded = [codec.encode(v) for v in views]
    # a chunk that does not shrink is stored as is (ChunkEncoder does the same)
    kept = [min(len(e), len(c)) for e, c in zip(encoded, chunks)]
    out = memoryview(bytearray(len(chunks[0])))

    def encode_all() -> None:
        for v in views:
            codec.encode(v)

    compress = _median_gbps(payload, trials, encode_all)

    def decode_all() -> None:
        for e in encoded:
            codec.decode(memoryview(e), out)

    decompress = _median_gbps(payload, trials, decode_all)
    files = sum(stored_size(k) for k in kept)
    plain_files = sum(stored_size(len(c)) for c in chunks)
    return CodecFigures(name, codec.lossy, sum(kept) / payload, files / plain_files,
                        plain_files / files, compress, decompress)


def measure_codecs(chunks: Sequence[bytes], dtype: str, trials: int,
                   progress: Callable[[str], None]) -> list[CodecFigures]:
    element = DTYPE_BYTES[dtype]
    variants: list[tuple[str, Codec]] = [(n, make_codec(n, dtype)) for n in CODEC_NAMES
                                         if n != "fp8" or dtype in ("bfloat16", "float16")]
    variants += [("zstd, no byte planes", ZstdCodec(element, split=False)),
                 ("lz4, no byte planes", Lz4Codec(element, split=False))]
    figures = []
    for name, codec in variants:
        progress(f"codec {name}")
        figures.append(measure_codec(name, codec, chunks, trials))
    return figures


SETTINGS = (("none", False), ("none", True), ("zstd", False), ("zstd", True))


def measure_sealing(chunks: Sequence[bytes], dtype: str, trials: int, work_dir: Path,
                    progress: Callable[[str], None]) -> list[SealFigures]:
    """ChunkEncoder and a disk tier, in clear and sealed, codec none and zstd. The settings
    take turns within each trial (encode, decode, put, get each), so that the machine's
    drift (other processes) falls on all of them alike; figures are medians over trials."""
    from kvtier.tiers import build_tier
    from kvtier.tiers.storeconfig import StoreConfig

    chunk_bytes = len(chunks[0])
    layout = KVLayout(num_layers=1, num_kv_heads=1, head_size=chunk_bytes // DTYPE_BYTES[dtype],
                      dtype=dtype, tokens_per_chunk=1, kv_factor=1)  # one chunk's bytes
    keys = [ChunkKey(i.to_bytes(16, "big")) for i in range(1, len(chunks) + 1)]
    payload = chunk_bytes * len(chunks)
    views = [memoryview(c) for c in chunks]
    out = memoryview(bytearray(chunk_bytes))
    seconds: dict[tuple[str, bool], dict[str, list[float]]] = {
        s: {"encode": [], "decode": [], "put": [], "get": []} for s in SETTINGS}

    def timed(setting: tuple[str, bool], what: str, run: Callable[[], None]) -> None:
        start = time.perf_counter()
        run()
        seconds[setting][what].append(time.perf_counter() - start)

    with tempfile.TemporaryDirectory(dir=work_dir, prefix="kvtier-bench-codecs-") as tmp:
        secret_file = Path(tmp) / "secret"
        secret_file.write_bytes(BENCH_SECRET)
        secret_file.chmod(0o600)
        encoders, tiers = {}, {}
        for codec, sealed in SETTINGS:
            encoders[codec, sealed] = ChunkEncoder(layout.digest(), dtype, chunk_bytes, codec,
                                                   Sealer(BENCH_SECRET) if sealed else None)
            settings: dict[str, Any] = {"kind": "disk", "path": f"{tmp}/{codec}-{sealed}",
                                        "capacity": 4 * payload + (64 << 20), "codec": codec}
            if sealed:
                settings["encryption_secret_file"] = str(secret_file)
            tiers[codec, sealed] = build_tier(StoreConfig.parse({"tiers": [settings]}).tiers[0],
                                              layout)
        for trial in range(trials):
            progress(f"encryption: trial {trial + 1} of {trials}")
            for setting in SETTINGS:
                encoder, tier = encoders[setting], tiers[setting]
                # (a sealed body lives in the encoding thread's buffer until its next encode)
                encoded = [(item.header, bytes(item.body)) for item in
                           (encoder.encode(k, v, BENCH_META.tenant)
                            for k, v in zip(keys, views))]
                timed(setting, "encode", partial(_encode_all, encoder, keys, views))
                timed(setting, "decode", partial(_decode_all, encoder, keys, encoded,
                                                 layout.digest(), out))
                for k in keys:
                    tier.delete(k)
                timed(setting, "put", partial(_put_all, tier, keys, views))
                timed(setting, "get", partial(_get_all, tier, keys, out))
        for tier in tiers.values():
            tier.close()
    return [SealFigures(f"{codec}, {'sealed' if sealed else 'in clear'}",
                        *(payload / statistics.median(seconds[codec, sealed][what]) / GB
                          for what in ("encode", "decode", "put", "get")))
            for codec, sealed in SETTINGS]


def _encode_all(encoder: ChunkEncoder, keys: Sequence[ChunkKey],
                views: Sequence[memoryview]) -> None:
    for k, v in zip(keys, views):
        encoder.encode(k, v, BENCH_META.tenant)


def _decode_all(encoder: ChunkEncoder, keys: Sequence[ChunkKey],
                encoded: Sequence[tuple[bytes, bytes]], digest: str, out: memoryview) -> None:
    for k, (header, body) in zip(keys, encoded):
        encoder.decode(k, read_header(header, k, digest), memoryview(body), out,
                       BENCH_META.tenant)


def _put_all(tier: Any, keys: Sequence[ChunkKey], views: Sequence[memoryview]) -> None:
    for k, v in zip(keys, views):
        tier.put(k, v, BENCH_META)


def _get_all(tier: Any, keys: Sequence[ChunkKey], out: memoryview) -> None:
    for k in keys:
        if not tier.get_into(k, out, BENCH_META):
            raise RuntimeError(f"bench tier {tier.name}: a chunk did not read back")


def run_codecs_bench(config: CodecsConfig, progress: Callable[[str], None]) -> CodecsResult:
    """Measure (see the module docstring). Raises ConfigError for a bad config or KV dir."""
    config.validate()
    load_before = os.getloadavg()
    effect = None
    if config.kv_dir is not None:
        chunks, digest = read_chunk_files(config.kv_dir, config.max_chunks)
        source = f"chunk files in {config.kv_dir} (layout {digest})"
    elif config.synthetic:
        chunks = synthetic_chunks(min(config.max_chunks, 16))
        source = "synthetic normal bf16 (not KV)"
    else:
        from kvtier.tools.bench.codecs_engine import generate_kv

        progress("running vLLM to produce KV (the generated test model)")
        chunks, effect = generate_kv(config)
        source = ("KV of the generated test model (random weights) run through vLLM: "
                  "UNVERIFIED for trained models")
    result = CodecsResult(config, source, len(chunks), len(chunks[0]), fp8_outputs=effect)
    result.codecs = measure_codecs(chunks, config.dtype, config.trials, progress)
    result.sealing = measure_sealing(chunks, config.dtype, config.trials, config.work_dir,
                                     progress)
    if config.ttft_tokens > 0:
        from kvtier.tools.bench.codecs_ttft import measure_disk_ttft

        result.ttft = measure_disk_ttft(config.ttft_codecs, config.ttft_tokens,
                                        config.ttft_reps, config.work_dir, progress)
    result.machine = {"cpus": os.cpu_count(), "loadavg_before": load_before,
                      "loadavg_after": os.getloadavg()}
    return result
