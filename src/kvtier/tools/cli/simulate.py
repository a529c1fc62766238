"""`kvtier simulate`: what-if runs of engines, tiers and traffic (thin layer over kvtier.tools.sim).

    kvtier simulate --workload chat --rate 8 --tier cpu=64GiB --requests 100000
    kvtier simulate --sweep cpu_gb=0,8,16,32,64,128 --plot sweep.png
    kvtier simulate --tier shared=2TiB --load-when always   # a naive cache: load every hit
    kvtier simulate --validate
    kvtier simulate --trace requests.jsonl --plot hit-ratio.png   # simulate_trace.py

A command line runs one mode (a plain run, `--sweep`, `--trace`, `--write-trace` or
`--validate`); an option of another mode (`--plot` without `--sweep` or `--trace`,
`--capacity` without `--trace`, ...) and one a mode never reads (`--tier` or `--rate` with
`--trace`, ...) are refused rather than silently ignored (`refuse_unused`).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict
from typing import Any

from kvtier.errors import ConfigError
from kvtier.integrations.vllm.config import LOAD_WHEN
from kvtier.tools.cli.argtypes import (
    finite_float,
    fraction,
    int_in,
    plot_file,
    positive_int,
)
from kvtier.tools.cli.simulate_trace import add_trace_arguments, run_trace, write_trace
from kvtier.tools.ops.hardware import GPU_PROFILES
from kvtier.tools.sim.cost import MODEL_PRESETS
from kvtier.tools.sim.engine import EngineConfig
from kvtier.tools.sim.fleet import ROUTERS, SimConfig, simulate
from kvtier.tools.sim.report import SimReport
from kvtier.tools.sim.sweep import SWEEP_PARAMS, SweepResult, sweep
from kvtier.tools.sim.tiers import parse_tier
from kvtier.tools.sim.workload import WORKLOAD_PRESETS, workload_preset

# The simulator builds every engine up front: a larger fleet is a typo that would exhaust
# memory before the first request.
MAX_ENGINES = 4096
DEFAULT_REQUESTS = 20_000
_OVERRIDES = ("rate_rps", "think_s", "turns_mean", "system_tokens", "doc_prob",
              "user_tokens", "output_tokens", "max_context")


def _flag(override: str) -> str:
    """The command-line option of a workload override ("rate_rps" -> "--rate")."""
    return "--" + override.replace("_", "-").removesuffix("-rps")


# The modes of `kvtier simulate` besides a plain run: at most one a command line.
MODES = ("--validate", "--trace", "--write-trace", "--sweep")
# option -> the modes it belongs to (given without one of them, it is refused).
MODE_OPTIONS = {"--capacity": ("--trace",), "--policies": ("--trace",),
                "--trace-block-tokens": ("--trace", "--write-trace"),
                "--plot": ("--sweep", "--trace")}
# option -> the modes that never read it (given with one of them, it is refused), and why.
OPTION_DESTS = {"--tier": "tier", **{_flag(name): name for name in _OVERRIDES}}
# The simulated engine's options and the workload's: given with a mode that never reads
# them they were ignored (`--trace T --block-tokens 16`, meant as the trace's block size).
_ENGINE_OPTIONS = ("--hbm-util", "--load-when", "--block-tokens", "--max-num-seqs",
                   "--max-batched-tokens")
# dest -> its default, applied after refuse_unused (argparse's default is None: not given).
DEFAULTS = {"hbm_util": 0.9, "load_when": "faster", "block_tokens": 64, "max_num_seqs": 256,
            "max_batched_tokens": 8192, "seed": 0, "workload": "chat"}
# A swept parameter's own option: the sweep sets it at each value (`--sweep rate=1,2
# --rate 3` ran at 1 and 2 without a word of the 3).
SWEPT_OPTIONS = {"rate": "--rate", "hbm_util": "--hbm-util"}
NOT_READ_BY = {"--tier": ("--trace", "--write-trace", "--validate"),
               "--requests": ("--validate",),
               **{option: ("--trace", "--write-trace", "--validate")
                  for option in _ENGINE_OPTIONS},
               "--workload": ("--trace", "--validate"), "--seed": ("--trace", "--validate"),
               **{_flag(name): ("--trace", "--validate") for name in _OVERRIDES}}
IGNORES = {"--trace": "it replays the trace's requests into each --capacity",
           "--write-trace": "it writes requests, not a run of tiers",
           "--validate": "it runs its own scenarios"}


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser("simulate", help="simulate serving with kvtier's tiers")
    p.add_argument("--model", default="llama-3.1-8b",
                   help=f"preset ({', '.join(MODEL_PRESETS)}) or path to a config.json")
    p.add_argument("--gpu", default="h100",
                   help=f"{', '.join(GPU_PROFILES)}, or cpu (this machine's cores)")
    p.add_argument("--tp", type=positive_int, default=1, help="tensor-parallel size per engine")
    p.add_argument("--engines", type=int_in(1, MAX_ENGINES), default=1,
                   help=f"engines in the fleet (1-{MAX_ENGINES})")
    p.add_argument("--router", default="session", choices=ROUTERS)
    p.add_argument("--workload", choices=list(WORKLOAD_PRESETS), help="default chat")
    for name in _OVERRIDES:
        p.add_argument(_flag(name), dest=name,
                       type=finite_float, default=None, help=f"override the preset's {name}")
    p.add_argument("--tier", action="append", default=None, metavar="NAME=SIZE[:POLICY]",
                   help="offload tier, fastest first (repeat); default cpu=64GiB; 'none'. "
                        "POLICY: an eviction policy (lru, arc, prefix); default the kind's "
                        "(cpu: prefix, as kvtier's memory tier; the others: lru)")
    p.add_argument("--hbm-util", type=fraction, help="gpu_memory_utilization (default 0.9)")
    p.add_argument("--load-when", choices=LOAD_WHEN,
                   help="faster (default, the connector's load_when): load a tier hit only as "
                        "far as it loads faster than it recomputes; always: every hit (naive)")
    p.add_argument("--block-tokens", type=positive_int,
                   help="vLLM's block size in the simulated engine (default 64; a trace's "
                        "block is --trace-block-tokens)")
    p.add_argument("--max-num-seqs", type=positive_int, help="default 256")
    p.add_argument("--max-batched-tokens", type=positive_int, help="default 8192")
    p.add_argument("--requests", type=positive_int, default=None,
                   help="requests to simulate (default 20000); with --trace: the first N")
    p.add_argument("--seed", type=int, help="the workload's seed (default 0)")
    p.add_argument("--sweep", metavar="PARAM=V1,V2,...",
                   help=f"sweep one of {', '.join(SWEEP_PARAMS)}")
    p.add_argument("--plot", type=plot_file, metavar="OUT.png",
                   help="with --sweep or --trace: write a PNG")
    p.add_argument("--validate", action="store_true",
                   help="compare the model with published figures and exit")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    add_trace_arguments(p)
    p.set_defaults(func=run)


def config_from_args(args: argparse.Namespace) -> SimConfig:
    """Build the SimConfig the arguments describe.

    Raises:
        ConfigError: any invalid value.
    """
    overrides = {name: getattr(args, name) for name in _OVERRIDES}
    for name in ("max_context",):
        if overrides[name] is not None:
            overrides[name] = int(overrides[name])
    for name in ("system_tokens", "user_tokens", "output_tokens"):
        if overrides[name] is not None:
            overrides[name] = int(overrides[name])
    specs = args.tier if args.tier is not None else ["cpu=64GiB"]
    tiers = () if specs == ["none"] else tuple(parse_tier(s) for s in specs)
    engine = EngineConfig(block_tokens=args.block_tokens, gpu_memory_utilization=args.hbm_util,
                          max_num_seqs=args.max_num_seqs,
                          max_batched_tokens=args.max_batched_tokens,
                          load_when=args.load_when)
    return SimConfig(model=args.model, gpu=args.gpu, tp=args.tp, engine=engine, tiers=tiers,
                     workload=workload_preset(args.workload, **overrides),
                     requests=DEFAULT_REQUESTS if args.requests is None else args.requests,
                     seed=args.seed, engines=args.engines,
                     router=args.router)


def parse_sweep(text: str) -> tuple[str, list[float]]:
    """Parse "PARAM=V1,V2,..."; raises ConfigError on anything else."""
    param, _, values = text.partition("=")
    try:
        numbers = [float(v) for v in values.split(",") if v.strip()]
    except ValueError as exc:
        raise ConfigError("sweep", text, "PARAM=V1,V2,... with numeric values") from exc
    if not all(map(math.isfinite, numbers)):  # nan escaped as "cannot convert float NaN"
        raise ConfigError("sweep", text, "PARAM=V1,V2,... with finite numeric values")
    if param not in SWEEP_PARAMS or not numbers:
        raise ConfigError("sweep", text, f"PARAM=V1,V2,... with PARAM in {SWEEP_PARAMS}")
    return param, numbers


def refuse_unused(args: argparse.Namespace) -> None:
    """Refuse two modes at once, and an option of a mode not asked for (which would be
    silently ignored).

    Raises:
        ConfigError: naming the option and the mode it needs.
    """
    def given(option: str) -> str | None:
        dest = OPTION_DESTS.get(option, option.removeprefix("--").replace("-", "_"))
        value = getattr(args, dest)
        if isinstance(value, list):  # an appended option: each value as given
            value = " ".join(value)
        return None if value is None or value is False else str(value)

    modes = [mode for mode in MODES if given(mode) is not None]
    if len(modes) > 1:
        raise ConfigError(modes[1], given(modes[1]),
                          f"not with {modes[0]}: one of {', '.join(MODES)} at a time")
    for option, needs in MODE_OPTIONS.items():
        if given(option) is not None and not set(needs) & set(modes):
            raise ConfigError(option, given(option), f"only with {' or '.join(needs)}")
    for option, modes_not_reading in NOT_READ_BY.items():
        if given(option) is not None and modes and modes[0] in modes_not_reading:
            raise ConfigError(option, given(option),
                              f"not with {modes[0]} ({IGNORES[modes[0]]}: it would be ignored)")


def run(args: argparse.Namespace) -> int:
    """Entry point of `kvtier simulate`; returns the exit code.

    Raises:
        ConfigError: an invalid value, two modes, an option of a mode not asked for.
    """
    refuse_unused(args)
    given_values = {"--rate": args.rate_rps, "--hbm-util": args.hbm_util}
    for dest, default in DEFAULTS.items():
        if getattr(args, dest) is None:
            setattr(args, dest, default)
    if args.validate:
        return _run_validate(args.json)
    if args.trace is not None:
        return run_trace(args)
    cfg = config_from_args(args)
    if args.write_trace is not None:
        return write_trace(args, cfg.workload, cfg.requests)
    if args.sweep is not None:
        param, values = parse_sweep(args.sweep)
        option = SWEPT_OPTIONS.get(param)
        if option is not None and given_values.get(option) is not None:
            raise ConfigError(option, given_values[option], f"not with --sweep {args.sweep} "
                              "(the sweep sets it at each value: it would be ignored)")
        if param != "cpu_gb" and not cfg.tiers:
            raise ConfigError("tier", "none", "at least one tier to compare against")
        result = _with_progress(lambda cb: sweep(cfg, param, values, cb), args.json,
                                "sweep", len(values) * 2)
        if args.plot:
            from kvtier.tools.sim.plot import plot_sweep

            plot_sweep(result, args.plot, _title(cfg, param))
        _print_sweep(result, args.json)
        if args.plot and not args.json:  # where the image went
            print(f"plot written to {args.plot}")
        return 0
    report = _with_progress(lambda cb: simulate(cfg, lambda i: cb(i, cfg.requests)),
                            args.json, "requests", cfg.requests)
    if args.json:
        print(json.dumps({"config": _config_dict(cfg), "report": report.to_dict()}, indent=2))
    else:
        _print_report(cfg, report)
    return 0


def _title(cfg: SimConfig, param: str) -> str:
    wl = cfg.workload
    return (f"{cfg.model} on {cfg.tp}x {cfg.gpu}, {cfg.requests} requests, "
            f"{wl.rate_rps:g} req/s, think {wl.think_s:g} s: sweep of {param}")


def _config_dict(cfg: SimConfig) -> dict[str, Any]:
    return asdict(cfg)


def _with_progress(work: Any, quiet: bool, what: str, total: int) -> Any:
    if quiet or not sys.stderr.isatty():
        return work(lambda done, total_: None)
    from rich.progress import Progress

    with Progress(transient=True) as progress:
        task = progress.add_task(f"simulating ({what})", total=total)
        return work(lambda done, total_: progress.update(task, completed=done, total=total_))


def _print_report(cfg: SimConfig, r: SimReport) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"kvtier simulate: {cfg.model} on {cfg.tp}x {cfg.gpu}, "
                        f"{cfg.engines} engine(s), workload {cfg.workload.rate_rps:g} req/s")
    table.add_column("metric")
    table.add_column("value", justify="right")
    rows = [
        ("requests (completed / in flight / rejected)",
         f"{r.completed} / {r.in_flight} / {r.rejected}"),
        ("simulated time", f"{r.sim_s:,.1f} s"),
        ("throughput", f"{_rate(r.throughput_tok_s, 10)} tok/s "
                       f"({_rate(r.requests_per_s, 0.1)} req/s)"),
        ("TTFT p50 / p99 / mean",
         f"{r.ttft_p50_s * 1e3:,.1f} / {r.ttft_p99_s * 1e3:,.1f} / {r.ttft_mean_s * 1e3:,.1f} ms"),
        ("GPU prefix hit rate", f"{r.gpu_hit_rate:.1%}"),
        *[(f"{t.name} tier hit rate", f"{t.hit_rate:.1%} ({t.loads:,} loads, "
           f"{t.cut_blocks:,} blocks recomputed: faster than loading)") for t in r.tiers],
        ("re-prefills avoided", f"{r.reprefills_avoided:,} ({r.tokens_loaded:,} tokens loaded)"),
        ("tokens prefilled", f"{r.prefill_tokens:,}"),
        ("preemptions (tokens recomputed)", f"{r.preemptions:,} ({r.recomputed_tokens:,})"),
        ("wall time", f"{r.wall_s:,.1f} s"),
    ]
    for name, value in rows:
        table.add_row(name, value)
    Console().print(table)


def _rate(per_s: float, small: float) -> str:
    """Whole numbers from 10, two decimals from 0.1, else two significant digits: a slow
    run's 0.0017 req/s and 0.66 tok/s read "0.00" and "0"."""
    if per_s >= max(small, 10):
        return f"{per_s:,.0f}"
    return f"{per_s:,.2f}" if per_s >= small else f"{per_s:.2g}"


def _print_sweep(result: SweepResult, as_json: bool) -> None:
    if as_json:
        print(json.dumps(asdict(result), indent=2))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"sweep of {result.param}")
    for col in ("value", "TTFT p50 off/on (ms)", "TTFT p99 off/on (ms)", "tok/s off/on",
                "GPU hit", "tier hits", "verdict"):
        table.add_column(col, justify="right")
    for p in result.points:
        b, o = p.baseline, p.offload
        table.add_row(f"{p.value:g}", f"{b.ttft_p50_s * 1e3:,.0f} / {o.ttft_p50_s * 1e3:,.0f}",
                      f"{b.ttft_p99_s * 1e3:,.0f} / {o.ttft_p99_s * 1e3:,.0f}",
                      f"{b.throughput_tok_s:,.0f} / {o.throughput_tok_s:,.0f}",
                      f"{o.gpu_hit_rate:.1%}",
                      " ".join(f"{t.name} {t.hit_rate:.1%}" for t in o.tiers), p.verdict)
    console = Console()
    console.print(table)
    pays = (f"offload never pays at the {result.param} values swept"
            if result.pays_from is None
            else f"offload starts to pay at {result.param} = {result.pays_from:g}")
    costs = (f"it only costs at {', '.join(f'{value:g}' for value in result.costs_at)}"
             if result.costs_at else "it costs at none of them")  # was "only costs at none"
    console.print(f"{pays}; {costs}")


def _run_validate(as_json: bool) -> int:
    from kvtier.tools.sim.validate import validate

    if not as_json and sys.stderr.isatty():
        print("kvtier simulate --validate: propagating each assumption through the simulator "
              "(about a minute)...", file=sys.stderr)
    rows = validate()
    if as_json:
        print(json.dumps([{**asdict(r), "ok": r.ok} for r in rows], indent=2))
    else:
        from rich.console import Console
        from rich.table import Table

        table = Table(title="kvtier simulate --validate: published figures vs the simulator "
                            "(tolerances stated from assumptions before comparing)")
        for col in ("figure", "published", "simulated", "error", "stated tolerance", "reason",
                    "pass/fail"):
            table.add_column(col, overflow="fold")
        for r in rows:
            tol = "reported only" if r.tolerance is None else f"±{r.tolerance:.0%}"
            table.add_row(r.name, f"{r.published:,.4g} {r.unit}", f"{r.model:,.4g} {r.unit}",
                          f"{r.rel_error:+.0%}", tol, r.reason,
                          "pass" if r.ok and r.tolerance is not None
                          else ("-" if r.tolerance is None else "FAIL"))
        console = Console()
        console.print(table)
        for r in rows:
            if r.explanation:
                console.print(f"[bold]{r.name}[/bold]: {r.explanation}")
    return 0 if all(r.ok for r in rows) else 1
