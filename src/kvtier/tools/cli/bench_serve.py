"""`kvtier bench prefix-repetition|multi-round|long-doc`: workloads against a serving endpoint.

Any OpenAI-compatible server works (kvtier-served or not); vLLM also reports its prefix-cache
counters on /metrics, which the report diffs. A thin command over kvtier.tools.bench:

    kvtier bench multi-round --url http://127.0.0.1:8000 --users 16 --turns 4
    kvtier bench prefix-repetition --compare http://127.0.0.1:8000 http://127.0.0.1:8001
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
from collections.abc import Callable
from pathlib import Path

import aiohttp
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)

from kvtier.errors import ConfigError
from kvtier.tools.bench.serving.client import ClientConfig, fetch_model
from kvtier.tools.bench.serving.report import summary_table, write_outputs
from kvtier.tools.bench.serving.runner import BenchRun, bench_endpoint
from kvtier.tools.bench.serving.stats import RequestResult
from kvtier.tools.bench.serving.workloads import WORKLOADS, TokenRange, Workload
from kvtier.tools.cli.argtypes import (
    http_url,
    non_negative_int,
    output_dir,
    positive_float,
    positive_int,
)

_NOT_SIZES = ("seed", "token_ids")
DEFAULT_URL = "http://127.0.0.1:8000"


def register(workloads: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    for name, generator in WORKLOADS.items():
        doc = (generator.__doc__ or "").splitlines()[0]
        p = workloads.add_parser(name, help=doc, description=doc)
        sizes = p.add_argument_group("workload sizes")
        for param in inspect.signature(generator).parameters.values():
            if param.name not in _NOT_SIZES:
                sizes.add_argument("--" + param.name.replace("_", "-"), dest=param.name,
                                   type=non_negative_int, default=param.default,
                                   help=f"(default {param.default})")
        _add_common(p)
        p.set_defaults(func=run, generator=generator)


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", type=http_url,
                   help=f"server base URL (default {DEFAULT_URL})")
    p.add_argument("--compare", nargs=2, type=http_url, metavar=("URL_A", "URL_B"),
                   help="run the same workload against two endpoints, one after the other, "
                        "and print B/A ratios")
    p.add_argument("--model", help="model name to send (default: the first the server lists)")
    p.add_argument("--concurrency", type=positive_int, default=4,
                   help="requests in flight (default 4)")
    p.add_argument("--max-requests", type=positive_int, help="send at most this many requests")
    p.add_argument("--duration-s", type=positive_float, help="stop sending after this many seconds")
    p.add_argument("--request-timeout-s", type=positive_float, default=300.0,
                   help="one request's time limit (default 300)")
    p.add_argument("--warmup", type=non_negative_int, default=1,
                   help="short uncounted requests sent first (default 1)")
    p.add_argument("--seed", type=int, default=0, help="prompt RNG seed (default 0)")
    p.add_argument("--token-ids", default="3:500", metavar="LOW:HIGH",
                   help="draw token ids from [LOW, HIGH) (default 3:500; HIGH <= vocab size)")
    p.add_argument("--no-vllm-extras", action="store_true",
                   help="do not send vLLM's ignore_eos/return_token_ids (for other servers)")
    p.add_argument("--out", type=output_dir, default=Path("results/bench-serve"),
                   help="directory for JSON, CSV and PNG (default results/bench-serve)")


# Prompt tokens a workload draws and sends in all, from its sizes (multi-round's history
# grows every turn); more than MAX_PROMPT_TOKENS is a typo (issue 14: `--docs 99999` or
# `--output-len 1e300` would spend minutes building prompts before any request).
_PROMPT_TOKENS: dict[str, Callable[[dict[str, int]], int]] = {
    "prefix-repetition": lambda s: (s["num_prefixes"] * s["prefix_len"]
                                    + s["num_requests"] * (s["prefix_len"] + s["suffix_len"])),
    "multi-round": lambda s: s["users"] * (s["turns"] * s["first_len"] + s["turns"]
                                           * (s["turns"] + 1) // 2
                                           * (s["user_len"] + s["output_len"])),
    "long-doc": lambda s: s["docs"] * s["questions"] * (s["doc_len"] + s["question_len"]),
}
MAX_PROMPT_TOKENS = 20_000_000


def build_workload(args: argparse.Namespace) -> Workload:
    """The workload the arguments describe. Raises ConfigError."""
    sizes = {name: getattr(args, name) for name in inspect.signature(args.generator).parameters
             if name not in _NOT_SIZES}
    name = next((k for k, v in WORKLOADS.items() if v is args.generator), "")
    total = _PROMPT_TOKENS[name](sizes) if name in _PROMPT_TOKENS else 0
    if total > MAX_PROMPT_TOKENS:
        raise ConfigError("workload sizes", sizes,
                          f"at most {MAX_PROMPT_TOKENS:,} prompt tokens in all ({total:,} asked)")
    workload: Workload = args.generator(**sizes, seed=args.seed,
                                        token_ids=TokenRange.parse(args.token_ids))
    return workload


def check_endpoint_options(args: argparse.Namespace) -> None:
    """Refuse what the run would drop: --url beside --compare, an empty --model (`--model
    "$MODEL"`, the variable unset, sent the server's first model). Raises ConfigError."""
    if args.compare and args.url is not None:
        raise ConfigError("--url", args.url, "either --url or --compare URL_A URL_B, not both")
    if args.model is not None and not args.model.strip():
        raise ConfigError("--model", args.model, "a served model's name (leave --model out "
                          "for the first the server lists)")


def _client_config(args: argparse.Namespace, url: str, workload: Workload) -> ClientConfig:
    """Resolve the model (asking the server) and check that the prompts fit its context."""
    try:
        listed, max_len = asyncio.run(fetch_model(url))
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise ConfigError("url", url, f"a reachable OpenAI-compatible server ({exc})") from None
    longest = workload.max_prompt_tokens() + max(t.max_tokens for t in workload.turns)
    if max_len is not None and longest > max_len:
        raise ConfigError("workload sizes", longest,
                          f"prompt + output tokens within the server's max_model_len ({max_len})")
    return ClientConfig(url=url, model=args.model or listed, concurrency=args.concurrency,
                        max_requests=args.max_requests, duration_s=args.duration_s,
                        request_timeout_s=args.request_timeout_s,
                        vllm_extras=not args.no_vllm_extras, warmup_requests=args.warmup)


def run(args: argparse.Namespace) -> int:
    """Entry point of the serving workloads; returns 0, or 1 when a request failed."""
    check_endpoint_options(args)
    workload = build_workload(args)
    urls = list(args.compare) if args.compare else [args.url or DEFAULT_URL]
    labels = ["A", "B"] if args.compare else [urls[0]]
    configs = [_client_config(args, url, workload) for url in urls]
    console = Console()
    runs: list[BenchRun] = []
    total = len(workload.limit(args.max_requests).turns)
    for label, cfg in zip(labels, configs):
        if args.compare:
            console.print(f"{label} = {cfg.url}")
        with Progress(TextColumn(f"{workload.name} {label}"), BarColumn(), MofNCompleteColumn(),
                      TimeElapsedColumn(), console=console, transient=True) as progress:
            task = progress.add_task("requests", total=total)

            def advance(_result: RequestResult, task: TaskID = task) -> None:
                progress.advance(task)

            runs.append(bench_endpoint(workload, cfg, label, on_done=advance))
    console.print(summary_table(runs))
    paths = write_outputs(runs, args.out)
    console.print("wrote " + ", ".join(str(p) for p in paths.values()))
    failed = [r for run in runs for r in run.results if not r.ok]
    if failed:
        console.print(f"[red]{len(failed)} request(s) failed; first: {failed[0].error}[/red]")
        return 1
    return 0
