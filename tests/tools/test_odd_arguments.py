"""Odd argument values never make the CLI crash, hang or fail silently (issues 14 and 24).

The commands, their sub-commands (`kvtier bench storage`, ...) and every argument that takes
a value are read from the parser itself (`build_parser()`), so a new command, workload or
option is fed too. Each such argument gets a few odd values chosen by what it takes (its
`type`, `choices`, `nargs`): an empty string, "--", a negative number, NaN and infinity, a
300-digit number, non-UTF-8 bytes (as Python hands them over: surrogate-escaped) and odd
unicode, a path that does not exist, a directory where a file is written, a file where a
directory is wanted. One argument is odd at a time; the rest is a command line that works
(BASE_OPTIONS, BASE_POSITIONALS).

Each run (in process, `main(argv)`, under a time limit) must end in one of:
- status 2 or 1 with a one-line error that names the argument or its value (argparse's
  "error: argument --x: ...", kvtier's "kvtier: invalid config x=...", "kvtier CMD: invalid
  input: ..."): a command that fails on every input without saying why does not pass;
- status 0, or arriving where the command starts its work (a server, an engine, a
  measurement, a request: replaced by a stop, WORK), when the value is acceptable. A value
  that never is (NaN for a count, a directory where a file is written: `must_refuse`) must be
  refused before any work starts.
Never a traceback, never a hang.
"""

from __future__ import annotations

import argparse
import atexit
import importlib
import io
import json
import shlex
import shutil
import signal
import tempfile
import traceback
from collections.abc import Iterator
from contextlib import contextmanager, redirect_stderr, redirect_stdout
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtier.node.cli import listen_host as node_listen_host
from kvtier.tools.cli import argtypes
from kvtier.tools.cli.main import EXIT_BROKEN_PIPE, build_parser, main

pytestmark = pytest.mark.slow  # some 1,800 runs of the CLI: not in the fast lane

CONFIG = str(Path(__file__).parents[1] / "data" / "configs" / "llama-3-8b.json")
SECONDS_PER_RUN = 20  # generous: a hang on odd input is a finding too

# Every run happens in WORKDIR (the commands' default output paths, results/..., land there).
WORKDIR = Path(tempfile.mkdtemp(prefix="kvtier-odd-"))
# Made at import, so also when the module is collected and not run: removed at exit either way
# (every run of the suite once left one in /tmp).
atexit.register(shutil.rmtree, WORKDIR, ignore_errors=True)
(WORKDIR / "results").mkdir()
STORE = WORKDIR / "store.json"
STORE.write_text(json.dumps({"tiers": [{"kind": "disk", "path": str(WORKDIR / "disk"),
                                         "capacity": "64MiB"}]}))
(WORKDIR / "disk").mkdir()  # a tier's missing directory is reported, status 1 (inspect, gc)
NODE_STORE = WORKDIR / "node.json"  # a node's tiers begin with RAM
NODE_STORE.write_text(json.dumps({"tiers": [{"kind": "memory", "capacity": "1MiB"}]}))
PROMPT = WORKDIR / "prompt.txt"
PROMPT.write_text("a prompt to warm")
A_DIRECTORY = str(WORKDIR / "a-directory")
Path(A_DIRECTORY).mkdir()
A_FILE = str(WORKDIR / "not-a-directory.bin")
Path(A_FILE).write_bytes(b"\xff\x00binary")
MISSING = "/nonexistent-kvtier/x/y"
NOBODY_LISTENS = "http://127.0.0.1:9"  # the discard port
TRACE = WORKDIR / "trace.jsonl"  # two requests of a Mooncake-format trace, one shared block
TRACE.write_text('{"timestamp": 0, "input_length": 1024, "hash_ids": [1, 2]}\n'
                 '{"timestamp": 5, "input_length": 1024, "hash_ids": [1, 3]}\n')

# A working command line per command (its required arguments, and what keeps it short:
# `serve --dry-run`, `gc --dry-run`, five simulated requests). A command not listed gets none.
BASE_OPTIONS: dict[tuple[str, ...], list[str]] = {
    ("plan",): ["--vllm-version=0.21.0", "--node-engines=2"],  # the --node-* options too
    ("simulate",): ["--requests=5", "--json"],
    ("inspect",): [f"--config={STORE}"],
    ("gc",): [f"--config={STORE}", "--dry-run"],
    ("serve",): ["--dry-run"],
    ("node", "serve"): [f"--config={NODE_STORE}"],
    ("proxy",): [f"--prefill={NOBODY_LISTENS}", f"--decode={NOBODY_LISTENS}"],
}
BASE_POSITIONALS: dict[tuple[str, ...], dict[str, str]] = {
    ("plan",): {"model": CONFIG},
    ("audit",): {"source": "vllm serve m"},
    ("serve",): {"model": "m"},
    ("warm",): {"url": NOBODY_LISTENS, "files": str(PROMPT)},
    ("bench", "trace"): {"trace": str(TRACE)},
}

# Where each command module starts its work: replaced by `_stop`. A module with
# `run_and_report` (the in-process benchmarks) stops there; the others are listed, with an
# empty tuple for those that only compute (their BASE keeps them short).
WORK: dict[str, tuple[str, ...]] = {
    "kvtier.tools.cli.bench_storage": ("run_bench",),
    "kvtier.tools.cli.bench_serve": ("bench_endpoint",),
    "kvtier.tools.cli.serve": ("VllmServer",),
    "kvtier.tools.cli.warm": ("served_model", "warm"),
    "kvtier.tools.cli.proxy": ("run_proxy",),
    "kvtier.tools.cli.demo": ("run_demo", "run_node_demo"),
    "kvtier.tools.cli.plan": (),
    "kvtier.tools.cli.audit": (),
    "kvtier.tools.cli.simulate": (),
    "kvtier.tools.cli.inspect": (),
    "kvtier.tools.cli.gc": (),
    "kvtier.tools.cli.doctor": (),  # its two child-process probes are stubbed (_quick_doctor)
    "kvtier.node.cli": ("NodeServer",),  # `kvtier node serve` (the node's own serve)
    "kvtier.tools.cli.node": (),  # `kvtier node status`: no node answers at an odd socket
}


class _WorkStarts(Exception):
    """Raised where a command would start its work."""


def _stop(*args: object, **kwargs: object) -> None:
    raise _WorkStarts


async def _a_served_model(url: str) -> tuple[str, int | None]:
    """`bench <workload>` asks the server for its model before it starts: any server serves
    "m" here (the URL is checked before, by its type)."""
    return "m", None


def _work_of(module: str) -> tuple[str, ...]:
    if module in WORK:
        return WORK[module]
    return ("run_and_report",) if hasattr(importlib.import_module(module),
                                         "run_and_report") else ()


# --- the commands and their arguments, from the parser ---

def _subparsers(parser: argparse.ArgumentParser) -> argparse._SubParsersAction | None:
    return next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)


def leaf_commands() -> dict[tuple[str, ...], argparse.ArgumentParser]:
    """Every command that runs something (`plan`, `bench storage`, ...) and its parser."""
    leaves: dict[tuple[str, ...], argparse.ArgumentParser] = {}

    def walk(path: tuple[str, ...], parser: argparse.ArgumentParser) -> None:
        sub = _subparsers(parser)
        if sub is None:
            leaves[path] = parser
            return
        for name, child in sub.choices.items():
            walk((*path, name), child)

    walk((), build_parser())
    return leaves


COMMANDS = leaf_commands()


def takes_value(action: argparse.Action) -> bool:
    return action.nargs != 0 and action.nargs != argparse.REMAINDER and not isinstance(
        action, (argparse._HelpAction, argparse._VersionAction, argparse._SubParsersAction))


# --- odd values, by what an argument takes ---

HUGE = "1" * 300
NON_UTF8 = b"\xff\xfe".decode("utf-8", "surrogateescape")  # what argv bytes ff fe become
ODD_UNICODE = "\u202e\uff11"  # a right-to-left override, a full-width digit one
PATH_TYPES = {argtypes.any_path, argtypes.path_text, argtypes.output_file,
              argtypes.output_dir, argtypes.work_dir}
# A listen address: "" would bind every interface (vLLM binds `args.host or ""`).
LISTEN_TYPES = {argtypes.listen_host, node_listen_host}


@dataclass(frozen=True)
class Odd:
    value: str
    must_refuse: bool  # no reading of the argument accepts it


def _is_numeric(action: argparse.Action) -> bool:
    if action.type is None or action.type is str or action.type in PATH_TYPES:
        return False
    try:
        probe = action.type("2")  # type: ignore[misc,operator]
    except (ValueError, TypeError, argparse.ArgumentTypeError):
        return False
    return isinstance(probe, (int, float)) or (
        isinstance(probe, tuple) and all(isinstance(p, (int, float)) for p in probe))


def _is_url(action: argparse.Action) -> bool:
    words = f"{action.dest} {action.metavar} {action.help}".lower()
    return "url" in words or "http://" in words


def odd_values(action: argparse.Action) -> list[Odd]:
    """A small set of odd values for `action`, each marked whether it must be refused."""
    if action.choices is not None:
        return [Odd(v, True) for v in ("", "--", "bogus", NON_UTF8)]
    if _is_numeric(action):
        huge_ok = action.dest == "seed" or _returns_float(action)
        return [Odd("", True), Odd("--", True), Odd("abc", True), Odd("nan", True),
                Odd("-inf", True), Odd(ODD_UNICODE, True), Odd(HUGE, not huge_ok),
                Odd("-1", False), Odd("0", False)]
    if action.type in LISTEN_TYPES:
        return [Odd("", True), Odd("  ", True), Odd("--", True), Odd(NON_UTF8, False),
                Odd(ODD_UNICODE, False)]
    if action.type in PATH_TYPES:
        writes_file = action.type is argtypes.output_file
        wants_dir = action.type in (argtypes.output_dir, argtypes.work_dir)
        creates = writes_file or wants_dir
        return [Odd("", True), Odd("--", True), Odd("a" * 300, True), Odd(NON_UTF8, False),
                Odd(MISSING, creates), Odd(A_DIRECTORY, writes_file),
                Odd(A_FILE, wants_dir)]
    odd = [Odd("", False), Odd("--", True), Odd("-1", False), Odd("nan", False),
           Odd(HUGE, False), Odd(NON_UTF8, False), Odd(ODD_UNICODE, False),
           Odd(MISSING, False), Odd(A_DIRECTORY, False)]
    if _is_url(action):
        odd += [Odd("not a url", True), Odd("ftp://127.0.0.1:9", True)]
    return odd


def _returns_float(action: argparse.Action) -> bool:
    probe = action.type("2")  # type: ignore[misc,operator]
    return isinstance(probe, float) or (isinstance(probe, tuple) and
                                        any(isinstance(p, float) for p in probe))


@dataclass(frozen=True)
class Case:
    argv: list[str]
    names: tuple[str, ...]  # what an error line may name: the option, its dest, the value
    odd: Odd


def cases(path: tuple[str, ...]) -> list[Case]:
    """One run per (argument, odd value) of the command at `path`."""
    parser = COMMANDS[path]
    options = BASE_OPTIONS.get(path, [])
    positionals = BASE_POSITIONALS.get(path, {})
    out = []
    for action in parser._actions:
        if not takes_value(action):
            continue
        flag = next((o for o in action.option_strings if o.startswith("--")),
                    action.option_strings[0] if action.option_strings else None)
        names = (*action.option_strings, action.dest, action.dest.replace("_", "-"),
                 *(o.lstrip("-") for o in action.option_strings))
        for odd in odd_values(action):
            if flag is None:  # a positional: a value that starts with "-" would be an option
                if odd.value.startswith("-"):
                    continue
                mine: list[str] = []
                given = {**positionals, action.dest: odd.value}
            else:
                n = action.nargs if isinstance(action.nargs, int) else 1
                mine = [f"{flag}={odd.value}"] if n == 1 else [flag, *[odd.value] * n]
                given = positionals
            base = [t for t in options if t.split("=")[0] not in action.option_strings]
            tail = [given[a.dest] for a in parser._actions
                    if not a.option_strings and a.dest in given]
            out.append(Case([*path, *base, *mine, *tail], names, odd))
    return out


# --- one run, and its verdict ---

@dataclass(frozen=True)
class Outcome:
    code: int | None  # None: it reached its work
    stderr: str
    crash: str | None = None  # the traceback of an exception that escaped main()


@contextmanager
def _time_limit(seconds: int) -> Iterator[None]:
    def expire(signum: int, frame: object) -> None:
        raise TimeoutError(f"kvtier took over {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


@contextmanager
def _signals_kept() -> Iterator[None]:
    """`main` catches SIGTERM and SIGHUP while a command runs; the test process keeps its own
    handlers."""
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for s, handler in saved.items():
            signal.signal(s, handler)


def _text_stream(errors: str) -> io.TextIOWrapper:
    # stdout fails on text it cannot encode, as a terminal's does; stderr escapes it.
    return io.TextIOWrapper(io.BytesIO(), encoding="utf-8", errors=errors, write_through=True)


def run_cli(argv: list[str]) -> Outcome:
    out, err = _text_stream("strict"), _text_stream("backslashreplace")
    crash = None
    with redirect_stdout(out), redirect_stderr(err), _signals_kept(), \
            _time_limit(SECONDS_PER_RUN):
        try:
            code: int | None = main(argv)
        except SystemExit as exc:  # argparse: usage errors (2) and --help (0)
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
        except _WorkStarts:
            code = None
        except BaseException:  # the CLI would have printed its traceback
            code, crash = -1, traceback.format_exc()
    err.seek(0)
    return Outcome(code, err.buffer.getvalue().decode("utf-8"), crash)  # type: ignore[attr-defined]


def error_line(stderr: str) -> str | None:
    """The one error line of `stderr` (after argparse's usage, if any); None if there are
    none or several."""
    lines = [line for line in stderr.splitlines() if line.strip()]
    if lines and lines[0].startswith("usage:"):
        lines = [line for line in lines[1:] if not line.startswith(" ")]
    return lines[0] if len(lines) == 1 else None


def verdict(case: Case, outcome: Outcome) -> str | None:
    """What is wrong with `outcome` (None: nothing)."""
    if outcome.crash is not None:
        return f"an exception escaped:\n{outcome.crash}"
    if "Traceback" in outcome.stderr:
        return f"a traceback on stderr:\n{outcome.stderr}"
    if outcome.code is None or outcome.code == 0:
        where = "started its work" if outcome.code is None else "exited 0"
        return f"{where} with a value it must refuse" if case.odd.must_refuse else None
    if outcome.code not in (1, 2):
        return f"exit status {outcome.code}: {outcome.stderr!r}"
    line = error_line(outcome.stderr)
    if line is None:
        return f"exit status {outcome.code} without a one-line error: {outcome.stderr!r}"
    value = case.odd.value
    named = any(n and n in line for n in case.names) or (
        len(value) >= 2 and not value.lstrip("-").isdigit()  # "-1" is in lines by chance
        and (value[:20] in line or repr(value)[1:-1][:20] in line))
    return None if named else f"the error names neither the argument nor the value: {line!r}"


@contextmanager
def nothing_starts() -> Iterator[None]:
    """Every command module's work replaced by `_stop`; doctor's probes stubbed; in WORKDIR."""
    with pytest.MonkeyPatch.context() as mp:
        for parser in COMMANDS.values():
            module = parser.get_default("func").__module__
            for name in _work_of(module):
                mp.setattr(importlib.import_module(module), name, _stop)
        from kvtier.tools.ops import doctor
        from kvtier.tools.ops.machine import Check

        mp.setattr(doctor, "check_connector", lambda *a, **k: Check("connector", "ok", "stub"))
        mp.setattr(doctor, "check_pinned_memory", lambda *a, **k: Check("pinned", "ok", "stub"))
        mp.setattr(importlib.import_module("kvtier.tools.cli.bench_serve"), "fetch_model",
                   _a_served_model)
        mp.chdir(WORKDIR)
        yield


def findings(path: tuple[str, ...]) -> list[str]:
    found = []
    with nothing_starts():
        for case in cases(path):
            problem = verdict(case, run_cli(case.argv))
            if problem:
                found.append(f"kvtier {shlex.join(case.argv)}\n    {problem}")
    return found


# --- the sweep ---

@pytest.mark.parametrize("path", sorted(COMMANDS), ids=" ".join)
def test_every_argument_meets_odd_values(path):
    assert cases(path), path
    found = findings(path)
    assert not found, f"{len(found)} finding(s):\n" + "\n".join(found)


def test_the_walk_finds_every_command():
    names = {p[0] for p in COMMANDS}
    assert {"plan", "audit", "doctor", "simulate", "serve", "warm", "proxy", "inspect", "gc",
            "demo", "bench"} <= names
    assert len([p for p in COMMANDS if p[0] == "bench"]) >= 10


def test_every_command_says_where_its_work_starts():
    # A new command module must say where it starts its work (WORK), or the sweep would
    # start it for real; its base command line must parse.
    for path, parser in COMMANDS.items():
        module = parser.get_default("func").__module__
        assert module in WORK or _work_of(module), f"kvtier {' '.join(path)}: add {module} to WORK"
        for name in _work_of(module):
            assert hasattr(importlib.import_module(module), name), (module, name)


def test_the_sweep_catches_a_silent_failure(monkeypatch):
    from kvtier.tools.cli import plan

    monkeypatch.setattr(plan, "run", lambda args: 1)
    assert any("without a one-line error" in f for f in findings(("plan",)))


def test_the_sweep_catches_a_missing_type_check(monkeypatch):
    from kvtier.tools.cli import plan

    monkeypatch.setattr(plan, "positive_int", lambda text: 1)  # --tp, --concurrency: anything
    found = findings(("plan",))
    assert any("--tp=" in f for f in found) and any("--concurrency=" in f for f in found)


# --- audit's input: random `vllm serve` lines and connector configs ---

JSON_VALUE = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70),
              st.floats(allow_nan=False, allow_infinity=False),
              st.sampled_from(["", "-1", "nan", "1e400", HUGE, "{", "cpu=-1GiB:lru"])),
    lambda children: st.one_of(st.lists(children, max_size=3),
                               st.dictionaries(st.text(max_size=8), children, max_size=3)),
    max_leaves=8,
)
EXTRA = st.dictionaries(
    st.sampled_from(["spec_name", "cpu_bytes_to_use", "block_size", "tiers", "store",
                     "tokens_per_chunk", "connectors", "shared_storage_path"]),
    JSON_VALUE, max_size=4)
TRANSFER = st.fixed_dictionaries(
    {"kv_connector": st.sampled_from(["OffloadingConnector", "KVTierConnector",
                                      "LMCacheConnectorV1", "MultiConnector"])},
    optional={"kv_connector_extra_config": st.one_of(EXTRA, JSON_VALUE),
              "kv_connector_module_path": st.sampled_from(["kvtier.integrations.vllm", ""]),
              "kv_role": JSON_VALUE})
SERVE_LINE = st.builds(
    lambda flags, transfer: "vllm serve m " + " ".join(
        f"{k} {shlex.quote(v)}" for k, v in flags.items())
    + f" --kv-transfer-config {shlex.quote(json.dumps(transfer))}",
    st.dictionaries(st.sampled_from(["--tensor-parallel-size", "--block-size",
                                     "--max-model-len", "--gpu-memory-utilization",
                                     "--kv-offloading-size", "--kv-cache-dtype"]),
                    st.sampled_from(["", "-1", "nan", "inf", HUGE, "8GiB", "fp8"]),
                    max_size=3),
    TRANSFER)


@settings(max_examples=15, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(line=SERVE_LINE)
def test_audit_odd_serve_lines(line):
    outcome = run_cli(["audit", line, "--json"])
    assert outcome.crash is None and "Traceback" not in outcome.stderr, outcome
    assert outcome.code in (0, 1, 2), outcome


# --- the findings, pinned as examples ---

def test_300_digit_sizes_are_config_errors():
    from kvtier.errors import ConfigError
    from kvtier.units import parse_size

    for value in ("1" * 300, "9" * 300 + "GiB", 10**300, "1" * 400):
        with pytest.raises(ConfigError):
            parse_size(value, "size")


def test_json_into_a_closed_pipe_exits_quietly(monkeypatch):
    class ClosedPipe(io.StringIO):
        def write(self, text):
            raise BrokenPipeError(32, "Broken pipe")

    err = io.StringIO()
    monkeypatch.setattr("sys.stdout", ClosedPipe())
    with redirect_stderr(err):
        assert main(["audit", "vllm serve m --enforce-eager", "--json"]) == EXIT_BROKEN_PIPE
    assert err.getvalue() == ""


def test_non_utf8_model_config_for_plan(tmp_path):
    path = tmp_path / "config.json"
    path.write_bytes(b'{"hidden_size": 64, "name": "\xff"}')
    outcome = run_cli(["plan", str(path)])
    assert outcome.code == 2 and "UTF-8" in outcome.stderr, outcome


@pytest.mark.parametrize("options, expected", [
    (["--turns-mean=1e30"], 0),  # divided by zero (issue 14)
    (["--output-tokens=268435456"], 2),  # over MAX_TOKENS; hung (issue 14)
    (["--max-context=5000", "--output-tokens=100000"], 2),  # no turn fits; hung (issue 14)
])
def test_simulate_workloads_that_cannot_fit_end_with_an_error(options, expected):
    outcome = run_cli(["simulate", "--requests=5", *options])
    assert outcome.code == expected and outcome.crash is None, outcome


# --- sizes no machine has: refused before any work (kvtier.tools.bench.headroom) ---

# Every bench that allocates by a size the command line gives, with a size in its option's
# range that no machine holds. These ended in torch's allocation error or numpy's
# MemoryError (a size just over the RAM free: the OOM killer) once their work started.
BEYOND_MEMORY = [
    (["bench", "copy", "--blocks=100000000"], "--blocks"),
    (["bench", "copy", "--device=cpu", "--layers=100000"], "--layers"),
    (["bench", "storage", "--sizes=100000"], "--sizes"),
    (["bench", "storage", "--quick", "--trial-bytes=1000TiB"], "--trial-bytes"),
    (["bench", "mover", "--chunks=100000000"], "--chunks"),
    (["bench", "mover", "--tokens-per-chunk=1000000000"], "--tokens-per-chunk"),
    (["bench", "node", "--chunk-kib=100000000"], "--chunk-kib"),
    (["bench", "disk-load", "--chunks=4,100000000"], "--chunks"),
    (["bench", "fleet", "--chunks=1000000000"], "--chunks"),
    (["bench", "interference", "--memory-chunks=1000000000"], "--memory-chunks"),
    (["bench", "pooling", "--ram=1000TiB"], "--ram"),
]


@pytest.mark.parametrize("argv, option", BEYOND_MEMORY, ids=lambda v: " ".join(v)
                         if isinstance(v, list) else v)
def test_a_size_beyond_the_machine_is_refused_before_work(argv, option):
    with nothing_starts():
        outcome = run_cli(argv)
    line = error_line(outcome.stderr)
    assert outcome.code == 2 and outcome.crash is None and line is not None, outcome
    assert option in line and "the run needs" in line and "available (MemAvailable)" in line, \
        line


@pytest.mark.parametrize("directory", ["/proc", A_FILE, MISSING],
                         ids=["proc", "a-file", "missing"])  # A_FILE: a temp path, per process
def test_bench_disk_load_refuses_a_directory_it_cannot_use_before_work(directory):
    """`--dir` was a bare Path: /proc or a file ended in a traceback from mkdtemp/mkdir once
    the run had begun; it is a `work_dir`, as every other bench's --dir."""
    with nothing_starts():
        outcome = run_cli(["bench", "disk-load", "--quick", f"--dir={directory}"])
    line = error_line(outcome.stderr)
    assert outcome.code == 2 and line is not None and "--dir" in line, outcome


@pytest.mark.parametrize("argv, option", [
    # two identical rows once (a count twice), as `bench storage --sizes` refuses a size twice
    (["bench", "disk-load", "--chunks=4,4"], "chunks='4,4'"),
    # every policy ran against an empty memory tier
    (["bench", "trace", str(TRACE), "--capacity=0"], "capacity=0"),
])
def test_a_setting_that_measures_nothing_is_refused_before_work(argv, option):
    with nothing_starts():
        outcome = run_cli(argv)
    line = error_line(outcome.stderr)
    assert outcome.code == 2 and outcome.crash is None and line is not None, outcome
    assert option in line, line
