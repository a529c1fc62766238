"""Odd argument values never make the CLI print a traceback (issue 14).

Hypothesis feeds every command (in process, through `kvtier.tools.cli.main.main`) with odd values:
empty strings, NaN and infinities, 300-digit numbers, negative sizes, control characters,
Python dicts where JSON belongs, and random JSON connector configs. Each run must end with
exit status 0, 1 or 2, print no traceback, and finish within a few seconds; a status of 2
ends with a `kvtier` error line. The options of doctor, inspect, gc, serve and bench are read
from the parser itself, so a new option is fed too.

What must not happen in a test is cut off where it would start, never earlier: `serve` always
gets `--dry-run`, `gc` always `--dry-run`, and each benchmark's measuring function (which
would start vLLM or move gigabytes) is replaced by one that ends the run, so argument
parsing and configuration checks run for real. doctor's two child-process probes (importing
the connector, pinning memory: seconds each, independent of the arguments) are stubbed.
"""

from __future__ import annotations

import argparse
import importlib
import io
import json
import shlex
import signal
import tempfile
from contextlib import contextmanager, redirect_stderr, redirect_stdout, suppress
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtier.tools.cli.main import EXIT_BROKEN_PIPE, build_parser, main

CONFIG = str(Path(__file__).parents[1] / "data" / "configs" / "llama-3-8b.json")
SECONDS_PER_RUN = 20  # a generous bound: a hang on odd input is a finding too
SETTINGS = settings(max_examples=50, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow])

CURATED = [
    "", " ", "-1", "0", "1", "-0", "nan", "NaN", "inf", "-inf", "1e400", "-1e400", "1e-400",
    "1" * 300, "9" * 300 + "GiB", "1" * 400 + ".5TB", "abc", "--", "-", "None", "null",
    "[1,2]", "{'a': 1}", "{", "0x10", "1_000", "\uff11\uff12", "8GiB", "-5GiB", "1.5",
    "99999", "4294967296", "\t", "\x00", "\xff", "\u202e", "h100", "cpu", "0.21.0", "v0.9",
    "999.999.999", "x=y", "=", "cpu=64GiB", "cpu=1e400GiB", "none", "cpu=-1GiB:lru",
]
ODD = st.one_of(
    st.sampled_from(CURATED),
    st.text(max_size=24),
    st.integers(min_value=-10**30, max_value=10**30).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
)


def run_cli(argv: list[str]) -> tuple[int, str]:
    """Exit status and stderr of `kvtier argv`; an exception escaping main() fails the test
    with its traceback (the CLI would have printed it)."""
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err), _time_limit(SECONDS_PER_RUN):
        try:
            code = main(argv)
        except SystemExit as exc:  # argparse: usage errors (2) and --help (0)
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
    return code, err.getvalue()


def assert_clean(argv: list[str]) -> None:
    code, err = run_cli(argv)
    assert code in (0, 1, 2), (argv, code, err)
    assert "Traceback" not in err, (argv, err)
    if code == 2:  # argparse echoes unknown arguments raw, newlines included
        assert any(line.startswith("kvtier") for line in err.split("\n")), (argv, err)


@contextmanager
def _time_limit(seconds: int):
    def expire(signum, frame):
        raise TimeoutError(f"kvtier took over {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def _options(names: list[str]) -> st.SearchStrategy[list[str]]:
    """Up to three of `names`, each with an odd value (as --flag=value, so a value that
    starts with '-' stays a value)."""
    pairs = st.dictionaries(st.sampled_from(names), ODD, max_size=3)
    return pairs.map(lambda d: [f"{k}={v}" for k, v in d.items()])


PLAN_OPTIONS = ["--tp", "--gpu", "--hbm", "--gpu-memory-utilization", "--host-ram",
                "--host-kv-fraction", "--nvme", "--nvme-path", "--nvme-gen", "--pcie-gen",
                "--context", "--concurrency", "--kv-dtype", "--params", "--vllm-version",
                "--from-sglang"]


@SETTINGS
@given(model=st.one_of(st.just(CONFIG), ODD), options=_options(PLAN_OPTIONS),
       as_json=st.booleans())
def test_plan_odd_values(model, options, as_json):
    assert_clean(["plan", model, "--vllm-version=0.21.0", *options]
                 + (["--json"] if as_json else []))


JSON_VALUE = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70),
              st.floats(allow_nan=False, allow_infinity=False), st.sampled_from(CURATED)),
    lambda children: st.one_of(st.lists(children, max_size=3),
                               st.dictionaries(st.text(max_size=8), children, max_size=3)),
    max_leaves=8,
)
EXTRA_KEYS = ["spec_name", "cpu_bytes_to_use", "block_size", "eviction_policy",
              "store_threshold", "secondary_tiers", "self_describing_kv_events", "tiers",
              "tokens_per_chunk", "connectors", "num_cpu_blocks", "shared_storage_path"]
TIER = st.dictionaries(st.sampled_from(["type", "root_dir", "n_read_threads", "kind",
                                        "capacity", "path", "module_path"]),
                       st.one_of(st.sampled_from(["fs", "memory", "disk", "shared"]),
                                 JSON_VALUE), max_size=4)
EXTRA = st.dictionaries(
    st.sampled_from(EXTRA_KEYS),
    st.one_of(JSON_VALUE, st.lists(TIER, max_size=2),
              st.sampled_from(["TieringOffloadingSpec", "CPUOffloadingSpec"])), max_size=5)
TRANSFER = st.fixed_dictionaries(
    {"kv_connector": st.one_of(st.sampled_from(["OffloadingConnector", "KVTierConnector",
                                                "LMCacheConnectorV1", "MultiConnector"]),
                               JSON_VALUE)},
    optional={"kv_connector_extra_config": st.one_of(EXTRA, JSON_VALUE),
              "kv_connector_module_path": st.sampled_from(["kvtier.integrations.vllm", ""]),
              "kv_role": JSON_VALUE})
VLLM_FLAGS = ["--tensor-parallel-size", "--block-size", "--max-model-len",
              "--max-num-batched-tokens", "--gpu-memory-utilization", "--kv-offloading-size",
              "--kv-offloading-backend", "--kv-cache-dtype", "--data-parallel-size",
              "--speculative-config", "--kv-transfer-config"]
SERVE_LINE = st.builds(
    lambda flags, transfer: "vllm serve m " + " ".join(
        f"{k} {shlex.quote(v)}" for k, v in flags.items()) + (
        f" --kv-transfer-config {shlex.quote(json.dumps(transfer))}" if transfer else ""),
    st.dictionaries(st.sampled_from(VLLM_FLAGS), ODD, max_size=3),
    st.one_of(st.none(), TRANSFER))
AUDIT_OPTIONS = ["--env", "--vllm-version", "--gpu", "--typical-context", "--model-config"]


@SETTINGS
@given(source=st.one_of(SERVE_LINE, ODD.filter(lambda s: s != "-")),  # "-": stdin
       options=_options(AUDIT_OPTIONS),
       as_json=st.booleans())
def test_audit_odd_values(source, options, as_json):
    assert_clean(["audit", source, *options] + (["--json"] if as_json else []))


SIM_OPTIONS = ["--model", "--gpu", "--tp", "--engines", "--router", "--workload", "--rate",
               "--think-s", "--turns-mean", "--system-tokens", "--doc-prob", "--user-tokens",
               "--output-tokens", "--max-context", "--tier", "--hbm-util", "--block-tokens",
               "--max-num-seqs", "--max-batched-tokens", "--seed", "--sweep"]
# --requests odd but small: a valid large count is slow, not odd.
REQUESTS = st.one_of(st.sampled_from(["0", "-1", "abc", "nan", "1e3", "", "1" * 300, "--"]),
                     st.integers(min_value=0, max_value=40).map(str))


@SETTINGS
@given(options=_options(SIM_OPTIONS), requests=REQUESTS)
def test_simulate_odd_values(options, requests):
    assert_clean(["simulate", "--json", f"--requests={requests}", *options])


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


@pytest.mark.parametrize("port", ["-1", "0", "99999", "http"])
def test_serve_refuses_ports_outside_1_65535(port):
    code, err = run_cli(["serve", "m", f"--port={port}", "--dry-run"])
    assert code == 2 and "argument --port" in err


def test_a_double_dash_value_is_a_usage_error_not_a_crash():
    code, err = run_cli(["simulate", "--max-num-seqs=--"])
    assert code == 2 and "expected a value" in err


def test_non_utf8_model_config_for_plan(tmp_path):
    path = tmp_path / "config.json"
    path.write_bytes(b'{"hidden_size": 64, "name": "\xff"}')
    code, err = run_cli(["plan", str(path)])
    assert code == 2 and "UTF-8" in err and "Traceback" not in err


@pytest.mark.parametrize("options, expected", [
    (["--turns-mean=1e30"], 0),  # used to divide by zero
    (["--output-tokens=268435456"], 2),  # over MAX_TOKENS; used to hang
    (["--max-context=5000", "--output-tokens=100000"], 2),  # no turn fits; used to hang
])
def test_simulate_workloads_that_cannot_fit_end_with_an_error(options, expected):
    code, err = run_cli(["simulate", "--requests=5", *options])
    assert code == expected and "Traceback" not in err, err


# --- doctor, inspect, gc, serve, bench: options read from the parser ---

def _subparser(parser: argparse.ArgumentParser, path: list[str]) -> argparse.ArgumentParser:
    for name in path:
        action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = action.choices[name]
    return parser


def options_of(*path: str, skip: tuple[str, ...] = ()) -> list[str]:
    """The long options of `kvtier <path>`, --help and `skip` left out."""
    parser = _subparser(build_parser(), list(path))
    return sorted(o for a in parser._actions for o in a.option_strings
                  if o.startswith("--") and o != "--help" and o not in skip)


class _WouldRun(Exception):
    """Raised where a benchmark would start measuring."""


def _would_run(*args, **kwargs):
    raise _WouldRun


# Where a benchmark starts measuring: `run_and_report` for the engine benchmarks (found in
# each workload's module), and these for the others.
SPECIAL_RUNNERS = {
    "kvtier.tools.cli.bench_storage": ("run_bench",),
    "kvtier.tools.cli.bench_serve": ("fetch_model", "bench_endpoint"),
}


def _bench_modules() -> dict[str, str]:
    """bench workload -> the module whose `run` it calls."""
    bench = _subparser(build_parser(), ["bench"])
    sub = next(a for a in bench._actions if isinstance(a, argparse._SubParsersAction))
    return {w: p.get_default("func").__module__ for w, p in sub.choices.items()}


def _runners(module: str) -> tuple[str, ...]:
    if module in SPECIAL_RUNNERS:
        return SPECIAL_RUNNERS[module]
    return ("run_and_report",) if hasattr(importlib.import_module(module),
                                         "run_and_report") else ()


BENCH_RUNNERS = {m: _runners(m) for m in set(_bench_modules().values())}


@contextmanager
def _nothing_starts():
    with pytest.MonkeyPatch.context() as mp:
        for module, names in BENCH_RUNNERS.items():
            for name in names:
                mp.setattr(importlib.import_module(module), name, _would_run)
        from kvtier.tools.ops import doctor
        from kvtier.tools.ops.machine import Check

        mp.setattr(doctor, "check_connector", lambda *a, **k: Check("connector", "ok", "stub"))
        mp.setattr(doctor, "check_pinned_memory", lambda *a, **k: Check("pinned", "ok", "stub"))
        yield


def assert_clean_or_would_run(argv: list[str]) -> None:
    with _nothing_starts(), suppress(_WouldRun):  # parsed and configured; it would measure now
        assert_clean(argv)


WORKDIR = Path(tempfile.mkdtemp(prefix="kvtier-odd-"))
STORE = WORKDIR / "store.json"
STORE.write_text(json.dumps({"tiers": [{"kind": "disk", "path": str(WORKDIR / "disk"),
                                         "capacity": "64MiB"}]}))
CONFIG_ARG = st.one_of(st.just(str(STORE)), ODD)


@SETTINGS
@given(config=st.one_of(st.none(), CONFIG_ARG),
       options=_options(options_of("doctor", skip=("--json",))), as_json=st.booleans())
def test_doctor_odd_values(config, options, as_json):
    assert_clean_or_would_run(["doctor", *([config] if config is not None else []), *options]
                              + (["--json"] if as_json else []))


@SETTINGS
@given(config=CONFIG_ARG, options=_options(options_of("inspect", skip=("--config", "--json"))),
       as_json=st.booleans())
def test_inspect_odd_values(config, options, as_json):
    assert_clean(["inspect", f"--config={config}", *options] + (["--json"] if as_json else []))


@SETTINGS
@given(config=CONFIG_ARG,
       options=_options(options_of("gc", skip=("--config", "--dry-run", "--json"))),
       as_json=st.booleans())
def test_gc_odd_values(config, options, as_json):
    assert_clean(["gc", f"--config={config}", "--dry-run", *options]
                 + (["--json"] if as_json else []))


@SETTINGS
@given(model=ODD.filter(lambda s: not s.startswith("-")),
       options=_options(options_of("serve", skip=("--dry-run",))))
def test_serve_dry_run_odd_values(model, options):
    assert_clean(["serve", "--dry-run", *options, model])


# Only workloads whose start of measuring is known (test_every_benchmark_can_be_stopped
# fails for the others, so that none runs for real here).
BENCH_WORKLOADS = sorted(w for w, m in _bench_modules().items() if BENCH_RUNNERS[m])


@SETTINGS
@given(data=st.data())
def test_bench_odd_values(data):
    workload = data.draw(st.sampled_from(BENCH_WORKLOADS))
    options = data.draw(_options(options_of("bench", workload)))
    assert_clean_or_would_run(["bench", workload, *options])


def test_every_benchmark_can_be_stopped():
    # A new `kvtier bench` workload must say where it starts measuring (above), or the
    # property tests would start it for real.
    for workload, module in _bench_modules().items():
        names = BENCH_RUNNERS[module]
        assert names, f"bench {workload}: add its runner to SPECIAL_RUNNERS"
        for name in names:
            assert callable(getattr(importlib.import_module(module), name)), (module, name)
    assert len(BENCH_WORKLOADS) >= 10


# --- every option of every command, each curated odd value, one at a time ---
# Hypothesis samples; this sweep makes sure that each option meets each of the worst values
# at least once (it found `bench storage --sizes=1e400`, an OverflowError).
SWEEP_VALUES = ["", "nan", "inf", "-1", "1e400", "1" * 300, "9" * 300 + "GiB", "abc", "\x00",
                "{'a': 1}", "99999"]
SWEEP = [
    (["plan", CONFIG], options_of("plan", skip=("--json",)), assert_clean),
    (["audit", "vllm serve m"], options_of("audit", skip=("--json",)), assert_clean),
    (["simulate", "--requests=5", "--json"],
     options_of("simulate", skip=("--json", "--requests", "--validate")), assert_clean),
    (["doctor"], options_of("doctor", skip=("--json",)), assert_clean_or_would_run),
    (["inspect", f"--config={STORE}"], options_of("inspect", skip=("--json",)), assert_clean),
    (["gc", f"--config={STORE}", "--dry-run"], options_of("gc", skip=("--json", "--dry-run")),
     assert_clean),
    (["serve", "--dry-run", "m"], options_of("serve", skip=("--dry-run",)), assert_clean),
    *((["bench", w], options_of("bench", w), assert_clean_or_would_run)
      for w in BENCH_WORKLOADS),
]


@pytest.mark.parametrize(("command", "options", "check"), SWEEP,
                         ids=[" ".join(c[:2]) for c, _, _ in SWEEP])
def test_every_option_meets_every_curated_value(command, options, check):
    assert options, command
    for option in options:
        for value in SWEEP_VALUES:
            check([*command[:-1], f"{option}={value}", command[-1]]
                  if command[0] in ("serve", "plan", "audit") else
                  [*command, f"{option}={value}"])
