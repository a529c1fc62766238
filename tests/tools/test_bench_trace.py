"""`kvtier bench trace`'s pure parts: the slice keeps whole conversations with their prefix
structure in the scaled tokens, its capacity scales with it, the simulator's replay behind
the engine's own cache counts each cache's hits as the engine would, and the command's
settings and tables. The engines' run: tests/tools/test_bench_trace_e2e.py."""

from __future__ import annotations

import argparse
import io
import json
from contextlib import redirect_stdout
from pathlib import Path

import pytest
from rich.console import Console

from kvtier.errors import ConfigError
from kvtier.tools.bench.serving.stats import percentiles
from kvtier.tools.bench.tracebench import (
    PLAIN,
    ConfigRun,
    TraceBenchResult,
    engine_kv_tokens,
    max_model_len,
    memory_tier_bytes,
    plot_trace_bench,
)
from kvtier.tools.bench.traceslice import SliceSpec, block_token_ids, slice_trace
from kvtier.tools.cli.bench_trace import comparison_table, config_from, trace_table, write_results
from kvtier.tools.sim.cost import CostModel, build_cost_model, model_spec
from kvtier.tools.sim.enginereplay import replay_behind_engine
from kvtier.tools.sim.replay import parse_policy, replay
from kvtier.tools.sim.trace import read_trace

SYSTEM = 0  # the block every request starts with, as in Mooncake's trace


def _write(path: Path, rows: list[dict[str, object]]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def _conversations(tmp_path: Path, count: int = 40) -> Path:
    """`count` two-turn conversations: turn 2 extends turn 1 by a block and a partial one."""
    rows: list[dict[str, object]] = []
    for c in range(count):
        first = [SYSTEM, 100 + 10 * c, 101 + 10 * c]
        rows.append({"timestamp": 1000 * c, "input_length": 3 * 512, "hash_ids": first})
    for c in range(count):
        second = [SYSTEM, 100 + 10 * c, 101 + 10 * c, 102 + 10 * c, 103 + 10 * c]
        rows.append({"timestamp": 1000 * (count + c), "input_length": 4 * 512 + 256,
                     "hash_ids": second})
    return _write(tmp_path / "trace.jsonl", rows)


def test_a_slice_keeps_whole_conversations_and_their_shared_prefixes(tmp_path: Path) -> None:
    cut = slice_trace(_conversations(tmp_path), SliceSpec(sample=0.5, seed=3))
    assert 0 < len(cut.requests) < 80 and len(cut.requests) % 2 == 0
    firsts = {r.index: r for r in cut.requests if r.index < 40}
    for second in (r for r in cut.requests if r.index >= 40):
        first = firsts[second.index - 40]  # both turns of a conversation, or neither
        # 3 blocks of 32 shared; then a 4th block and a tail of 256 * 32 / 512 tokens
        assert second.prompt[:96] == first.prompt and len(first.prompt) == 96
        assert len(second.prompt) == 4 * 32 + 16
    prompts = [r.prompt for r in cut.requests]
    assert all(p[:32] == prompts[0][:32] for p in prompts)  # the system block, everywhere
    assert len({p[32:64] for p in prompts}) == len(prompts) // 2  # one second block each
    again = slice_trace(tmp_path / "trace.jsonl", SliceSpec(sample=0.5, seed=3))
    assert again == cut  # deterministic


def test_the_slice_is_capped_and_its_capacity_scaled(tmp_path: Path) -> None:
    trace = _conversations(tmp_path)
    cut = slice_trace(trace, SliceSpec(sample=1.0, limit=10, max_blocks=2))
    assert len(cut.requests) == 10 and {len(r.prompt) for r in cut.requests} == {64}
    assert cut.scaled_blocks(1_000_000) == round(1_000_000 / 512)
    assert slice_trace(trace, SliceSpec(sample=0.25)).scaled_blocks(1_000_000) == 488
    assert block_token_ids(7, 32, 0) == block_token_ids(7, 32, 0) != block_token_ids(8, 32, 0)


def test_the_simulator_reads_back_exactly_the_prompts_sent(tmp_path: Path) -> None:
    cut = slice_trace(_conversations(tmp_path), SliceSpec(sample=1.0))
    trace = cut.as_trace(tmp_path / "slice.jsonl")
    assert trace.block_tokens == 32 and trace.input_tokens == cut.prompt_tokens
    assert [len(r.keys) for r in trace.requests] == [len(r.prompt) // 32 for r in cut.requests]


def test_a_short_request_still_has_a_token_and_a_bad_spec_names_its_field(
        tmp_path: Path) -> None:
    trace = _write(tmp_path / "t.jsonl", [{"input_length": 10, "hash_ids": [5]}])
    assert len(slice_trace(trace, SliceSpec(sample=1.0)).requests[0].prompt) == 1
    for spec, field in ((SliceSpec(sample=0.0), "sample"), (SliceSpec(block_tokens=1024),
                                                           "block_tokens"),
                        (SliceSpec(limit=0), "limit")):
        with pytest.raises(ConfigError, match=field):
            slice_trace(trace, spec)


def _cost() -> CostModel:
    from kvtier.tools.ops.hardware import gpu_profile

    return build_cost_model(model_spec("llama-3.1-8b"), gpu_profile("h100"))


def test_behind_the_engine_the_tier_serves_only_past_the_engines_hit(tmp_path: Path) -> None:
    """Two conversations alternate, a turn longer each time; the engine's cache holds 5
    blocks (one request and a little), the tier every block."""
    rows = []
    for turn in range(1, 4):
        for c in (1, 2):
            rows.append({"block_hashes": [SYSTEM, *(10 * c + k for k in range(turn)), 99],
                         "input_length": (turn + 1) * 512 + 100})
    trace = read_trace(_write(tmp_path / "t.jsonl", rows), 512)
    cost = _cost()
    both = replay_behind_engine(trace, parse_policy("lru"), 100, 5, 1, cost)
    # The engine serves the system block to every request but the first, and a returning
    # turn's history while the other conversation's turn has not evicted it (turn 2); by
    # turn 3 it has been, and the tier serves what lies past the engine's hit.
    assert both.engine_hit_tokens == (1 + 2 + 2 + 2 + 1) * 512
    assert both.tier_hit_tokens == (1 + 2) * 512
    assert both.result.hit_tokens == both.engine_hit_tokens + both.tier_hit_tokens
    alone = replay(trace, parse_policy("lru"), 100, cost)
    assert alone.hit_tokens == both.result.hit_tokens  # a tier that holds everything
    none = replay_behind_engine(trace, parse_policy("lru"), 0, 5, 1, cost)
    assert none.tier_hit_tokens == 0 and none.engine_hit_tokens == both.engine_hit_tokens
    with pytest.raises(ConfigError, match="engine_blocks"):
        replay_behind_engine(trace, parse_policy("lru"), 0, 2, 1, cost)


def test_the_engine_and_the_tier_are_sized_for_the_slice() -> None:
    spec = SliceSpec(max_blocks=32)
    assert max_model_len(spec) == 32 * 32 + 31 + 1
    assert engine_kv_tokens(spec) == (33 + 1) * 32  # and vLLM's null block
    assert memory_tier_bytes(59, 32) == 59 * 32 * 8192  # 256 KiB chunks, page-aligned


def _args(**overrides: object) -> argparse.Namespace:
    values: dict[str, object] = {
        "trace": Path("t.jsonl"), "sample": 0.03, "seed": 0, "limit": None, "capacity": "1M",
        "block_tokens": 32, "max_blocks": 32, "trace_block_tokens": 512, "policy": None,
        "no_plain": False, "model_root": Path("models")}
    return argparse.Namespace(**{**values, **overrides})


def test_the_command_runs_plain_vllm_then_each_policy() -> None:
    config = config_from(_args(), Path("/s"))
    assert config.configs == (PLAIN, "lru", "prefix") and config.capacity_tokens == 10**6
    config.validate()
    only = config_from(_args(policy=["arc"], no_plain=True, capacity="300k"), Path("/s"))
    assert only.configs == ("arc",) and only.capacity_tokens == 300_000
    for overrides, field in (({"policy": ["lru+admit2"]}, "policy"),
                             ({"block_tokens": 48}, "block_tokens"),
                             ({"sample": 2.0}, "sample")):
        with pytest.raises(ConfigError, match=field):
            config_from(_args(**overrides), Path("/s")).validate()


@pytest.mark.parametrize(("policies", "allowed"), [
    (["lru+admit2"], "one of lru, arc, prefix (a memory tier's eviction"),
    (["clock"], "one of lru, arc, prefix"),
    (["lru", "prefix", "lru"], "each policy once"),
    (["vllm"], "each policy once (vllm, the run without kvtier, comes first unless --no-plain)")])
def test_a_policy_is_refused_naming_the_option_and_a_repeat_too(policies: list[str],
                                                                allowed: str) -> None:
    """`--policy lru+admit2` was refused as `configs='lru+admit2': vllm or a memory tier's
    eviction`, naming no option; `--policy lru --policy lru` started a second lru server,
    its results filed under the same name."""
    with pytest.raises(ConfigError) as refused:
        config_from(_args(policy=policies), Path("/s")).validate()
    assert refused.value.field == "policy" and allowed in refused.value.allowed


def test_a_capacity_below_one_chunk_of_the_slice_is_refused() -> None:
    """`--capacity 0` ran every policy against an empty memory tier; the least capacity
    allowed is the one the slice scales to one chunk (`TraceSlice.scaled_blocks`)."""
    least = 17_067  # 512 tokens a trace block at sample 0.03: 17,066.7 tokens a chunk
    for capacity in ("0", str(least - 1)):
        with pytest.raises(ConfigError, match=rf"capacity={int(capacity)}: .*17,067 tokens"):
            config_from(_args(capacity=capacity), Path("/s")).validate()
    config = config_from(_args(capacity=str(least)), Path("/s"))
    config.validate()
    assert round(least * config.spec.sample / config.spec.trace_block_tokens) == 1
    config_from(_args(capacity="0", policy=[PLAIN], no_plain=True), Path("/s")).validate()


def test_the_trace_block_size_is_the_one_the_trace_records(tmp_path: Path) -> None:
    """A trace `kvtier simulate --write-trace` wrote in 16-token blocks was read in 512-token
    ones unless --trace-block-tokens said so (an error at its first long prompt)."""
    written = tmp_path / "w.jsonl"
    written.write_text('{"hash_ids": [1, 2, 3], "input_length": 48, "block_tokens": 16}\n')
    mooncake = tmp_path / "m.jsonl"
    mooncake.write_text('{"hash_ids": [1, 2], "input_length": 1024}\n')
    spec = config_from(_args(trace=written, trace_block_tokens=None, block_tokens=16),
                       Path("/s")).spec
    assert spec.trace_block_tokens == 16
    assert config_from(_args(trace=mooncake, trace_block_tokens=None), Path("/s")).spec \
        .trace_block_tokens == 512
    given = config_from(_args(trace=written, trace_block_tokens=64), Path("/s")).spec
    assert given.trace_block_tokens == 64  # as given (the slice then refuses the trace's 16)
    with pytest.raises(ConfigError, match="trace"):
        config_from(_args(trace=tmp_path / "none.jsonl", trace_block_tokens=None), Path("/s"))


def _run(name: str, ttft: list[float], engine: int, kvtier: int, predicted: float) -> ConfigRun:
    return ConfigRun(name, requests=4, failures=[], prompt_tokens=1000, engine_hit_tokens=engine,
                     kvtier_hit_tokens=kvtier, tier_hit_ratios={"memory": 0.5},
                     ttft=percentiles(ttft), wall_s=1.0,
                     predicted={"hit_ratio": predicted, "engine_hit_tokens": engine,
                                "kvtier_hit_tokens": kvtier, "tier_alone_hit_ratio": 0.1,
                                "kvtier_hit_ratio": kvtier / 900},
                     ttft_s=ttft, kvtier_offered_tokens=kvtier + 32,
                     kvtier_lookup_tokens=900 if kvtier else 0)


def test_the_tables_show_ratios_to_plain_vllm_and_to_lru(tmp_path: Path) -> None:
    cut = slice_trace(_conversations(tmp_path), SliceSpec(sample=1.0))
    config = config_from(_args(trace=tmp_path / "trace.jsonl"), tmp_path)
    result = TraceBenchResult(
        config, cut, 59, memory_tier_bytes(59, 32), 1088,
        (_run(PLAIN, [0.4, 0.4], 100, 0, 0.1), _run("lru", [0.3, 0.3], 100, 100, 0.2),
         _run("prefix", [0.2, 0.2], 100, 300, 0.4)),
        {}, 60.0, {"cpus": 2, "loadavg_before": (1.0, 1.0, 1.0), "loadavg_after": (1, 1, 1)})
    ratios = result.ratios()
    assert ratios["prefix"]["saved_vs_lru"] == pytest.approx(2.0)
    assert ratios["prefix"]["predicted_saved_vs_lru"] == pytest.approx(2.0)
    assert ratios["prefix"]["ttft_p50_vs_vllm"] == pytest.approx(0.5)
    assert ratios["lru"]["ttft_p50_vs_vllm"] == pytest.approx(0.75)
    assert ratios["prefix"]["ttft_paired_median_vs_lru"] == pytest.approx(0.2 / 0.3)
    out = io.StringIO()
    Console(file=out, width=200).print(trace_table(result), comparison_table(result))
    text = out.getvalue()
    assert "kvtier prefix" in text and "40.0% (40.0%)" in text and "2.00x (2.00x)" in text
    assert "33.3% (33.3%); memory 50%" in text and "332" in text  # loaded / asked; offered
    png = plot_trace_bench(result, tmp_path / "trace.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # The command says where the plot went (it wrote it without a word).
    written = io.StringIO()
    with redirect_stdout(written):
        write_results(result, argparse.Namespace(json=tmp_path / "t.json",
                                                 plot=tmp_path / "t.png"), "kvtier bench trace")
    assert f"plot written to {tmp_path / 't.png'}" in written.getvalue()
    assert (tmp_path / "t.png").stat().st_size and json.loads((tmp_path / "t.json").read_text())
    data = result.to_dict("kvtier bench trace t.jsonl")
    assert data["runs"][2]["saved_ratio"] == pytest.approx(0.4)
    assert json.loads(json.dumps(data))["capacity_blocks"] == 59
