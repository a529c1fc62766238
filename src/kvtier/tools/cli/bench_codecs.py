"""`kvtier bench codecs`: compression ratio, GB/s and capacity gain of each codec on real KV,
and what encryption at rest costs against the same tier in clear, in one run. A thin command
over `kvtier.tools.bench.codecs` (the engine half, which imports vLLM, only when it runs)."""

from __future__ import annotations

import argparse
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from rich.table import Table

from kvtier.tools.cli.argtypes import (
    any_path,
    non_negative_int,
    output_file,
    positive_int,
    work_dir,
)
from kvtier.tools.cli.bench import given_or, run_and_report


def register(workloads: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = workloads.add_parser(
        "codecs", help="codec ratio, GB/s and capacity gain on real KV; encryption cost",
        description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--kv-dir", type=any_path,
                        help="measure the chunk files of this kvtier disk/shared directory "
                             "(default: run the generated bench model through vLLM)")
    source.add_argument("--synthetic", action="store_true",
                        help="normal-distributed bf16 instead of KV (no engine; a smoke test)")
    parser.add_argument("--dtype", default="bfloat16",
                        help="KV dtype of --kv-dir's chunks (the generated and the synthetic "
                             "ones are bfloat16)")
    parser.add_argument("--prompts", type=positive_int,
                        help="prompts the engine runs (8)")
    parser.add_argument("--prompt-tokens", type=positive_int, default=640,
                        help="tokens a prompt (640)")
    parser.add_argument("--max-chunks", type=positive_int, help="chunks measured (64)")
    parser.add_argument("--trials", type=positive_int, help="timed passes (median; 3)")
    parser.add_argument("--dir", type=work_dir, default=Path("."),
                        help="where the temporary tiers go (the filesystem measured)")
    parser.add_argument("--ttft", type=non_negative_int, default=0, metavar="TOKENS",
                        help="also time a disk-tier hit of TOKENS cached tokens with codecs "
                             "none, zstd, lz4 (one engine each; e.g. 4096)")
    parser.add_argument("--ttft-reps", type=positive_int, default=5,
                        help="timed hits per codec (5)")
    parser.add_argument("--quick", action="store_true",
                        help="2 prompts, 8 chunks, 1 trial (unless given)")
    parser.add_argument("--json", type=output_file, default=Path("results/bench-codecs.json"),
                        help="where to write the results (default results/bench-codecs.json)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvtier.tools.bench.codecs import run_codecs_bench
    from kvtier.tools.bench.codecs_inputs import CodecsConfig

    config = CodecsConfig(kv_dir=args.kv_dir, synthetic=args.synthetic, dtype=args.dtype,
                          prompts=given_or(args.prompts, args.quick, 2, 8),
                          prompt_tokens=args.prompt_tokens,
                          max_chunks=given_or(args.max_chunks, args.quick, 8, 64),
                          trials=given_or(args.trials, args.quick, 1, 3), work_dir=args.dir,
                          ttft_tokens=args.ttft, ttft_reps=args.ttft_reps)
    config.validate()
    run_and_report("codecs", lambda progress: run_codecs_bench(config, progress), render,
                   lambda r: r.write_json(args.json), args.json)
    return 0


def render(result: Any) -> Iterable[Any]:
    from kvtier.tools.bench.codecs import ENCRYPTION_TARGET, MIN_SEALING_ROUNDS

    codecs = Table(title=f"codecs on {result.chunks} chunks of {result.chunk_bytes / 2**20:.2f} "
                         f"MiB: {result.source}; one thread, median of "
                         f"{result.config.trials}")
    for name in ("codec", "stored / payload", "file / file as is", "capacity gain",
                 "compress GB/s", "decompress GB/s"):
        codecs.add_column(name, justify="left" if name == "codec" else "right")
    for c in result.codecs:
        codecs.add_row(c.codec + (" [red](LOSSY)[/red]" if c.lossy else ""), f"{c.ratio:.3f}",
                       f"{c.file_ratio:.3f}", f"{c.capacity_gain:.2f}x",
                       f"{c.compress_gbps:.2f}", f"{c.decompress_gbps:.2f}")
    yield codecs
    rounds = max(result.config.trials, MIN_SEALING_ROUNDS)
    sealing = Table(title="encryption at rest (AES-256-GCM): encoder and a disk tier, medians "
                          f"of {rounds} rounds; ratios: sealed / in clear, paired round by "
                          f"round (target >= {ENCRYPTION_TARGET}x)")
    for name in ("setting", "encode GB/s", "decode GB/s", "tier put GB/s", "tier get GB/s",
                 "put ratio", "get ratio"):
        sealing.add_column(name, justify="left" if name == "setting" else "right")
    for s in result.sealing:
        sealing.add_row(s.setting, f"{s.encode_gbps:.2f}", f"{s.decode_gbps:.2f}",
                        f"{s.tier_put_gbps:.2f}", f"{s.tier_get_gbps:.2f}",
                        f"{s.tier_put_ratio:.2f}x", f"{s.tier_get_ratio:.2f}x")
    yield sealing
    effect = result.fp8_outputs
    if effect is not None:
        yield (f"fp8 (LOSSY) hits vs exact KV over {effect.prompts} prompts: "
               f"{effect.identical_prompts}/{effect.prompts} identical outputs, token "
               f"agreement {effect.token_agreement:.1%}, |logprob delta| of agreeing tokens "
               f"mean {effect.logprob_delta_mean:.4f} max {effect.logprob_delta_max:.4f}")
    if result.ttft:
        ttft = Table(title="disk-tier hit TTFT per codec (RAM tier of two chunks in front; "
                           "medians; extra = kvtier hit - vLLM's own prefix hit, paired)")
        for name in ("codec", "cached tokens", "disk MiB", "kvtier hit ms", "vLLM hit ms",
                     "extra ms", "vs none"):
            ttft.add_column(name, justify="left" if name == "codec" else "right")
        base = result.ttft[0]
        for t in result.ttft:
            ttft.add_row(t.codec, str(t.tokens), f"{t.file_bytes / 2**20:.1f}",
                         f"{t.hit_s * 1e3:.1f}", f"{t.prefix_s * 1e3:.1f}",
                         f"{t.extra_s * 1e3:.1f}", f"{t.hit_s / base.hit_s:.2f}x")
        yield ttft
    m = result.machine
    yield (f"load average {m['loadavg_before'][0]:.2f} -> {m['loadavg_after'][0]:.2f} on "
           f"{m['cpus']} CPUs")
