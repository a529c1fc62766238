"""`kvtier doctor`: check the installation and print the `--kv-transfer-config` vLLM gets.

With no config and no tier flag it checks the installation and the machine (vLLM's build
against the GPUs present, pinned memory, RAM, the default disk tier) and says what to pass
next.

Exit codes: 0 no check failed (warnings and skips included), 1 a check failed, 2 bad input.
"""

from __future__ import annotations

import argparse
import json

from rich.console import Console
from rich.table import Table

from kvtier.errors import ConfigError
from kvtier.integrations.vllm.config import CONNECTOR_MODULE, ConnectorConfig
from kvtier.redaction import redact_text
from kvtier.tools.cli.argtypes import path_and_tier_size, tier_size
from kvtier.tools.ops.doctor import (
    check_store_config,
    machine_doctor,
    read_store,
    run_doctor,
    store_from_flags,
    transfer_config_json,
)
from kvtier.tools.ops.machine import Check

_STYLE = {"ok": "green", "warn": "yellow", "fail": "bold red", "skip": "dim"}


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser("doctor", help="check vLLM, the connector, tier paths and Redis")
    p.add_argument("config", nargs="?", help="kvtier config file (YAML or JSON)")
    # as `kvtier inspect` and `gc` take it: `doctor --config X` was "kvtier: error:
    # unrecognized arguments: --config", from the top-level parser
    p.add_argument("--config", dest="config_option", metavar="CONFIG",
                   help="the same, as inspect and gc take it")
    p.add_argument("--memory", type=tier_size, help="memory tier capacity, e.g. 64GiB")
    p.add_argument("--disk", type=path_and_tier_size, action="append", default=[],
                   metavar="PATH:SIZE")
    p.add_argument("--shared", type=path_and_tier_size, action="append", default=[],
                   metavar="PATH:SIZE")
    p.add_argument("--redis", metavar="URL",
                   help="e.g. redis://10.0.0.5:6379/0, no password: it is read from "
                        "KVTIER_REDIS_PASSWORD or REDIS_PASSWORD (a config file can name "
                        "password_file, TLS and cluster nodes)")
    p.add_argument("--connector-module", default=CONNECTOR_MODULE, help=argparse.SUPPRESS)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run the checks; see the module docstring for exit codes.

    Raises:
        ConfigError: an unreadable or invalid config, a bad tier flag, or a config and tier
            flags at once.
    """
    if args.config_option is not None:
        if args.config is not None:
            raise ConfigError("--config", args.config_option,
                              f"one config file (also given: {args.config})")
        args.config = args.config_option
    flags = [name for name, given in (("--memory", args.memory), ("--disk", args.disk),
                                      ("--shared", args.shared), ("--redis", args.redis))
             if given]
    if args.config is not None and flags:  # the flags were ignored: unchecked, said "ok"
        raise ConfigError("config", args.config, f"a config file alone: {', '.join(flags)} "
                          "would be ignored (a config's tiers are its own: add the tier to "
                          "the file, or check the flags without it)")
    if args.config is not None:  # "" (a variable unset) is refused, not the machine's check
        store = read_store(args.config)
    elif not (args.memory or args.disk or args.shared or args.redis):
        return _run_machine(args.connector_module, args.json)
    else:
        store = store_from_flags(args.memory, tuple(args.disk), tuple(args.shared), args.redis)
        # A bad flag is bad input (exit 2, one line), not a failed check (issue 24).
        ConnectorConfig.parse(store, where="flags")
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
    console = _print_checks(checks)
    if config:
        console.print("vLLM will receive:")
        print(f"--kv-transfer-config '{config}'")
    else:
        console.print("[red]no --kv-transfer-config: the config is invalid (see 'config')[/]")
    return 1 if failed else 0



def _run_machine(connector_module: str, as_json: bool) -> int:
    checks, steps = machine_doctor(connector_module)
    failed = any(c.status == "fail" for c in checks)
    if as_json:
        print(json.dumps({"checks": [{"name": c.name, "status": c.status, "detail": c.detail}
                                     for c in checks], "next": steps, "ok": not failed},
                         indent=2))
        return 1 if failed else 0
    console = _print_checks(checks)
    console.print("no config given: checked the installation and this machine. Next:")
    for step in steps:
        console.print(f"  - {step}", markup=False)
    return 1 if failed else 0


def _print_checks(checks: list[Check]) -> Console:
    console = Console(width=max(Console().width, 120))
    table = Table(title="kvtier doctor")
    for col in ("check", "status", "detail"):
        table.add_column(col, overflow="fold")
    for c in checks:
        table.add_row(c.name, f"[{_STYLE[c.status]}]{c.status}[/]", c.detail)
    console.print(table)
    return console
