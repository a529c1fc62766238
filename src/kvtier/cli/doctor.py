"""`kvtier doctor`: check the installation and print the `--kv-transfer-config` vLLM gets.

Exit codes: 0 every check passed or was skipped, 1 a check failed, 2 bad input.
"""

from __future__ import annotations

import argparse
import json

from rich.console import Console
from rich.table import Table

from kvtier.integrations.vllm.config import CONNECTOR_MODULE
from kvtier.ops.doctor import (
    check_store_config,
    read_store,
    run_doctor,
    store_from_flags,
    transfer_config_json,
)
from kvtier.redaction import redact_text

_STYLE = {"ok": "green", "fail": "bold red", "skip": "dim"}


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser("doctor", help="check vLLM, the connector, tier paths and Redis")
    p.add_argument("config", nargs="?", help="kvtier config file (YAML or JSON)")
    p.add_argument("--memory", help="memory tier capacity, e.g. 64GiB")
    p.add_argument("--disk", action="append", default=[], metavar="PATH:SIZE")
    p.add_argument("--shared", action="append", default=[], metavar="PATH:SIZE")
    p.add_argument("--redis", metavar="URL",
                   help="e.g. redis://10.0.0.5:6379/0, no password: it is read from "
                        "KVTIER_REDIS_PASSWORD or REDIS_PASSWORD (a config file can name "
                        "password_file, TLS and cluster nodes)")
    p.add_argument("--connector-module", default=CONNECTOR_MODULE, help=argparse.SUPPRESS)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run the checks; see the module docstring for exit codes."""
    if args.config:
        store = read_store(args.config)
    else:
        store = store_from_flags(args.memory, tuple(args.disk), tuple(args.shared), args.redis)
    checks = run_doctor(store, args.connector_module)
    valid = check_store_config(store).status == "ok"
    # Valid configs hold no credential (a password in a URL is refused); redacted anyway,
    # as everything doctor prints (issue 12, item 8).
    config = redact_text(transfer_config_json(store)) if valid else None
    failed = any(c.status == "fail" for c in checks)
    if args.json:
        print(json.dumps({"checks": [{"name": c.name, "status": c.status, "detail": c.detail}
                                     for c in checks],
                          "kv_transfer_config": json.loads(config) if config else None,
                          "ok": not failed}, indent=2))
        return 1 if failed else 0
    console = Console(width=max(Console().width, 120))
    table = Table(title="kvtier doctor")
    for col in ("check", "status", "detail"):
        table.add_column(col, overflow="fold")
    for c in checks:
        table.add_row(c.name, f"[{_STYLE[c.status]}]{c.status}[/]", c.detail)
    console.print(table)
    if config:
        console.print("vLLM will receive:")
        print(f"--kv-transfer-config '{config}'")
    else:
        console.print("[red]no --kv-transfer-config: the config is invalid (see 'config')[/]")
    return 1 if failed else 0

