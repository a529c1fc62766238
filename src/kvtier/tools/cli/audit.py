"""`kvtier audit`: check a `vllm serve` deployment for known KV-cache pitfalls.

Exit codes: 0 no error-level finding, 1 at least one (the first also named on stderr, for
the log of a CI job whose stdout went to a file), 2 bad input.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import textwrap
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from kvtier.errors import ConfigError
from kvtier.integrations.vllm.versions import example_versions
from kvtier.tools.cli.argtypes import MAX_COUNT
from kvtier.tools.ops.audit import (
    AuditOptions,
    Finding,
    Severity,
    all_rules,
    load_deployment,
    run_audit,
)
from kvtier.tools.ops.audit.command import read_text_file
from kvtier.tools.ops.hardware import gpu_profile
from kvtier.tools.ops.modelspec import load_model_spec
from kvtier.tools.ops.vllm_versions import parse_version

_STYLE = {Severity.ERROR: "bold red", Severity.WARNING: "yellow", Severity.INFO: "cyan"}


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "audit", help="check a `vllm serve` command line or manifest for KV-cache pitfalls",
        description="Input: a command line (quoted, or as typed after `--`: kvtier audit "
                    "--json -- vllm serve MODEL --max-model-len 32768), a file holding one, "
                    "or a Kubernetes YAML (container command/args/env). Exit 1 on any "
                    "error-level finding (malformed input included), 2 when the input cannot "
                    "be read.",
        epilog=_options_epilog(), formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", nargs="*",
                        help="command line text or a file; '-' = stdin; after `--`, the "
                             "command line's words as typed")
    parser.add_argument("--env", action="append", default=[], metavar="K=V",
                        help="an environment variable of the server (repeatable)")
    parser.add_argument("--vllm-version", help=f"vLLM release audited, e.g. "
                        f"{example_versions()} (default: the image tag in the input, if any)")
    parser.add_argument("--gpu", default="h100", help="GPU the server runs on (default h100)")
    parser.add_argument("--typical-context", type=_positive_tokens, metavar="TOKENS",
                        help="p95-p99 context length of real traffic (see below)")
    parser.add_argument("--model-config", metavar="CONFIG_JSON",
                        help="the model's config.json (or its folder), for model-specific "
                             "checks (see below)")
    parser.add_argument("--json", action="store_true",
                        help="print findings (with --list-rules, the rules) as JSON")
    parser.add_argument("--list-rules", action="store_true", help="list the rules and exit")
    parser.set_defaults(func=run)


def _options_epilog() -> str:
    """Which rules need or read --typical-context and --model-config, from the registry."""
    rules = all_rules()
    lines = []
    for option in ("--typical-context", "--model-config"):
        needs = [r.id for r in rules if option in r.needs]
        reads = [r.id for r in rules if option in r.reads]
        if needs:
            lines.append(f"{option} is needed by: {', '.join(needs)} (skipped without it)")
        if reads:
            lines.append(f"{option} is read by: {', '.join(reads)} (without it they judge "
                         "the model from its name, or assume the worst)")
    return "\n".join(textwrap.fill(line, 92, subsequent_indent="  ", break_on_hyphens=False)
                     for line in lines)


def _positive_tokens(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of tokens") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: a context length is at least 1 token")
    if value > MAX_COUNT:
        raise argparse.ArgumentTypeError(f"{text!r}: at most {MAX_COUNT} tokens")
    return value


def run(args: argparse.Namespace) -> int:
    """Run the audit; see the module docstring for exit codes."""
    if args.list_rules:
        if args.json:
            print(json.dumps([{"id": r.id, "summary": r.summary, "needs": list(r.needs),
                               "reads": list(r.reads)} for r in all_rules()], indent=2))
            return 0
        for r in all_rules():
            inputs = ", ".join([f"needs {o}" for o in r.needs] + [f"reads {o}" for o in r.reads])
            print(f"{r.id:34} {r.summary}" + (f" [{inputs}]" if inputs else ""))
        return 0
    if not args.source:
        raise ConfigError("source", None, "a command line, a file, or '-' for stdin")
    # Several words: a command line typed after `--` (its quoting as the shell had it).
    given = shlex.join(args.source) if len(args.source) > 1 else args.source[0]
    source = _read_stdin() if given == "-" else given
    # `is not None`: an empty value (`--vllm-version "$TAG"`, the variable unset) is refused,
    # not taken for an option left out
    version = parse_version(args.vllm_version, "--vllm-version") \
        if args.vllm_version is not None else None
    model_config = _read_model_config(args.model_config) \
        if args.model_config is not None else None
    cmd = load_deployment(source, env=_env_pairs(args.env), vllm_version=version,
                          model_config=model_config)
    findings = run_audit(cmd, AuditOptions(gpu=gpu_profile(args.gpu),
                                           typical_context_tokens=args.typical_context))
    errors = [f for f in findings if f.severity is Severity.ERROR]
    if args.json:
        print(json.dumps({"model": cmd.model, "vllm_version": cmd.vllm_version,
                          "findings": [f.to_dict() for f in findings],
                          "ok": not errors}, indent=2))
    else:
        _print_table(findings)
    if errors:
        print(_failure_line(given, errors), file=sys.stderr)
    return 1 if errors else 0


def _failure_line(source: str, errors: list[Finding]) -> str:
    """One line: why the audit of `source` (as given: '-' for stdin) failed, from its first
    error-level finding."""
    shown = source if len(source) <= 60 else source[:57] + "..."
    count = f"{len(errors)} error-level findings; the first, " if len(errors) > 1 else ""
    return " ".join(f"kvtier audit: source {shown!r}: {count}{errors[0].rule}: "
                    f"{errors[0].what}".split())


def _print_table(findings: list[Any]) -> None:
    console = Console(width=max(Console().width, 120))
    if not findings:
        console.print("[green]no findings[/green]")
        return
    table = Table(show_lines=True, title=f"{len(findings)} finding(s)")
    for column in ("severity", "rule", "what", "why", "fix"):
        table.add_column(column, overflow="fold")
    for f in findings:
        table.add_row(f"[{_STYLE[f.severity]}]{f.severity}[/]", f.rule, f.what, f.why, f.fix)
    console.print(table)


def _env_pairs(pairs: list[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for pair in pairs:
        key, eq, value = pair.partition("=")
        if not eq or not key:
            raise ConfigError("--env", pair, "KEY=VALUE")
        out[key] = value
    return out


def _read_stdin() -> str:
    data = sys.stdin.buffer.read() if hasattr(sys.stdin, "buffer") else sys.stdin.read()
    if isinstance(data, str):
        return data
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError("source", "-", f"UTF-8 text on stdin (byte {exc.start} is not)") \
            from exc


def _read_model_config(path: str) -> dict[str, Any]:
    """The model's config.json (`path`, or `path`/config.json for a model folder), checked by
    the reader `kvtier plan` uses (modelspec.load_model_spec).

    Raises:
        ConfigError: naming --model-config when it is unreadable, not JSON, or not a model
            config (e.g. `text_config: 5`).
    """
    try:
        load_model_spec(path)
    except ConfigError as exc:  # "model" is plan's name for the path; others name a key
        allowed = exc.allowed if exc.field == "model" else f"a model config.json ({exc})"
        raise ConfigError("--model-config", path, allowed) from exc
    config = Path(path) / "config.json" if Path(path).is_dir() else Path(path)
    data: dict[str, Any] = json.loads(read_text_file(config, "--model-config"))
    return data
