"""`kvtier simulate --trace`: a slice of the real Mooncake conversation trace replayed through
kvtier's policies, against the optimum and unbounded (issue 45).

The slice is the trace's first requests, written to tmp; where the shared trace is absent, a
small trace of the same format built here stands in (conversations that return, one-shot
prompts off a shared system prompt)."""

from __future__ import annotations

import io
import json
import random
from contextlib import redirect_stdout
from pathlib import Path

import pytest

from kvtier.errors import ConfigError
from kvtier.tools.cli.main import main
from kvtier.tools.ops.hardware import gpu_profile
from kvtier.tools.sim.cost import build_cost_model, model_spec
from kvtier.tools.sim.optimum import optimum, unbounded
from kvtier.tools.sim.replay import parse_policy, replay
from kvtier.tools.sim.trace import ROOT, read_trace
from kvtier.tools.sim.tracesweep import parse_tokens

SHARED_TRACE = (Path(__file__).resolve().parents[3]
                / "shared/traces/mooncake_conversation_trace.jsonl")
SLICE = 1500  # requests: enough for conversations to return, a second or two per replay


def _synthetic_lines() -> list[str]:
    """Mooncake-format lines: 40 conversations of up to 6 turns among one-shot prompts."""
    rng = random.Random(45)
    next_id = 1
    lines = []
    chats: list[list[int]] = []
    for t in range(SLICE):
        if chats and rng.random() < 0.4:
            chat = rng.choice(chats)
            chat.extend(range(next_id, next_id + 2))
            next_id += 2
            ids = chat
        else:
            ids = [0, *range(next_id, next_id + rng.randint(2, 20))]
            next_id = ids[-1] + 1
            if rng.random() < 0.3 and len(chats) < 40:
                chats.append(list(ids))
        lines.append(json.dumps({"timestamp": t * 300, "input_length": len(ids) * 512 - 100,
                                 "output_length": 10, "hash_ids": ids}))
    return lines


@pytest.fixture(scope="module")
def trace_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("trace") / "slice.jsonl"
    if SHARED_TRACE.is_file():
        with open(SHARED_TRACE, encoding="utf-8") as source:
            lines = [next(source).rstrip("\n") for _ in range(SLICE)]
    else:
        lines = _synthetic_lines()
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def cost():  # type: ignore[no-untyped-def]
    return build_cost_model(model_spec("llama-3.1-8b"), gpu_profile("h100"))


def test_keys_are_chained_so_a_shared_key_means_a_shared_prefix(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text('{"hash_ids": [1, 2, 3], "input_length": 1500}\n'
                    '{"hash_ids": [9, 2, 3], "input_length": 1536}\n'
                    '{"block_hashes": [1, 2]}\n', encoding="utf-8")
    trace = read_trace(path, block_tokens=512)
    first, second, third = trace.requests
    assert len(first.keys) == 2  # 1500 tokens: two full blocks, the partial third not stored
    assert first.parents == (ROOT, first.keys[0])
    assert second.keys[1] != first.keys[1]  # block "2" after another first block: another key
    assert third.keys == first.keys  # the same prefix: the same keys
    tokens = tmp_path / "tokens.jsonl"
    tokens.write_text('{"tokens": [5, 6, 7, 8, 9]}\n{"tokens": [5, 6, 7, 0]}\n', encoding="utf-8")
    a, b = read_trace(tokens, block_tokens=2).requests
    assert len(a.keys) == 2 and a.input_tokens == 5  # [5, 6], [7, 8]; the 9 is not a block
    assert b.keys[0] == a.keys[0] and b.keys[1] != a.keys[1]


@pytest.mark.parametrize("line", ['{"hash_ids": "x"}', "[1, 2]", "{not json",
                                  '{"hash_ids": [1], "input_length": 99999}', '{"other": 1}'])
def test_a_bad_line_is_a_config_error_naming_it(tmp_path: Path, line: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"hash_ids": [1]}\n' + line + "\n", encoding="utf-8")
    with pytest.raises(ConfigError, match="trace line 2"):
        read_trace(path)


def test_the_optimum_bounds_every_policy_and_unbounded_bounds_it(trace_file, cost) -> None:  # type: ignore[no-untyped-def]
    trace = read_trace(trace_file)
    ceiling = unbounded(trace, cost)
    for blocks in (200, 1000, 4000):
        best = optimum(trace, blocks, cost)
        assert best.block_hits == best.held_uses  # its cache stayed prefix-closed: exact
        assert best.result.hit_tokens <= ceiling.hit_tokens
        for name in ("lru", "arc", "clock", "lru+admit2", "prefix", "prefix+admit2"):
            result = replay(trace, parse_policy(name), blocks, cost)
            assert result.hit_tokens <= best.result.hit_tokens, (name, blocks)
            assert 0 <= result.prefill_s_saved <= result.prefill_s_total
    assert optimum(trace, 10**9, cost).result.hit_tokens == ceiling.hit_tokens


def test_a_larger_cache_never_hits_less_under_the_optimum(trace_file, cost) -> None:  # type: ignore[no-untyped-def]
    trace = read_trace(trace_file)
    hits = [optimum(trace, blocks, cost).result.hit_tokens for blocks in (0, 100, 400, 1600)]
    assert hits == sorted(hits) and hits[0] == 0


def test_the_prefix_policy_gets_the_parents_and_beats_lru_where_one_shots_flush_it(
        trace_file, cost) -> None:  # type: ignore[no-untyped-def]
    """At a capacity of minutes of traffic, LRU is flushed by one-shot prompts before a
    conversation's next turn; the prefix policy keeps what was read before (issue 45's
    measurement, on the slice; the synthetic stand-in has the same shape)."""
    trace = read_trace(trace_file)
    for blocks in (600, 2000):
        lru = replay(trace, parse_policy("lru"), blocks, cost)
        prefix = replay(trace, parse_policy("prefix"), blocks, cost)
        assert prefix.hit_tokens > lru.hit_tokens, blocks


@pytest.mark.parametrize("text", ["lru+admit0", "mru", "arc+admitx"])
def test_an_unknown_policy_is_refused(text: str) -> None:
    with pytest.raises(ConfigError):
        parse_policy(text)


def test_token_counts_take_suffixes() -> None:
    assert [parse_tokens(t) for t in ("300k", "1M", "2.5m", "1000")] == \
        [300_000, 1_000_000, 2_500_000, 1000]
    with pytest.raises(ConfigError):
        parse_tokens("lots")


def test_the_command_writes_json_and_a_plot(trace_file, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    plot = tmp_path / "hit.png"
    out = io.StringIO()
    with redirect_stdout(out):
        code = main(["simulate", "--trace", str(trace_file), "--capacity", "100k,1M",
                     "--policies", "lru,arc+admit2", "--json", "--plot", str(plot)])
    assert code == 0
    data = json.loads(out.getvalue())
    assert data["requests"] == SLICE and data["block_tokens"] == 512
    assert [p["capacity_tokens"] for p in data["points"]] == [99_840, 999_936]
    for point in data["points"]:
        assert [r["policy"] for r in point["policies"]] == ["lru", "arc+admit2"]
        assert point["optimum_prefix_closed"] is True
        for result in point["policies"]:
            assert set(result) >= {"hit_ratio", "of_optimum", "hit_tokens", "prefill_s_saved",
                                   "evictions"}
            assert 0 <= result["of_optimum"] <= 1
    assert data["unbounded"]["capacity_tokens"] is None
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_command_refuses_a_missing_trace_in_one_line(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    code = main(["simulate", "--trace", str(tmp_path / "none.jsonl")])
    assert code == 2
    err = capsys.readouterr().err
    assert "trace" in err and "Traceback" not in err


def test_pooled_and_private_caches_on_the_trace(trace_file, cost) -> None:  # type: ignore[no-untyped-def]
    """kvtier node's case: one cache for the engines against one each, same total bytes."""
    from kvtier.tools.sim.pooling import compare, split

    trace = read_trace(trace_file)
    lru = parse_policy("lru")
    for route in ("session", "round_robin"):
        shares = split(trace, 4, route)
        assert sorted(id(r) for share in shares for r in share.requests) \
            == sorted(map(id, trace.requests))  # every request to exactly one engine
    one = compare(trace, lru, 2000, cost, 1, "round_robin")  # one engine: nothing to pool
    assert one.pooled_hit_ratio == one.private_hit_ratio
    # A conversation whose turns land on other engines finds its history only when pooled.
    four = compare(trace, lru, 2000, cost, 4, "round_robin")
    assert four.pooled_hit_ratio == one.pooled_hit_ratio
    assert four.private_hit_ratio < four.pooled_hit_ratio and four.gain > 1
    with pytest.raises(ConfigError, match="route"):
        split(trace, 2, "random")


def test_the_command_prints_pooled_against_private(trace_file, capsys) -> None:  # type: ignore[no-untyped-def]
    assert main(["simulate", "--trace", str(trace_file), "--capacity", "1M",
                 "--policies", "lru", "--engines", "2", "--router", "round_robin",
                 "--json"]) == 0
    [point] = json.loads(capsys.readouterr().out)["pooling"]
    assert point["engines"] == 2 and point["route"] == "round_robin"
    assert point["gain"] == pytest.approx(point["pooled_hit_ratio"] / point["private_hit_ratio"])


@pytest.mark.parametrize("workload", ["agent", "rag", "chat"])
def test_a_synthetic_workload_written_as_a_trace_replays_and_prefix_keeps_lrus_hits(
        workload: str, tmp_path: Path) -> None:
    """`--write-trace`: the workload's traffic in the generic format, its prompts' lengths
    and arrivals kept; replayed at a few capacities, the prefix policy (its horizon learned)
    hits no fewer tokens than LRU on any of the generator's workloads."""
    path = tmp_path / f"{workload}.jsonl"
    out = io.StringIO()
    with redirect_stdout(out):
        code = main(["simulate", "--workload", workload, "--requests", "1500",
                     "--write-trace", str(path)])
    assert code == 0 and "1,500 requests" in out.getvalue()
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    assert len(rows) == 1500
    assert all(row["timestamp"] >= 0 and len(row["block_hashes"]) * 512 >= row["input_length"]
               for row in rows)
    assert [row["timestamp"] for row in rows] == sorted(row["timestamp"] for row in rows)
    out = io.StringIO()
    with redirect_stdout(out):
        code = main(["simulate", "--trace", str(path), "--capacity", "30k,100k,300k",
                     "--policies", "lru,prefix", "--json"])
    assert code == 0
    data = json.loads(out.getvalue())
    assert data["requests"] == 1500
    assert data["input_tokens"] == sum(row["input_length"] for row in rows)
    for point in data["points"]:
        lru, prefix = point["policies"]
        assert prefix["hit_tokens"] >= lru["hit_tokens"], (workload, point["capacity_tokens"])


def test_a_trace_read_in_the_wrong_block_size_is_refused_at_its_first_long_prompt(
        tmp_path: Path) -> None:
    """43 hashes of 512 tokens cannot be a prompt of 686 tokens (its last block may be
    partial, never empty): a trace of 16-token blocks read as 512 once replayed as blocks of
    512 (capacities 9,728 / 99,840, hit ratios off), silently. The error names the line, the
    numbers and the size the line fits."""
    path = tmp_path / "w16.jsonl"
    path.write_text('{"block_hashes": [1], "input_length": 10}\n'  # fits either size
                    + json.dumps({"block_hashes": list(range(43)), "input_length": 686})
                    + "\n", encoding="utf-8")
    with pytest.raises(ConfigError, match=r"trace line 2\.input_length=686: 43 blocks of 512 "
                       r"tokens .* hold 21,505-22,016; the line fits blocks of 16 tokens: "
                       r".*--trace-block-tokens 16"):
        read_trace(path)
    assert [len(r.keys) for r in read_trace(path, block_tokens=16).requests] == [0, 42]
    path.write_text('{"hash_ids": [1, 2, 3], "input_length": 4}\n', encoding="utf-8")
    with pytest.raises(ConfigError, match="no block size fits the line"):
        read_trace(path, block_tokens=2)
    path.write_text('{"hash_ids": [], "input_length": 5}\n', encoding="utf-8")
    with pytest.raises(ConfigError, match="0 tokens with no hashes"):
        read_trace(path)


def test_a_written_trace_records_its_block_size_and_replays_in_it_unasked(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "w16.jsonl"
    assert main(["simulate", "--workload", "chat", "--requests", "200", "--write-trace",
                 str(path), "--trace-block-tokens", "16"]) == 0
    assert "--trace-block-tokens" not in capsys.readouterr().out  # the replay needs none
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    assert {row["block_tokens"] for row in rows} == {16}
    assert main(["simulate", "--trace", str(path), "--capacity", "10k,100k",
                 "--policies", "lru", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["block_tokens"] == 16
    assert [p["capacity_tokens"] for p in data["points"]] == [10_000, 100_000]
    # Read in another size, it is refused, saying the size it records.
    assert main(["simulate", "--trace", str(path), "--trace-block-tokens", "512"]) == 2
    err = capsys.readouterr().err.strip()
    assert "trace line 1.block_tokens=16" in err and "--trace-block-tokens 16)" in err
    assert "\n" not in err
    # One block size a trace: a line that records another is refused.
    path.write_text('{"hash_ids": [1], "block_tokens": 16}\n'
                    '{"hash_ids": [1, 2], "block_tokens": 32}\n', encoding="utf-8")
    with pytest.raises(ConfigError, match=r"trace line 2\.block_tokens=32: 16, the block size"):
        read_trace(path)


@pytest.mark.parametrize("capacity", ["100", "1", "0", "1M,511"])
def test_a_capacity_below_one_block_is_refused_naming_the_block_size(
        trace_file: Path, capacity: str, capsys: pytest.CaptureFixture[str]) -> None:
    """100 tokens once rounded down to 0 blocks: 0.0% (100% of an optimum of 0), silently."""
    assert main(["simulate", "--trace", str(trace_file), "--capacity", capacity,
                 "--policies", "lru"]) == 2
    err = capsys.readouterr().err
    assert "capacity" in err and "at least one block of the trace: 512 tokens" in err


def _one_prefix_trace(tmp_path: Path) -> Path:
    """20 requests of 3 shared 16-token blocks and a partial one: all to one engine by their
    first block, so the other engines' private caches hit nothing."""
    path = tmp_path / "one-prefix.jsonl"
    path.write_text("".join(json.dumps({"block_hashes": [1, 2, 3, 100 + i],
                                        "input_length": 61}) + "\n" for i in range(20)))
    return path


def _strict_json(text: str) -> object:
    def refuse(constant: str) -> object:
        raise ValueError(f"{constant} is not JSON")

    return json.loads(text, parse_constant=refuse)


def test_pooling_against_private_caches_that_hit_nothing_is_valid_json(  # type: ignore[no-untyped-def]
        tmp_path: Path, capsys) -> None:
    """The gain of a pooled cache over private ones that hit nothing has no value: `--json`
    printed `"gain": Infinity` (not JSON: strict parsers refuse it), the table `infx`."""
    trace = str(_one_prefix_trace(tmp_path))
    argv = ["simulate", "--trace", trace, "--trace-block-tokens", "16", "--capacity", "48",
            "--policies", "lru", "--engines", "3"]
    assert main([*argv, "--json"]) == 0
    [point] = _strict_json(capsys.readouterr().out)["pooling"]  # type: ignore[index]
    assert point["private_hit_ratio"] == 0 and point["pooled_hit_ratio"] > 0.7
    assert point["gain"] is None
    assert main(argv) == 0
    assert "inf" not in capsys.readouterr().out


def test_a_capacity_below_a_block_an_engine_is_refused_before_the_replay(  # type: ignore[no-untyped-def]
        tmp_path: Path, capsys) -> None:
    """With --engines N, each private cache gets capacity / N: below one block it holds
    nothing, and the private hit ratio read 0% however the trace shares prefixes."""
    code = main(["simulate", "--trace", str(_one_prefix_trace(tmp_path)),
                 "--trace-block-tokens", "16", "--capacity", "64,32", "--engines", "3"])
    captured = capsys.readouterr()
    assert code == 2 and captured.out == ""
    assert "capacity=32: with 3 engines, at least 3 blocks of the trace (48 tokens)" \
        in captured.err


def test_a_small_traces_prefill_saved_reads_in_tokens_and_fractions_of_a_second(  # type: ignore[no-untyped-def]
        tmp_path: Path, capsys) -> None:
    """912 tokens saved read "0.0M / 0 s" in the table and the unbounded line: as if
    nothing were saved."""
    assert main(["simulate", "--trace", str(_one_prefix_trace(tmp_path)),
                 "--trace-block-tokens", "16", "--capacity", "64", "--policies", "lru"]) == 0
    out = capsys.readouterr().out
    assert "0.0M" not in out and " 0 s of 0 s" not in out
    assert "unbounded: 912 tokens, 0.032 s of 0.043 s of prefill" in out
    assert "912 / 0.032 s" in out


@pytest.mark.parametrize(("text", "allowed"), [
    ("1.5", "a whole number of tokens (1.5 is not)"),
    ("17.5", "a whole number of tokens (17.5 is not)"),
    ("1e20", "(0 to 1e+15)"), ("-3", "(0 to 1e+15)"), ("nan", "(0 to 1e+15)")])
def test_a_capacity_that_is_no_whole_token_count_is_refused_as_typed(text: str,
                                                                     allowed: str) -> None:
    """"1.5" was read as 1 token and refused as `capacity=1`, a value nobody typed; "17.5"
    was taken as 17 tokens."""
    with pytest.raises(ConfigError) as refused:
        parse_tokens(text)
    assert refused.value.value == text and allowed in refused.value.allowed


def test_a_token_count_with_a_suffix_is_exact() -> None:
    """Floats made 1.001M 1,000,999 tokens and 2.01k 2,009."""
    assert [parse_tokens(t) for t in ("1.001M", "2.01k", "4.06k", "1e3", "0")] == \
        [1_001_000, 2_010, 4_060, 1000, 0]


def test_the_table_says_where_the_plot_went(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    """The PNG was written without a word of where; --json keeps stdout to the JSON."""
    plot = tmp_path / "hit.png"
    argv = ["simulate", "--trace", str(_one_prefix_trace(tmp_path)), "--trace-block-tokens",
            "16", "--capacity", "64", "--policies", "lru", "--plot", str(plot)]
    assert main(argv) == 0
    assert f"plot written to {plot}" in capsys.readouterr().out
    assert main([*argv, "--json"]) == 0
    json.loads(capsys.readouterr().out)


def test_a_policy_or_capacity_given_twice_is_replayed_once(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    """`--policies lru,lru --capacity 64,64` replayed the trace four times: two columns and
    two rows of the same name."""
    assert main(["simulate", "--trace", str(_one_prefix_trace(tmp_path)), "--trace-block-tokens",
                 "16", "--capacity", "64,64", "--policies", "lru, lru,prefix", "--json"]) == 0
    [point] = json.loads(capsys.readouterr().out)["points"]
    assert [r["policy"] for r in point["policies"]] == ["lru", "prefix"]


def test_a_list_option_repeated_adds_up(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    """`--capacity 64 --capacity 32,64 --policies lru --policies prefix` replays both
    capacities and both policies: a repeated list option replayed its last alone."""
    assert main(["simulate", "--trace", str(_one_prefix_trace(tmp_path)), "--trace-block-tokens",
                 "16", "--capacity", "64", "--capacity", "32,64", "--policies", "lru",
                 "--policies", "prefix", "--json"]) == 0
    points = json.loads(capsys.readouterr().out)["points"]
    assert [p["capacity_tokens"] for p in points] == [64, 32]
    assert all([r["policy"] for r in p["policies"]] == ["lru", "prefix"] for p in points)
