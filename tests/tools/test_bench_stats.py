"""The serving benchmark's statistics, workload generators and /metrics diff, on known inputs."""

from __future__ import annotations

import pytest

from kvtier.errors import ConfigError
from kvtier.tools.bench.serving import promdiff
from kvtier.tools.bench.serving.stats import (
    RequestResult,
    by_turn,
    percentile,
    percentiles,
    ratios,
    summarize,
)
from kvtier.tools.bench.serving.workloads import (
    TokenRange,
    long_doc,
    multi_round,
    next_prompt,
    prefix_repetition,
)


def result(ttft: float | None, turn: int = 0, *, prompt: int = 100, out: int = 10,
           latency: float = 1.0, itl: tuple[float, ...] = (), error: str | None = None,
           session: int = 0) -> RequestResult:
    return RequestResult(session=session, turn=turn, prompt_tokens=prompt, output_tokens=out,
                         start_s=0.0, ttft_s=ttft, latency_s=latency, itl_s=itl, error=error)


# --- statistics --------------------------------------------------------------------------------

def test_percentiles_interpolate_linearly_like_numpy():
    values = [5.0, 1.0, 4.0, 2.0, 3.0]  # unsorted on purpose
    assert percentile(values, 50) == 3.0
    assert percentile(values, 90) == pytest.approx(4.6)  # 4 + 0.6 * (5 - 4)
    assert percentile(values, 99) == pytest.approx(4.96)
    assert percentile(values, 0) == 1.0 and percentile(values, 100) == 5.0
    assert percentile([7.0], 99) == 7.0


def test_no_samples_give_none_not_zero():
    # A run where nothing completed must not report a 0 ms TTFT.
    p = percentiles([])
    assert (p.p50, p.p90, p.p99, p.mean, p.count) == (None, None, None, None, 0)


def test_percentile_outside_0_100_is_a_caller_error():
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_summary_counts_only_completed_requests_in_throughput_and_latency():
    # Three requests over 2 s: two completed (10 output tokens each), one failed.
    results = [
        result(0.1, itl=(0.01, 0.03), latency=0.5),
        result(0.3, itl=(0.02,), latency=0.7),
        result(None, error="HTTP 500", latency=0.05),
    ]
    s = summarize(results, duration_s=2.0)
    assert (s.requests, s.completed, s.failed) == (3, 2, 1)
    assert s.request_throughput_rps == 1.0
    assert s.output_throughput_tok_s == 10.0  # 20 tokens / 2 s
    assert s.total_throughput_tok_s == 110.0  # (200 prompt + 20 output) / 2 s
    assert s.ttft.p50 == pytest.approx(0.2) and s.ttft.count == 2
    assert s.itl.count == 3 and s.itl.p50 == pytest.approx(0.02)  # gaps of all requests
    assert s.latency.mean == pytest.approx(0.6)


def test_summary_rejects_a_zero_duration():
    with pytest.raises(ValueError):
        summarize([], duration_s=0.0)


def test_ttft_by_turn_groups_returning_turns():
    results = [result(0.4, turn=0), result(0.6, turn=0), result(0.1, turn=1),
               result(None, turn=1, error="timeout")]
    turns = by_turn(results)
    assert list(turns) == [0, 1]
    assert turns[0].p50 == pytest.approx(0.5)
    assert turns[1].count == 1  # the failed request is not a sample


def test_ratios_are_b_over_a_and_none_where_undefined():
    a = summarize([result(0.4), result(0.4)], duration_s=2.0)
    b = summarize([result(0.1), result(0.1)], duration_s=1.0)
    r = ratios(a, b)
    assert r["request throughput"] == pytest.approx(2.0)  # B twice as fast
    assert r["TTFT p50"] == pytest.approx(0.25)  # B's TTFT a quarter of A's
    assert r["ITL p50"] is None  # no ITL samples in either


# --- workload generators -----------------------------------------------------------------------

def test_prefix_repetition_cycles_through_exact_shared_prefixes():
    w = prefix_repetition(num_prefixes=3, prefix_len=40, suffix_len=8, output_len=5,
                          num_requests=7, seed=1)
    assert not w.chained and len(w.turns) == 7
    assert [t.session for t in w.turns] == [0, 1, 2, 0, 1, 2, 0]  # request i -> prefix i % 3
    assert [t.turn for t in w.turns] == [0, 0, 0, 1, 1, 1, 2]
    assert all(len(t.tokens) == 48 and t.max_tokens == 5 for t in w.turns)
    prefix = {t.session: t.tokens[:40] for t in w.turns}
    assert all(t.tokens[:40] == prefix[t.session] for t in w.turns)
    assert len(set(prefix.values())) == 3  # distinct prefixes
    assert len({t.tokens[40:] for t in w.turns}) == 7  # every suffix its own


def test_generators_are_deterministic_for_a_seed_and_differ_across_seeds():
    for make in (prefix_repetition, multi_round, long_doc):
        assert make(seed=3) == make(seed=3)
        assert make(seed=3).turns != make(seed=4).turns


def test_token_ids_stay_in_the_requested_range():
    w = long_doc(docs=2, doc_len=300, questions=2, token_ids=TokenRange(10, 20))
    assert {tok for t in w.turns for tok in t.tokens} <= set(range(10, 20))
    assert TokenRange.parse("3:500") == TokenRange(3, 500)
    with pytest.raises(ConfigError):
        TokenRange.parse("500:3")


@pytest.mark.parametrize(("text", "allowed"), [
    ("500:3", "LOW:HIGH with 0 <= LOW < HIGH"), ("5:5", "LOW:HIGH with 0 <= LOW < HIGH"),
    ("3", "LOW:HIGH, two integers"), ("a:9", "LOW:HIGH, two integers")])
def test_token_ids_out_of_order_are_refused_saying_so(text: str, allowed: str) -> None:
    """`--token-ids 500:3` was refused as "LOW:HIGH, two integers": the range's own refusal
    (a ConfigError, a ValueError) was caught as a number that did not parse."""
    with pytest.raises(ConfigError) as refused:
        TokenRange.parse(text)
    assert refused.value.allowed == allowed


def test_multi_round_history_grows_by_answer_and_new_user_tokens():
    w = multi_round(users=2, turns=3, first_len=50, user_len=10, output_len=4, seed=0)
    assert w.chained
    # Round-robin: every user's turn 0, then every user's turn 1, ...
    assert [(t.session, t.turn) for t in w.turns] == [(0, 0), (1, 0), (0, 1), (1, 1),
                                                      (0, 2), (1, 2)]
    prompts = dict(zip(((t.session, t.turn) for t in w.turns), w.static_prompts()))
    turn = {(t.session, t.turn): t for t in w.turns}
    for user in (0, 1):
        assert len(prompts[(user, 0)]) == 50
        for k in (1, 2):
            prev = prompts[(user, k - 1)]
            answer = turn[(user, k - 1)].filler_answer
            assert len(answer) == 4
            # Exactly: previous prompt + previous answer + this turn's new user tokens.
            assert prompts[(user, k)] == prev + answer + turn[(user, k)].tokens
            assert len(prompts[(user, k)]) == len(prev) + 4 + 10
    assert w.max_prompt_tokens() == 50 + 2 * (4 + 10)
    # A server's real answer replaces the filler token-exactly.
    assert next_prompt(turn[(0, 1)], (1, 2), (3,)) == (1, 2, 3, *turn[(0, 1)].tokens)


def test_multi_round_users_do_not_depend_on_the_number_of_users():
    few, many = multi_round(users=2, seed=5), multi_round(users=5, seed=5)
    assert [t for t in few.turns if t.session == 1] == [t for t in many.turns if t.session == 1]


def test_long_doc_asks_every_document_before_the_next_question():
    w = long_doc(docs=3, doc_len=100, questions=2, question_len=7)
    assert [(t.session, t.turn) for t in w.turns] == [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1),
                                                      (2, 1)]
    docs = {t.session: t.tokens[:100] for t in w.turns}
    assert all(t.tokens[:100] == docs[t.session] and len(t.tokens) == 107 for t in w.turns)
    assert w.turns[0].tokens[100:] != w.turns[3].tokens[100:]  # two different questions


def test_limit_keeps_the_first_requests_in_order():
    w = prefix_repetition(num_requests=10)
    assert w.limit(3).turns == w.turns[:3]
    assert w.limit(None) is w and w.limit(99) is w


@pytest.mark.parametrize("bad", [{"users": 0}, {"turns": -1}, {"first_len": 1.5}])
def test_bad_sizes_raise_config_error_naming_the_field(bad):
    with pytest.raises(ConfigError) as err:
        multi_round(**bad)
    assert err.value.field == next(iter(bad))


# --- /metrics diff -----------------------------------------------------------------------------

METRICS_BEFORE = """\
# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 100.0
vllm:prefix_cache_queries_created{engine="0",model_name="m"} 1.7e9
# TYPE vllm:prefix_cache_hits counter
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 10.0
# TYPE vllm:external_prefix_cache_queries counter
vllm:external_prefix_cache_queries_total{engine="0",model_name="m"} 0.0
# TYPE vllm:kvtier_tier_hits counter
vllm:kvtier_tier_hits_total{engine="0",tier="memory"} 5.0
# TYPE vllm:kvtier_tier_queries counter
vllm:kvtier_tier_queries_total{engine="0",tier="memory"} 10.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5
"""
METRICS_AFTER = """\
# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 300.0
vllm:prefix_cache_queries_total{engine="1",model_name="m"} 100.0
# TYPE vllm:prefix_cache_hits counter
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 160.0
vllm:prefix_cache_hits_total{engine="1",model_name="m"} 50.0
# TYPE vllm:external_prefix_cache_queries counter
vllm:external_prefix_cache_queries_total{engine="0",model_name="m"} 0.0
# TYPE vllm:kvtier_tier_hits counter
vllm:kvtier_tier_hits_total{engine="0",tier="memory"} 12.0
vllm:kvtier_tier_hits_total{engine="0",tier="disk"} 3.0
# TYPE vllm:kvtier_tier_queries counter
vllm:kvtier_tier_queries_total{engine="0",tier="memory"} 20.0
vllm:kvtier_tier_queries_total{engine="0",tier="disk"} 13.0
# TYPE vllm:kvtier_lookup_tokens counter
vllm:kvtier_lookup_tokens_total{engine="0"} 512.0
# TYPE vllm:kvtier_lookup_hit_tokens counter
vllm:kvtier_lookup_hit_tokens_total{engine="0"} 256.0
# TYPE vllm:kvtier_tier_used_bytes gauge
vllm:kvtier_tier_used_bytes{engine="0",tier="memory"} 4096.0
"""


def test_metrics_diff_sums_engines_and_subtracts_before():
    delta = promdiff.diff(promdiff.parse_metrics(METRICS_BEFORE),
                          promdiff.parse_metrics(METRICS_AFTER))
    assert delta["vllm:prefix_cache_queries_total"] == 300.0  # 400 over two engines - 100
    assert delta["vllm:prefix_cache_hits_total"] == 200.0
    # Labels other than engine/model_name are kept; a new label set counts from 0.
    assert delta["vllm:kvtier_tier_hits_total{tier=memory}"] == 7.0
    assert delta["vllm:kvtier_tier_hits_total{tier=disk}"] == 3.0
    assert delta["vllm:kvtier_tier_used_bytes{tier=memory}"] == 4096.0  # a gauge: its value
    assert not any(k.endswith("_created") or "usage_perc" in k for k in delta)
    rates = promdiff.hit_rates(delta)
    assert rates["prefix_cache"] == pytest.approx(200 / 300)
    assert rates["external_prefix_cache"] is None  # no connector queries: no rate, not 0 %
    assert rates["kvtier_tier:memory"] == pytest.approx(7 / 10)
    assert rates["kvtier_tier:disk"] == pytest.approx(3 / 13)
    assert rates["kvtier_lookup"] == pytest.approx(0.5)


def test_report_table_shows_hit_rates_per_kvtier_tier_and_ratios():
    from rich.console import Console

    from kvtier.tools.bench.serving.client import WorkloadRun
    from kvtier.tools.bench.serving.report import summary_table
    from kvtier.tools.bench.serving.runner import BenchRun

    delta = promdiff.diff(promdiff.parse_metrics(METRICS_BEFORE),
                          promdiff.parse_metrics(METRICS_AFTER))

    def run(label: str, ttft: float, metrics: dict[str, float] | None) -> BenchRun:
        results = (result(ttft, turn=0), result(ttft, turn=1))
        return BenchRun(label, "http://x", "m", "multi-round", {}, WorkloadRun(results, 1.0, True),
                        summarize(results, 1.0), metrics, promdiff.hit_rates(metrics or {}))

    console = Console(record=True, width=200)
    console.print(summary_table([run("without", 0.4, None), run("with", 0.1, delta)]))
    text = console.export_text()
    assert "with / without" in text
    assert "kvtier memory tier hit rate" in text and "70.0%" in text
    assert "kvtier lookup hit rate" in text and "50.0%" in text
    assert "0.25x" in text  # TTFT p50 of "with" is a quarter of "without"


def test_the_itl_row_compares_each_of_its_three_percentiles():
    """The row shows ITL p50 / p90 / p99 for each run; its B / A cell once held p50's ratio
    alone, which read as the ratio of all three (or of p99, the tail the row is read for)."""
    from rich.console import Console

    from kvtier.tools.bench.serving.client import WorkloadRun
    from kvtier.tools.bench.serving.report import summary_table
    from kvtier.tools.bench.serving.runner import BenchRun

    def run(label: str, gaps: tuple[float, ...]) -> BenchRun:
        results = (result(0.1, itl=gaps),)
        return BenchRun(label, "http://x", "m", "multi-round", {},
                        WorkloadRun(results, 1.0, True), summarize(results, 1.0), None, {})

    steady = tuple([0.010] * 100)
    tail = tuple([0.010] * 50 + [0.020] * 49 + [0.100])  # p50 1.5x, p90 2x, p99 2.08x
    console = Console(record=True, width=200)
    console.print(summary_table([run("a", steady), run("b", tail)]))
    [row] = [line for line in console.export_text().splitlines() if "ITL p50" in line]
    assert row.split("│")[-2].split() == ["1.50x", "/", "2.00x", "/", "2.08x"]
    r = ratios(summarize([result(0.1, itl=steady)], 1.0), summarize([result(0.1, itl=tail)], 1.0))
    assert (r["ITL p90"], r["ITL p99"]) == (pytest.approx(2.0), pytest.approx(2.08))


def test_every_bench_help_renders(capsys):
    # argparse %-formats help strings: a stray "%" in a generator's docstring broke --help.
    from kvtier.tools.cli.main import main

    for argv in (["bench", "--help"], ["bench", "multi-round", "--help"], ["serve", "--help"]):
        with pytest.raises(SystemExit) as done:
            main(argv)
        assert done.value.code == 0
    assert "prefix-repetition" in capsys.readouterr().out
