"""What the field's benchmark clients print, read back: `kvtier bench clients`' figures.

The clients (vLLM's benchmarks/multi_turn/benchmark_serving_multi_turn.py and LMCache's
benchmarks/long_doc_qa/long_doc_qa.py, vendored unmodified under vendor/) report in their own
formats; this module reads those formats, so that a change in a client's output breaks a test
on a saved sample (tests/data/bench-clients/) rather than the figures.

Primitives:
  - `ClientFigures`: one client's run against one server, its figures by name.
  - `parse_multi_turn(stdout, stats)`: from the multi-turn client's summary and its
    `--stats-json-output` file (per request).
  - `parse_long_doc_qa(stdout, query_csv)`: from long_doc_qa's summary and its
    `query_round.csv` (per request of the query round).
  - `multi_turn_answers(conversations)`, `long_doc_qa_answers(responses)`: each client's
    answers (its `--output-file` / `--output`), to count those equal across servers.
  - `METRICS`: the figures shown, each with its unit and whether lower is better;
    `ratio(metric, plain, kvtier)`: how many times better kvtier is.
"""

from __future__ import annotations

import csv
import io
import re
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

MULTI_TURN, LONG_DOC_QA = "multi-turn", "long-doc-qa"
CLIENTS = (MULTI_TURN, LONG_DOC_QA)


@dataclass(frozen=True, slots=True)
class Metric:
    """A figure a client reports (or that is computed from its per-request output)."""

    label: str  # as the table shows it
    unit: str  # "ms", "req/s", "s", "" (a count)
    lower_is_better: bool  # TTFT, times: kvtier's gain is plain / kvtier; rates: kvtier / plain


METRICS: dict[str, Metric] = {
    "requests": Metric("requests completed", "", lower_is_better=False),
    "ttft_mean_ms": Metric("TTFT mean", "ms", lower_is_better=True),
    "ttft_p50_ms": Metric("TTFT p50", "ms", lower_is_better=True),
    "returning_ttft_mean_ms": Metric("TTFT mean, returning turns", "ms", lower_is_better=True),
    "returning_ttft_p50_ms": Metric("TTFT p50, returning turns", "ms", lower_is_better=True),
    "warmup_ttft_mean_ms": Metric("TTFT mean, warm-up round", "ms", lower_is_better=True),
    "runtime_s": Metric("run time", "s", lower_is_better=True),
    "requests_per_s": Metric("requests/s", "req/s", lower_is_better=False),
}

# The terminal colours both clients print (ANSI SGR sequences).
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


# kvtier's counters a run reports (metrics.py): what its hits and stores cost in chunks
# (tier_hits: chunk reads the tiers served) and in bytes.
KVTIER_COUNTERS = ("lookup_hit_tokens", "loaded_tokens", "loaded_bytes", "tier_hits",
                   "stored_tokens", "stored_bytes", "tier_bytes_read", "tier_bytes_written")


@dataclass(frozen=True, slots=True)
class ClientFigures:
    """One client's run against one server."""

    client: str  # one of CLIENTS
    setup: str  # "vLLM" or "vLLM + kvtier"
    figures: dict[str, float]  # keys of METRICS; those the client's output did not give absent
    answers: dict[str, str] = field(default_factory=dict)  # by conversation turn / prompt
    prompt_tokens: float | None = None  # the server's vllm:prompt_tokens_total during the run
    kvtier_hit_tokens: float | None = None  # its vllm:external_prefix_cache_hits_total
    engine_hit_tokens: float | None = None  # its vllm:prefix_cache_hits_total
    # kvtier's counters over the run (KVTIER_COUNTERS, summed over their labels)
    kvtier: dict[str, float] = field(default_factory=dict)


def plain_text(stdout: str) -> str:
    """`stdout` without terminal colours."""
    return _ANSI.sub("", stdout)


def _number(pattern: str, text: str) -> float | None:
    """The number `pattern`'s group matches on the last line that it matches."""
    found = re.findall(pattern, text, re.MULTILINE)
    return float(found[-1]) if found else None


def _p50(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def _mean(values: Sequence[float]) -> float | None:
    return statistics.fmean(values) if values else None


def _kept(figures: Mapping[str, float | None]) -> dict[str, float]:
    return {k: v for k, v in figures.items() if v is not None}


def parse_multi_turn(stdout: str, stats: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """Figures of a multi-turn client run.

    Args:
        stdout: what it printed (its statistics summary: `runtime_sec = ...`,
            `requests_per_sec = ...`; colours allowed).
        stats: its `--stats-json-output` file, parsed: one object per completed request
            (`ttft_ms`, `input_num_turns`: 1 for a conversation's first turn, 3, 5, ... after).

    Returns:
        The figures (keys of METRICS) found; a summary line missing leaves its figure out.
    """
    text = plain_text(stdout)
    ttft = [float(s["ttft_ms"]) for s in stats]
    returning = [float(s["ttft_ms"]) for s in stats if int(s["input_num_turns"]) > 1]
    return _kept({
        "requests": float(len(stats)),
        "ttft_mean_ms": _mean(ttft), "ttft_p50_ms": _p50(ttft),
        "returning_ttft_mean_ms": _mean(returning), "returning_ttft_p50_ms": _p50(returning),
        "runtime_s": _number(r"^runtime_sec = ([0-9.]+)\s*$", text),
        "requests_per_s": _number(r"^requests_per_sec = ([0-9.]+)\s*$", text),
    })


def parse_long_doc_qa(stdout: str, query_csv: str) -> dict[str, float]:
    """Figures of a long_doc_qa run (its query round: every document asked again).

    Args:
        stdout: what it printed (`Query round mean TTFT: 0.123s`, `Query round time: ...`,
            `Warmup round mean TTFT: ...`; colours allowed).
        query_csv: its query_round.csv (columns prompt_id, ttft (s), successful, ...).

    Returns:
        The figures (keys of METRICS) found; TTFT in ms, requests/s over the query round.
    """
    text = plain_text(stdout)
    rows = list(csv.DictReader(io.StringIO(query_csv)))
    ok = [float(r["ttft"]) * 1e3 for r in rows if r.get("successful") == "True"]
    mean_s = _number(r"^Query round mean TTFT: ([0-9.]+)s\s*$", text)
    warm_s = _number(r"^Warmup round mean TTFT: ([0-9.]+)s\s*$", text)
    round_s = _number(r"^Query round time: ([0-9.]+)s\s*$", text)
    return _kept({
        "requests": float(len(ok)),
        "ttft_mean_ms": None if mean_s is None else mean_s * 1e3,
        "ttft_p50_ms": _p50(ok),
        "warmup_ttft_mean_ms": None if warm_s is None else warm_s * 1e3,
        "runtime_s": round_s,
        "requests_per_s": len(ok) / round_s if round_s else None,
    })


def multi_turn_answers(conversations: Sequence[Mapping[str, Any]]) -> dict[str, str]:
    """The answers in the multi-turn client's `--output-file` (the conversations it finished,
    with the server's answers), keyed "<conversation id>/<answer number>"."""
    found: dict[str, str] = {}
    for conv in conversations:
        answers = [m for m in conv["messages"] if m["role"] == "assistant"]
        for i, message in enumerate(answers):
            found[f"{conv['id']}/{i}"] = str(message["content"])
    return found


_RESPONSE = re.compile(r"\nResponse of request (\d+): (.*?)\n"
                       r"(?=\n--- Sending prompt |\nResponse of request |------|\Z)", re.DOTALL)


def long_doc_qa_answers(responses: str) -> dict[str, str]:
    """The query round's answers in long_doc_qa's `--output` file, keyed by prompt index (the
    round's order is the same run after run: its --shuffle-seed)."""
    _, _, query = responses.partition("------query round------")
    return dict(_RESPONSE.findall(query))


def equal_answers(plain: Mapping[str, str], kvtier: Mapping[str, str]) -> tuple[int, int]:
    """(answers equal, answers compared) over the keys both runs answered."""
    common = plain.keys() & kvtier.keys()
    return sum(plain[k] == kvtier[k] for k in common), len(common)


def ratio(metric: str, plain: float | None, kvtier: float | None) -> float | None:
    """How many times better kvtier's figure is than plain vLLM's (> 1: better): plain /
    kvtier where lower is better, kvtier / plain otherwise; None without both, or a zero."""
    if plain is None or kvtier is None or plain <= 0 or kvtier <= 0:
        return None
    return plain / kvtier if METRICS[metric].lower_is_better else kvtier / plain
