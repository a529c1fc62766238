"""`kvtier warm URL [FILE ...] [--jsonl FILE ...]`: pre-load prompts' KV into kvtier.

Each prompt (a text file, or a line of a JSONL file) is sent to the vLLM server at URL as a
`max_tokens=1` completion with `kv_transfer_params` {retain_s, ttl_s} and the `cache_salt`
asked (kvtier.tools.ops.warmup); a progress bar runs meanwhile and a table says what each prompt
stored. The salt is read from an environment variable (`--cache-salt-env`) so that it never
shows in a process list; `--cache-salt` is accepted for convenience.

Exit codes: 0 every prompt warmed, 1 some prompt failed or the server is unusable, 2 bad input.
"""

from __future__ import annotations

import argparse
import os
import sys

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from kvtier.errors import ConfigError, WarmupError
from kvtier.integrations.vllm.config import MAX_REQUEST_DURATION_S
from kvtier.tools.cli.argtypes import any_path, http_url, positive_float
from kvtier.tools.ops.warmup import (
    WarmResult,
    WarmSettings,
    api_base,
    load_prompts,
    served_model,
    warm,
)


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "warm", help="pre-load documents / system prompts into kvtier through a vLLM server",
        description="Send each prompt as a max_tokens=1 completion so that kvtier stores its "
                    "KV (pinned for --retain-s, expiring after --ttl-s) before traffic comes.")
    p.add_argument("url", type=http_url, help="the vLLM server (OpenAI API) with kvtier, e.g. "
                               "http://127.0.0.1:8000")
    p.add_argument("files", nargs="*", type=any_path, help="text files, one prompt each")
    p.add_argument("--jsonl", action="append", type=any_path, default=[], metavar="FILE",
                   help='JSONL of prompts: {"prompt": "..."} or {"prompt_token_ids": [...]}, '
                        'optionally "name" and "cache_salt" (repeatable)')
    p.add_argument("--model", help="served model name (default: the server's first model)")
    p.add_argument("--retain-s", type=request_seconds,
                   help="pin the prompts' chunks this many seconds (LRU never evicts them)")
    p.add_argument("--ttl-s", type=request_seconds,
                   help="the prompts' chunks expire this many seconds after being stored")
    p.add_argument("--cache-salt-env", metavar="VAR",
                   help="read the tenant's cache_salt from this environment variable")
    p.add_argument("--cache-salt", help="the tenant's cache_salt (visible in process lists: "
                                        "prefer --cache-salt-env)")
    p.add_argument("--timeout-s", type=positive_float, default=600.0,
                   help="per request (default 600)")
    # Files may follow the options (`kvtier warm URL --model m FILE`): main parses intermixed.
    p.set_defaults(func=run, intermixed_parser=p)


def request_seconds(text: str) -> float:
    """A request's retain_s / ttl_s: > 0 and below MAX_REQUEST_DURATION_S, which the engine
    would log and ignore: the prompts were stored unpinned, and warm reported the pin it
    sent."""
    value = positive_float(text)
    if value >= MAX_REQUEST_DURATION_S:
        raise argparse.ArgumentTypeError(
            f"{text!r}: below {MAX_REQUEST_DURATION_S:g} seconds (the engine ignores more)")
    return value


def run(args: argparse.Namespace) -> int:
    salt = args.cache_salt
    # `is not None`: an empty value (`--cache-salt "$SALT"`, the variable unset) is refused,
    # not taken for an option left out (the prompts were warmed outside the tenant)
    if salt is not None and args.cache_salt_env is not None:
        raise ConfigError("--cache-salt", "...", "either --cache-salt or --cache-salt-env, "
                          "not both")
    if salt == "":
        raise ConfigError("--cache-salt", salt, "a non-empty salt (the tenant's cache_salt)")
    if args.model is not None and not args.model.strip():
        raise ConfigError("--model", args.model, "a served model's name (leave --model out "
                          "for the server's first model)")
    if args.cache_salt_env is not None:
        salt = os.environ.get(args.cache_salt_env)
        if not salt:
            raise ConfigError("--cache-salt-env", args.cache_salt_env,
                              "the name of a set, non-empty environment variable")
    prompts = load_prompts(args.files, args.jsonl)
    try:  # before the progress bar: a server that is down is one line, nothing else
        model = args.model or served_model(api_base(args.url), args.timeout_s)
    except WarmupError as exc:
        print(f"kvtier warm: {exc}", file=sys.stderr)
        return 1
    settings = WarmSettings(url=args.url, model=model, retain_s=args.retain_s,
                            ttl_s=args.ttl_s, cache_salt=salt, timeout_s=args.timeout_s)
    console = Console(stderr=True)
    progress = Progress(TextColumn("warming"), BarColumn(), MofNCompleteColumn(),
                        TimeElapsedColumn(), TextColumn("{task.description}"),
                        console=console, transient=True)
    with progress:
        task = progress.add_task("", total=len(prompts))

        def advance(result: WarmResult) -> None:
            progress.update(task, advance=1, description=result.name)

        try:
            results = warm(settings, prompts, on_result=advance)
        except WarmupError as exc:
            progress.stop()
            print(f"kvtier warm: {exc}", file=sys.stderr)
            return 1
    Console(width=max(Console().width, 100)).print(_table(results, settings))
    failed = [r for r in results if not r.ok]
    for result in failed:
        print(f"kvtier warm: {result.name}: {result.error}", file=sys.stderr)
    return 1 if failed else 0


def _table(results: list[WarmResult], settings: WarmSettings) -> Table:
    asked = ", ".join(f"{k}={v:g}" for k, v in (("retain_s", settings.retain_s),
                                                 ("ttl_s", settings.ttl_s)) if v is not None)
    table = Table(title=f"kvtier warm {settings.url}" + (f" ({asked})" if asked else ""))
    for column in ("prompt", "prompt tokens", "stored tokens", "held already", "seconds",
                   "status"):
        table.add_column(column, justify="left" if column in ("prompt", "status") else "right")

    def num(value: int | None) -> str:
        return "?" if value is None else str(value)

    for r in results:
        table.add_row(r.name, num(r.prompt_tokens), num(r.stored_tokens), num(r.loaded_tokens),
                      f"{r.seconds:.2f}", "ok" if r.ok else "[red]failed[/]")
    if len(results) > 1:
        def total(values: list[int | None]) -> str:
            return "?" if any(v is None for v in values) else str(sum(v or 0 for v in values))

        table.add_row("[bold]total[/]", total([r.prompt_tokens for r in results]),
                      total([r.stored_tokens for r in results]),
                      total([r.loaded_tokens for r in results]),
                      f"{sum(r.seconds for r in results):.2f}",
                      f"{sum(r.ok for r in results)}/{len(results)} ok")
    return table
