"""`kvtier bench clients`' pure parts (issue 44): what the field's clients print and write is
read back right, from real outputs of the vendored clients saved under
tests/data/bench-clients/ (a `kvtier bench clients --quick` run, vLLM + kvtier; the responses
file of plain vLLM beside it); their command lines and inputs; the ratios and the table. The
servers' run is measured by the command itself (docs/performance.md): two vLLM start-ups do
not fit a unit test's minute."""

from __future__ import annotations

import argparse
import io
import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console

from kvtier.errors import ConfigError
from kvtier.tools.bench.clients import (
    LONG_DOC_QA_SCRIPT,
    MULTI_TURN_SCRIPT,
    PLANS,
    SETUPS,
    ClientsConfig,
    ClientsResult,
    corpus_text,
    corpus_words,
    long_doc_qa_argv,
    multi_turn_argv,
    multi_turn_input,
)
from kvtier.tools.bench.clients_results import (
    CLIENTS,
    LONG_DOC_QA,
    MULTI_TURN,
    ClientFigures,
    equal_answers,
    long_doc_qa_answers,
    multi_turn_answers,
    parse_long_doc_qa,
    parse_multi_turn,
    ratio,
)
from kvtier.tools.cli.bench_clients import client_table, config_from

DATA = Path(__file__).resolve().parent.parent / "data" / "bench-clients"


def _read(name: str) -> str:
    return (DATA / name).read_text()


def test_the_multi_turn_clients_summary_and_stats_are_read() -> None:
    stats = json.loads(_read("multi-turn-stats.json"))
    figures = parse_multi_turn(_read("multi-turn.log"), stats)
    # The summary's lines, as it prints them (in colour): runtime_sec = 1.094 ...
    assert figures["runtime_s"] == pytest.approx(1.094)
    assert figures["requests_per_s"] == pytest.approx(10.965)
    assert figures["requests"] == len(stats) == 12
    ttft = [s["ttft_ms"] for s in stats]
    returning = [s["ttft_ms"] for s in stats if s["input_num_turns"] > 1]
    assert 0 < len(returning) < len(stats)
    assert figures["ttft_mean_ms"] == pytest.approx(statistics.fmean(ttft))
    assert figures["ttft_p50_ms"] == pytest.approx(statistics.median(ttft))
    assert figures["returning_ttft_p50_ms"] == pytest.approx(statistics.median(returning))


def test_the_long_doc_qa_summary_and_query_round_are_read() -> None:
    csv_text = _read("long-doc-qa-query_round.csv")
    figures = parse_long_doc_qa(_read("long-doc-qa.log"), csv_text)
    assert figures["ttft_mean_ms"] == pytest.approx(72.0)  # "Query round mean TTFT: 0.072s"
    assert figures["warmup_ttft_mean_ms"] == pytest.approx(198.0)
    assert figures["runtime_s"] == pytest.approx(0.367)
    assert figures["requests"] == 6
    assert figures["requests_per_s"] == pytest.approx(6 / 0.367)
    ttfts = [float(line.split(",")[2]) * 1e3 for line in csv_text.splitlines()[1:]]
    assert figures["ttft_p50_ms"] == pytest.approx(statistics.median(ttfts))


def test_a_summary_line_missing_leaves_its_figure_out() -> None:
    figures = parse_long_doc_qa("Query round mean TTFT: nans\n", "prompt_id,ttft,successful\n")
    assert figures == {"requests": 0.0}
    assert "runtime_s" not in parse_multi_turn("", [])


def test_answers_are_read_by_prompt_and_by_conversation_turn() -> None:
    kvtier = long_doc_qa_answers(_read("long-doc-qa-responses.txt"))
    plain = long_doc_qa_answers(_read("long-doc-qa-responses-vllm.txt"))
    # The query round's only (the warm-up round's answers come first in the file).
    assert sorted(kvtier, key=int) == [str(i) for i in range(6)]
    assert equal_answers(plain, kvtier) == (6, 6)
    convs = json.loads(_read("multi-turn-conversations.json"))
    answers = multi_turn_answers(convs)
    # The conversations it finished (4 of 6), each with its 2 or 3 answers.
    assert set(answers) == {f"{c['id']}/{i}" for c in convs
                            for i in range(len(c["messages"]) // 2)}
    assert len(answers) == 10
    changed = {**answers, next(iter(answers)): "something else"}
    assert equal_answers(answers, changed) == (len(answers) - 1, len(answers))
    assert equal_answers(answers, {}) == (0, 0)


def test_an_answer_with_newlines_is_kept_whole() -> None:
    text = ("------warm up round------\n\n--- Sending prompt 1/1 ---\n\nResponse of request 0: "
            "warm\n------query round------\n\n--- Sending prompt 1/2 ---\n\n--- Sending prompt "
            "2/2 ---\n\nResponse of request 1: two\nlines\n\nResponse of request 0: one\n")
    assert long_doc_qa_answers(text) == {"1": "two\nlines", "0": "one"}


def test_the_multi_turn_input_asks_for_the_plans_conversations(tmp_path: Path) -> None:
    plan = PLANS["full"]
    conf = multi_turn_input(plan, tmp_path / "corpus.txt")
    assert conf["num_conversations"] == 24
    assert conf["prompt_input"]["num_turns"] == {"distribution": "uniform", "min": 8, "max": 12}
    assert conf["text_files"] == [str(tmp_path / "corpus.txt")]
    text = corpus_text(corpus_words(plan))
    assert text == corpus_text(corpus_words(plan))  # the same text every run
    assert len(text.split()) == corpus_words(plan)


def test_the_clients_command_lines() -> None:
    plan = PLANS["full"]
    argv = multi_turn_argv(plan, model_dir=Path("/m"), model_name="kvtier-bench",
                           url="http://h:1", input_file=Path("in.json"),
                           stats_file=Path("s.json"), output_file=Path("c.json"))
    assert argv[:2] == [sys.executable, str(MULTI_TURN_SCRIPT)]
    assert "--no-early-stop" in argv
    flags = dict(zip(argv[2::2], argv[3::2]))
    assert flags["--model"] == "/m" and flags["--served-model-name"] == "kvtier-bench"
    assert flags["--num-clients"] == "2" and flags["--max-active-conversations"] == "8"
    argv = long_doc_qa_argv(plan, model_name="kvtier-bench", url="http://h:1",
                            responses_file=Path("r.txt"))
    assert argv[:2] == [sys.executable, str(LONG_DOC_QA_SCRIPT)]
    flags = dict(zip(argv[2:-1:2], argv[3:-1:2]))
    assert flags["--base-url"] == "http://h:1/v1" and flags["--num-documents"] == "8"
    assert argv[-1] == "--json-output"


@pytest.mark.slow  # ~20 s: the multi-turn client imports vllm
def test_the_vendored_clients_parse_their_flags() -> None:
    """The multi-turn client (its imports: pandas, aiohttp, transformers, vllm) gets as far as
    argparse; long_doc_qa's --help is broken upstream, so its flags are checked by a bad one."""
    pytest.importorskip("pandas")
    pytest.importorskip("vllm", reason="the multi-turn client imports vllm.benchmarks")
    done = subprocess.run([sys.executable, str(MULTI_TURN_SCRIPT), "--help"],
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0 and "--stats-json-output" in done.stdout
    done = subprocess.run([sys.executable, str(LONG_DOC_QA_SCRIPT), "--no-such-flag"],
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 2 and "--no-such-flag" in done.stderr


def _args(**overrides: object) -> argparse.Namespace:
    values: dict[str, object] = {"quick": False, "client": None, "model_root": Path("models"),
                                 "serial": False, "tokens_per_chunk": None,
                                 "no_tail_chunks": False}
    return argparse.Namespace(**{**values, **overrides})


def test_arguments_choose_the_plan_and_the_clients() -> None:
    config = config_from(_args(), Path("/scratch"))
    assert config.plan is PLANS["full"] and config.clients == CLIENTS
    config = config_from(_args(quick=True, client=[LONG_DOC_QA]), Path("/s"))
    assert config.plan is PLANS["quick"] and config.clients == (LONG_DOC_QA,)
    assert config.connector == ()
    # One request at a time, kvtier's chunk size and tails (issue 44's sweep).
    config = config_from(_args(serial=True, tokens_per_chunk=32, no_tail_chunks=True),
                         Path("/s"))
    assert (config.plan.clients, config.plan.inflight, config.plan.name) == (1, 1, "full-serial")
    assert config.connector == (("tokens_per_chunk", 32), ("tail_chunks", False))


@pytest.mark.parametrize(("overrides", "field"), [
    ({"conversations": 0}, "conversations"),
    ({"user_turns": (3, 2)}, "user_turns"),
    ({"active": 30}, "active"),
    ({"active": 1}, "active"),
])
def test_a_bad_plan_names_its_field(overrides: dict[str, object], field: str) -> None:
    import dataclasses

    with pytest.raises(ConfigError, match=field):
        dataclasses.replace(PLANS["full"], **overrides).validate()  # type: ignore[arg-type]


def test_ratios_say_how_many_times_better_kvtier_is() -> None:
    assert ratio("ttft_mean_ms", 500.0, 100.0) == pytest.approx(5.0)
    assert ratio("requests_per_s", 1.0, 2.5) == pytest.approx(2.5)
    assert ratio("ttft_mean_ms", None, 100.0) is None
    assert ratio("ttft_mean_ms", 0.0, 100.0) is None


def _result() -> ClientsResult:
    runs = (
        ClientFigures(MULTI_TURN, SETUPS[0], {"requests": 80.0, "ttft_mean_ms": 600.0,
                                              "requests_per_s": 1.0}, {"a/0": "x", "b/0": "y"},
                      prompt_tokens=1000.0, kvtier_hit_tokens=0.0, engine_hit_tokens=10.0),
        ClientFigures(MULTI_TURN, SETUPS[1], {"requests": 80.0, "ttft_mean_ms": 120.0,
                                              "requests_per_s": 2.0}, {"a/0": "x", "b/0": "z"},
                      prompt_tokens=1000.0, kvtier_hit_tokens=800.0, engine_hit_tokens=10.0),
    )
    config = ClientsConfig(PLANS["quick"], Path("/w"), Path("/m"), clients=(MULTI_TURN,))
    return ClientsResult(config, runs, ("a", "b"), 60.0,
                         {"cpus": 2, "loadavg_before": (1, 1, 1), "loadavg_after": (1, 1, 1)})


def test_the_table_shows_each_setup_and_kvtiers_gain(tmp_path: Path) -> None:
    result = _result()
    assert result.ratios(MULTI_TURN) == {"ttft_mean_ms": pytest.approx(5.0),
                                         "requests_per_s": pytest.approx(2.0)}
    assert result.answers_equal(MULTI_TURN) == (1, 2)
    assert result.ratios(LONG_DOC_QA) == {} and result.answers_equal(LONG_DOC_QA) is None
    out = io.StringIO()
    Console(file=out, width=200).print(client_table(result, MULTI_TURN))
    text = out.getvalue()
    assert "5.00x" in text and "2.00x" in text and "1 / 2" in text
    assert "800 / 10 of 1,000" in text
    result.write_json(tmp_path / "r.json", "kvtier bench clients")
    written = json.loads((tmp_path / "r.json").read_text())
    assert written["kvtier_vs_vllm"]["multi-turn"]["ttft_mean_ms"] == pytest.approx(5.0)
    assert written["answers_equal"]["multi-turn"] == [1, 2]
