"""The `kvtier` command: a thin dispatcher over one module per sub-command.

Each module in COMMANDS exposes `register(subparsers)`, which adds its parser and sets
`func(args) -> int` as the default. Modules are imported only when the dispatcher builds its
parser, so a command's heavy dependencies (vllm, matplotlib) load only where they are used.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import logging
import os
import signal
import sys
import threading
from collections.abc import Iterator

from kvtier import __version__
from kvtier.errors import ConfigError

# One line per sub-command module, in the order `kvtier --help` lists them.
COMMANDS: tuple[str, ...] = (
    "kvtier.tools.cli.bench",
    "kvtier.tools.cli.plan", "kvtier.tools.cli.audit", "kvtier.tools.cli.doctor",
    "kvtier.tools.cli.simulate",
    "kvtier.tools.cli.serve",
    "kvtier.tools.cli.node",
    "kvtier.tools.cli.warm",
    "kvtier.tools.cli.proxy",
    "kvtier.tools.cli.inspect",
    "kvtier.tools.cli.gc",
    "kvtier.tools.cli.demo",
)


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The whole parser; with `only`, one command's module is imported and the others get an
    empty placeholder (`kvtier simulate` need not import the benchmarks' numpy, pydantic and
    aiohttp: 55 MiB and seconds of start-up, issue 14)."""
    parser = argparse.ArgumentParser(
        prog="kvtier", description="A tiered KV cache for LLM serving, and its operator tools."
    )
    parser.add_argument("--version", action="version", version=f"kvtier {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMANDS:
        command = name.rsplit(".", 1)[1]  # each module registers the command of its name
        if only is None or only == command:
            importlib.import_module(name).register(subparsers)
        else:
            subparsers.add_parser(command)
    return parser


# The tools' own dependencies (pyproject's `tools` extra): the cache runs without them.
TOOLS_DEPENDENCIES = frozenset({"rich", "matplotlib", "aiohttp"})

# Exit status after stdout's reader went away (`kvtier audit --json | head`): 128 + SIGPIPE,
# what a shell reports for a command killed by the broken pipe.
EXIT_BROKEN_PIPE = 141
# Exit status after Ctrl-C: 128 + SIGINT, as a shell reports it (and `kvtier demo` returns).
EXIT_INTERRUPTED = 130
# Signals that end a command as Ctrl-C does, through its `with` blocks and `finally`s (its
# scratch directories, servers, redis-server): Python's default for them ends the process
# where it stands (`kvtier bench storage` stopped by SIGTERM left its .kvtier-bench-*).
ENDING_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


def main(argv: list[str] | None = None) -> int:
    """Run one sub-command; returns its exit status.

    Bad input is one line on stderr and status 2: a ConfigError anywhere, and a ValueError
    (UnicodeDecodeError included), which in these commands comes from converting what the
    user gave. Ctrl-C is one line and status 130. Other exceptions are bugs and keep their
    traceback; `-v` shows the traceback of a ValueError and of Ctrl-C too.
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    # A value that is not UTF-8 (surrogate-escaped in argv) is echoed escaped, not as an
    # UnicodeEncodeError half-way through the output (issue 24).
    reconfigure = getattr(sys.stdout, "reconfigure", None)
    if reconfigure is not None:
        reconfigure(errors="backslashreplace")
    try:
        parser = build_parser(_command_in(argv))
    except ModuleNotFoundError as exc:
        if exc.name not in TOOLS_DEPENDENCIES:
            raise
        print(f"kvtier: the operator tools need {exc.name}, which is not installed: "
              "pip install 'kvtier[tools]'", file=sys.stderr)
        return 2
    _refuse_double_dash_values(parser, argv)
    args, unknown = parser.parse_known_args(argv)
    if unknown and getattr(args, "intermixed_parser", None) is not None:
        args, unknown = _parse_intermixed(args, argv)
    if unknown:
        hint = ("; a command line to audit goes in quotes or after `--`: kvtier audit -- "
                "vllm serve MODEL --flag ..." if args.command == "audit" else "")
        parser.error(f"unrecognized arguments: {' '.join(unknown)}{hint}")
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        code = _run_command(args)
        sys.stdout.flush()  # a broken pipe shows here when the output was buffered
        return code
    except ConfigError as exc:
        print(f"kvtier: {_one_line(exc)}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        _silence_stdout()
        return EXIT_BROKEN_PIPE
    except KeyboardInterrupt:
        # Ctrl-C is the user's choice, not a bug: one line, the shell's status for SIGINT.
        # The commands' `with` blocks and `finally`s have run by now (temp dirs, servers).
        if args.verbose:
            raise
        print(f"kvtier {args.command}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except ValueError as exc:
        if args.verbose:
            raise
        print(f"kvtier {args.command}: invalid input: {_one_line(exc)} (-v for details)",
              file=sys.stderr)
        return 2


def _run_command(args: argparse.Namespace) -> int:
    """`args.func` while ending signals end it (`_signals_end_the_command`). A signal's
    SystemExit that a library wrapped in an error of its own still ends the command with the
    signal's status: pydantic, building a validator as a lazily imported tier's module loaded
    when SIGTERM came, raised a SchemaError, a traceback (CI, 47th session)."""
    with _signals_end_the_command() as ending:
        try:
            return int(args.func(args) or 0)
        except Exception:
            if ending is not None and ending.status is not None:
                raise SystemExit(ending.status) from None
            raise


@contextlib.contextmanager
def _signals_end_the_command() -> Iterator[_EndOnce | None]:
    """While the command runs, SIGTERM and SIGHUP raise SystemExit(128 + the signal), the
    status a shell reports for a process they killed: the command's clean-up runs. A signal
    ignored already stays ignored (`nohup kvtier bench ...`), and the caller's handlers are
    back afterwards (tests call `main` in their own process). Only in the main thread, where
    Python delivers signals. The first such signal ends the command; the rest are ignored
    until it has (`_EndOnce`)."""
    if threading.current_thread() is not threading.main_thread():
        yield None
        return
    end_once = _EndOnce()
    saved = {sig: signal.signal(sig, end_once) for sig in ENDING_SIGNALS
             if signal.getsignal(sig) is not signal.SIG_IGN}
    try:
        yield end_once
    finally:
        for sig, handler in saved.items():  # None: one set outside Python, as the default
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)


class _EndOnce:
    """The handler of the ending signals while a command runs: the first raises
    SystemExit(128 + the signal); the rest do nothing. One more (a terminal's SIGHUP after a
    service manager's SIGTERM, a second SIGTERM) raised again inside the clean-up the first
    started, and left its scratch, servers and temp dirs. (Not SIG_IGN from the handler: a
    signal already pending then is reported by Python as a traceback on stderr.)"""

    def __init__(self) -> None:
        self.status: int | None = None  # 128 + the signal that ended the command

    def __call__(self, signum: int, _frame: object) -> None:
        if self.status is None:
            self.status = 128 + signum
            raise SystemExit(self.status)


def _command_in(argv: list[str]) -> str | None:
    """The command `argv` names (its first word that is not an option), if it is one; None
    otherwise, so that --help, no command and a typo get the whole parser."""
    first = next((a for a in argv if not a.startswith("-")), None)
    names = {name.rsplit(".", 1)[1] for name in COMMANDS}
    help_asked = any(a in ("-h", "--help") for a in argv[:argv.index(first)]) if first else True
    return first if first in names and not help_asked else None


def _parse_intermixed(args: argparse.Namespace,
                      argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """Parse again the words after the command with its own parser's
    `parse_known_intermixed_args`, for a command that sets `intermixed_parser` (`kvtier warm
    URL --model m FILE`): a plain parse fills a `nargs="*"` positional before the options and
    leaves the files after them unrecognized. The top parser cannot parse intermixed (it has
    sub-commands), and a fresh namespace keeps an `append` option from counting twice."""
    sub: argparse.ArgumentParser = args.intermixed_parser
    at = argv.index(args.command)  # the top parser's options (-v) take no value
    fresh = argparse.Namespace(verbose=args.verbose, command=args.command)
    return sub.parse_known_intermixed_args(argv[at + 1:], namespace=fresh)


def _refuse_double_dash_values(parser: argparse.ArgumentParser, argv: list[str]) -> None:
    """Exit 2 on `--flag=--`: argparse (CPython < 3.12) drops the "--" and hands the
    command an empty list instead of calling the flag's type, which then crashes."""
    for token in argv:
        if token == "--":
            return  # the rest is positional (or passed on, e.g. to `vllm serve`)
        name, eq, value = token.partition("=")
        if eq and value == "--" and name.startswith("--"):
            parser.error(f"argument {name}: expected a value, got '--'")


def _one_line(exc: Exception) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= 500 else text[:497] + "..."


def _silence_stdout() -> None:
    """Point stdout at /dev/null so the interpreter's final flush does not raise again
    (the recipe in Python's `signal` documentation, "Note on SIGPIPE")."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError, io.UnsupportedOperation):
        pass  # stdout is not a real file (a test's capture): nothing will flush it


if __name__ == "__main__":
    sys.exit(main())
