"""The `kvtier` command: a thin dispatcher over one module per sub-command.

Each module in COMMANDS exposes `register(subparsers)`, which adds its parser and sets
`func(args) -> int` as the default. Modules are imported only when the dispatcher builds its
parser, so a command's heavy dependencies (vllm, matplotlib) load only where they are used.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from kvtier import __version__
from kvtier.errors import ConfigError

# One line per sub-command module, in the order `kvtier --help` lists them.
COMMANDS: tuple[str, ...] = (
    "kvtier.cli.bench",
    "kvtier.cli.plan", "kvtier.cli.audit", "kvtier.cli.doctor",
    "kvtier.cli.simulate",
    "kvtier.cli.serve",
    "kvtier.cli.inspect",
    "kvtier.cli.gc",
    "kvtier.cli.demo",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvtier", description="A tiered KV cache for LLM serving, and its operator tools."
    )
    parser.add_argument("--version", action="version", version=f"kvtier {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMANDS:
        importlib.import_module(name).register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        return int(args.func(args) or 0)
    except ConfigError as exc:
        print(f"kvtier: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
