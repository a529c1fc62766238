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
    """One setting's encode/decode (ChunkEncoder) and disk tier put/get GB/s, and its tier's
    put/get against the same codec's in clear, paired round by round."""

    setting: str  # e.g. "zstd, sealed"
    encode_gbps: float
    decode_gbps: float
    tier_put_gbps: float
    tier_get_gbps: float
    # median over rounds of (in clear's seconds / this setting's) in the same round: 1.0 in
    # clear; the figure ENCRYPTION_TARGET applies to
    tier_put_ratio: float = 1.0
    tier_get_ratio: float = 1.0


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
# Rounds of the encryption figures at least, whatever --trials says (--quick: 1): one takes
# 0.3-0.6 s for 6 chunks of 2 MiB on a loaded 2-core VM, where one round's sealed / in clear
# ratio swung 0.4-3.0x (the medians of 15 rounds' pairs: within +-12% over 4 runs).
MIN_SEALING_ROUNDS = 15
OPS = ("encode", "decode", "put", "get")
Step = Callable[[int], object]  # one op on chunk i


def measure_sealing(chunks: Sequence[bytes], dtype: str, trials: int, work_dir: Path,
                    progress: Callable[[str], None]) -> list[SealFigures]:
    """ChunkEncoder and a disk tier, in clear and sealed, codec none and zstd.

    Each op runs for every setting back to back (`_time_round`), so that the machine's drift
    (other processes, the disk's speed) falls on a sealed setting and its in-clear twin
    alike, in at least MIN_SEALING_ROUNDS rounds after an untimed one (first touches, a fresh
    directory). GB/s are medians over rounds; a sealed / in clear ratio is the median of each
    round's pair (`SealFigures.tier_put_ratio`). Chunk by chunk turns, or each chunk's best
    round, were no steadier on the loaded 2-core VM."""
    from kvtier.tiers import build_tier
    from kvtier.tiers.storeconfig import StoreConfig

    chunk_bytes = len(chunks[0])
    layout = KVLayout(num_layers=1, num_kv_heads=1, head_size=chunk_bytes // DTYPE_BYTES[dtype],
                      dtype=dtype, tokens_per_chunk=1, kv_factor=1)  # one chunk's bytes
    keys = [ChunkKey(i.to_bytes(16, "big")) for i in range(1, len(chunks) + 1)]
    views = [memoryview(c) for c in chunks]
    out = memoryview(bytearray(chunk_bytes))
    rounds = max(trials, MIN_SEALING_ROUNDS)
    seconds: dict[tuple[str, bool], dict[str, list[float]]] = {
        s: {op: [] for op in OPS} for s in SETTINGS}
    with tempfile.TemporaryDirectory(dir=work_dir, prefix="kvtier-bench-codecs-") as tmp:
        secret_file = Path(tmp) / "secret"
        secret_file.write_bytes(BENCH_SECRET)
        secret_file.chmod(0o600)
        steps: dict[tuple[str, bool], dict[str, Step]] = {}
        tiers = []
        for codec, sealed in SETTINGS:
            encoder = ChunkEncoder(layout.digest(), dtype, chunk_bytes, codec,
                                   Sealer(BENCH_SECRET) if sealed else None)
            settings: dict[str, Any] = {"kind": "disk", "path": f"{tmp}/{codec}-{sealed}",
                                        "capacity": 4 * chunk_bytes * len(chunks) + (64 << 20),
                                        "codec": codec}
            if sealed:
                settings["encryption_secret_file"] = str(secret_file)
            tiers.append(build_tier(StoreConfig.parse({"tiers": [settings]}).tiers[0], layout))
            steps[codec, sealed] = _steps(encoder, tiers[-1], keys, views, layout.digest(), out)
        for trial in range(rounds + 1):  # round 0: untimed
            progress(f"encryption: round {trial} of {rounds}")
            for tier in tiers:  # each round puts the chunks anew
                for k in keys:
                    tier.delete(k)
            for op in OPS:
                spent = _time_round({s: steps[s][op] for s in SETTINGS}, len(keys), trial)
                for setting, s in spent.items():
                    if trial:
                        seconds[setting][op].append(s)
        for tier in tiers:
            tier.close()
    return [_seal_figures(codec, sealed, chunk_bytes * len(chunks), seconds)
            for codec, sealed in SETTINGS]


def _steps(encoder: ChunkEncoder, tier: Any, keys: Sequence[ChunkKey],
           views: Sequence[memoryview], digest: str, out: memoryview) -> dict[str, Step]:
    """Each op on chunk i with one setting: encode, decode (of its encoding, made here),
    the tier's put and get."""
    # (a sealed body lives in the encoding thread's buffer until its next encode)
    encoded = [(item.header, bytes(item.body)) for item in
               (encoder.encode(k, v, BENCH_META.tenant) for k, v in zip(keys, views))]

    def decode(i: int) -> None:
        header, body = encoded[i]
        encoder.decode(keys[i], read_header(header, keys[i], digest), memoryview(body), out,
                       BENCH_META.tenant)

    def get(i: int) -> None:
        if not tier.get_into(keys[i], out, BENCH_META):
            raise RuntimeError(f"bench tier {tier.name}: a chunk did not read back")

    return {"encode": lambda i: encoder.encode(keys[i], views[i], BENCH_META.tenant),
            "decode": decode, "put": lambda i: tier.put(keys[i], views[i], BENCH_META),
            "get": get}


def _time_round(steps: dict[tuple[str, bool], Step], chunks: int,
                trial: int) -> dict[tuple[str, bool], float]:
    """Seconds each setting spent on one op over every chunk, one setting after another,
    the order reversed every other round: neither of a pair always goes first (a warm
    cache, the disk's speed after the other's writes)."""
    spent = dict.fromkeys(steps, 0.0)
    order = list(steps) if trial % 2 == 0 else list(reversed(steps))
    for setting in order:
        step = steps[setting]
        start = time.perf_counter()
        for i in range(chunks):
            step(i)
        spent[setting] = time.perf_counter() - start
    return spent


def _seal_figures(codec: str, sealed: bool, payload: int,
                  seconds: dict[tuple[str, bool], dict[str, list[float]]]) -> SealFigures:
    mine, clear = seconds[codec, sealed], seconds[codec, False]

    def paired(op: str) -> float:
        return statistics.median(c / m for c, m in zip(clear[op], mine[op], strict=True))

    encode, decode, put, get = (payload / statistics.median(mine[op]) / GB for op in OPS)
    return SealFigures(f"{codec}, {'sealed' if sealed else 'in clear'}", encode, decode, put,
                       get, paired("put"), paired("get"))


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
