"""`kvtier bench interference`'s pure parts: the arrival schedule, which inter-token gaps count
as "while the arrivals came", the ratios the targets are judged on, and the settings and
server commands of the disk, redis (emulated network) and memory variants."""

from __future__ import annotations

import argparse
import dataclasses
import io
import json
from pathlib import Path

import pytest
from rich.console import Console

from kvtier.errors import ConfigError
from kvtier.integrations.vllm.config import TOKENS_PER_CHUNK
from kvtier.tools.bench.interference import (
    CONFIGS,
    ConfigRun,
    InterferenceConfig,
    InterferenceResult,
    checks,
    server_command,
    timed_stream_tokens,
)
from kvtier.tools.bench.prompts import KV_BYTES_PER_TOKEN
from kvtier.tools.bench.serving.arrivals import arrival_schedule, gaps_in_window, token_times
from kvtier.tools.bench.serving.stalls import Stall
from kvtier.tools.bench.serving.stats import RequestResult
from kvtier.tools.cli.bench_interference import config_from, figures_table, target_table


def _request(start_s: float, ttft_s: float | None, gaps: tuple[float, ...] = (),
             error: str | None = None) -> RequestResult:
    return RequestResult(session=0, turn=0, prompt_tokens=10, output_tokens=len(gaps) + 1,
                         start_s=start_s, ttft_s=ttft_s, latency_s=(ttft_s or 0) + sum(gaps),
                         itl_s=gaps, error=error)


def _run(name: str, baseline_gaps: tuple[float, ...], stream_gaps: tuple[float, ...],
         ttfts: tuple[float, ...]) -> ConfigRun:
    """A run whose one stream starts at 0 with its first token at 0.1 s, and whose arrivals
    are sent at 1 s, 2 s, ... and answer right after their first token."""
    arrivals = tuple(_request(1.0 + i, t) for i, t in enumerate(ttfts))
    return ConfigRun(name, "cmd", 1.0, 1.0, 300, baseline=(_request(0.0, 0.1, baseline_gaps),),
                     streams=(_request(0.0, 0.1, stream_gaps),), arrivals=arrivals,
                     metrics=None)


def test_arrivals_are_spaced_after_the_lead_and_cycle_through_the_prefix_lengths() -> None:
    schedule = arrival_schedule(5, gap_s=0.5, lead_s=1.0, prefix_tokens=(4096, 8192))
    assert [a.send_at_s for a in schedule] == [1.0, 1.5, 2.0, 2.5, 3.0]
    assert [a.prefix_tokens for a in schedule] == [4096, 8192, 4096, 8192, 4096]
    assert [a.index for a in schedule] == [0, 1, 2, 3, 4]
    assert arrival_schedule(0, 0.5, 1.0, (4096,)) == ()


def test_a_schedule_with_negative_times_or_no_prefix_is_refused() -> None:
    with pytest.raises(ConfigError):
        arrival_schedule(2, gap_s=-1, lead_s=0, prefix_tokens=(4096,))
    with pytest.raises(ConfigError):
        arrival_schedule(2, gap_s=0.5, lead_s=0, prefix_tokens=())


def test_token_times_add_the_gaps_to_the_first_token() -> None:
    assert token_times(_request(2.0, 0.5, (0.1, 0.2))) == pytest.approx([2.5, 2.6, 2.8])
    assert token_times(_request(2.0, None)) == []


def test_only_gaps_ending_inside_the_window_count() -> None:
    # Tokens at 1.0, 2.0, 3.0, 4.0: the gaps ending at 2.0 and 3.0 are inside [1.5, 3.0].
    stream = _request(0.0, 1.0, (1.0, 1.0, 1.0))
    assert gaps_in_window([stream], 1.5, 3.0) == [1.0, 1.0]
    assert gaps_in_window([stream], 5.0, 6.0) == []


def test_the_window_runs_from_the_first_arrival_sent_to_the_last_answered() -> None:
    run = _run("kvtier-async", (0.01,), (0.01,), ttfts=(0.2, 0.3))
    assert run.window_s == pytest.approx((1.0, 2.3))


def test_stream_itl_with_arrivals_is_judged_against_the_same_server_without_them() -> None:
    # Baseline gaps 10 ms; during the window (1.0-2.3 s) five gaps of 30 ms among 10 ms ones.
    stream = (0.01,) * 90 + (0.03,) * 5 + (0.01,) * 200
    run = _run("kvtier-async", (0.01,) * 100, stream, ttfts=(0.2, 0.3))
    assert run.baseline_itl.p99 == pytest.approx(0.01)
    assert run.itl.p99 == pytest.approx(0.03)
    assert run.itl_p99_ratio == pytest.approx(3.0)
    assert run.streams_cover_window  # the stream decodes until 2.99 s


def test_a_stream_that_ended_before_the_last_arrival_does_not_cover_the_window() -> None:
    run = _run("kvtier-sync", (0.01,), (0.01,) * 10, ttfts=(0.2, 0.3))
    assert not run.streams_cover_window


def test_targets_async_itl_within_1_2x_and_ttft_no_worse_than_sync() -> None:
    base = (0.01,) * 100
    good = _run("kvtier-async", base, (0.011,) * 300, ttfts=(0.20, 0.30))
    sync = _run("kvtier-sync", base, (0.05,) * 300, ttfts=(0.25, 0.35))
    verdicts = {c.what: c.passed for c in checks({"kvtier-async": good, "kvtier-sync": sync})}
    assert verdicts == {"kvtier-async: streams' ITL p99, with / without arrivals": True,
                        "arrivals' TTFT p50, async / sync": True,
                        "arrivals' TTFT p99, async / sync": True}
    slow = _run("kvtier-async", base, (0.02,) * 300, ttfts=(0.5, 0.6))
    assert not any(c.passed for c in checks({"kvtier-async": slow, "kvtier-sync": sync}))


def test_no_check_without_the_runs_it_needs() -> None:
    assert checks({}) == []
    only_sync = _run("kvtier-sync", (0.01,), (0.01,), ttfts=(0.2,))
    assert checks({"kvtier-sync": only_sync}) == []


def test_failed_requests_are_reported_and_left_out_of_the_figures() -> None:
    run = ConfigRun("vllm", "cmd", 1.0, 1.0, 300, baseline=(_request(0.0, 0.1, (0.01,)),),
                    streams=(), metrics=None,
                    arrivals=(_request(1.0, 0.2), _request(1.5, None, error="HTTP 500")))
    assert run.failures == ["HTTP 500"]
    assert run.ttft.count == 1


def _args(**overrides: object) -> argparse.Namespace:
    values: dict[str, object] = dict(
        quick=False, streams=None, stream_tokens=None, arrivals=None, arrival_gap_s=None,
        prefix_tokens=None, config=None, dir=Path("."), model_root=Path("."), tier=None,
        net_delay_ms=None, net_bandwidth_gbps=None, memory_tier_chunks=None)
    values.update(overrides)
    return argparse.Namespace(**values)


def test_quick_is_smaller_and_flags_override_it() -> None:
    full = config_from(_args())
    quick = config_from(_args(quick=True, arrivals=3))
    assert full.configs == CONFIGS and full.arrivals == 8
    assert quick.arrivals == 3 and quick.prefix_tokens == (4096,) and quick.streams < 4
    assert full.memory_tier_chunks == 2
    assert config_from(_args(quick=True, memory_tier_chunks=40)).memory_tier_chunks == 40


@pytest.mark.parametrize("overrides", [{"prefix_tokens": "4000"}, {"prefix_tokens": "x"},
                                       {"prefix_tokens": "32768"}, {"streams": 0},
                                       {"memory_tier_chunks": 0},
                                       {"config": ["nope"]}, {"tier": "nfs"},
                                       {"tier": "redis", "net_delay_ms": -1.0},
                                       {"tier": "redis", "net_delay_ms": float("nan")},
                                       {"tier": "redis", "net_bandwidth_gbps": 0.0},
                                       {"net_delay_ms": 1.0}, {"tier": "disk",
                                                               "net_bandwidth_gbps": 1.0}])
def test_bad_settings_name_the_field(overrides: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        config_from(_args(**overrides))


def test_the_warm_up_stores_every_prefix_chunk() -> None:
    config = InterferenceConfig(Path("."), Path("."), arrivals=3, prefix_tokens=(4096, 8192))
    assert config.chunks_stored() == 16 + 32 + 16
    assert config.max_model_len == 8192 + config.new_tokens + config.arrival_max_tokens


def test_timed_streams_last_past_the_last_arrival_at_the_baseline_pace() -> None:
    config = InterferenceConfig(Path("."), Path("."), arrivals=4, arrival_gap_s=0.5,
                                lead_s=1.0, stream_tokens=128, prefix_tokens=(4096,))
    # The last arrival at 2.5 s, + 2 s: 4.5 s at 10 ms a token.
    assert timed_stream_tokens(config, 0.01) == 450
    assert timed_stream_tokens(config, 1.0) == 128  # slow enough already
    assert timed_stream_tokens(config, None) == 128  # no baseline figure
    assert timed_stream_tokens(config, 1e-6) == config.max_model_len - 64  # the context's end


def test_the_floor_run_is_reported_for_reference_not_judged() -> None:
    floor = _run("vllm-prefix", (0.01,) * 100, (0.02,) * 300, ttfts=(0.05,))
    (check,) = checks({"vllm-prefix": floor})
    assert check.passed is None and check.value == "2.00x"


def test_the_disk_tier_is_the_default_and_the_network_flags_go_with_redis() -> None:
    disk = config_from(_args())
    assert disk.tier == "disk" and disk.source == "the disk tier"
    redis = config_from(_args(quick=True, tier="redis", net_delay_ms=2.0))
    assert (redis.tier, redis.net_delay_ms, redis.net_bandwidth_gbps) == ("redis", 2.0, 10.0)
    assert redis.source == ("the redis tier over an emulated network "
                            "(2 ms each way, 10 Gbit/s)")


def _lower_tier(config: InterferenceConfig, name: str, redis_url: str | None = None) -> object:
    """The tier under kvtier's memory tier in configuration `name`'s server command."""
    command = server_command(config, name, Path("/models/bench"), Path("/scratch"), redis_url)
    assert command.kv_transfer_config is not None
    memory, lower = command.kv_transfer_config["kv_connector_extra_config"]["tiers"]
    assert memory["kind"] == "memory"
    return lower


def test_kvtier_servers_get_a_disk_tier_or_the_redis_behind_the_network() -> None:
    disk = InterferenceConfig(Path("."), Path("."))
    assert _lower_tier(disk, "kvtier-sync") == {
        "kind": "disk", "path": "/scratch/kvtier-sync/disk", "capacity": "8GiB"}
    redis = dataclasses.replace(disk, tier="redis")
    lower = _lower_tier(redis, "kvtier-async", "redis://127.0.0.1:4242/0")
    assert isinstance(lower, dict)
    assert lower["kind"] == "redis" and lower["url"] == "redis://127.0.0.1:4242/0"
    assert lower["socket_timeout_ms"] >= 1000  # the bench measures loads, not timeouts
    assert server_command(redis, "vllm", Path("/m"), Path("/s")).kv_transfer_config is None
    with pytest.raises(ConfigError):
        server_command(redis, "kvtier-sync", Path("/m"), Path("/s"))  # no server URL


def test_the_node_variant_has_no_tiers_in_the_engine_and_async_modes() -> None:
    config = InterferenceConfig(Path("."), Path("."), tier="redis")
    command = server_command(config, "kvtier-node", Path("/m"), Path("/s"),
                             node="/s/kvtier-node/node.sock")
    assert command.kv_transfer_config is not None
    extra = command.kv_transfer_config["kv_connector_extra_config"]
    assert extra["node"] == "/s/kvtier-node/node.sock" and "tiers" not in extra
    assert (extra["load_mode"], extra["store_mode"]) == ("async", "async")
    with pytest.raises(ConfigError, match="node"):
        server_command(config, "kvtier-node", Path("/m"), Path("/s"))  # no node's socket


def test_the_memory_variant_holds_every_prefix_in_ram_with_no_tier_below() -> None:
    config = config_from(_args(quick=True, tier="memory"))
    assert config.source == "the memory tier"
    command = server_command(config, "kvtier-auto", Path("/m"), Path("/s"))
    assert command.kv_transfer_config is not None
    extra = command.kv_transfer_config["kv_connector_extra_config"]
    [memory] = extra["tiers"]
    assert memory["kind"] == "memory" and extra["load_mode"] == "auto"
    assert memory["capacity"] >= config.chunks_stored() * TOKENS_PER_CHUNK * KV_BYTES_PER_TOKEN
    with pytest.raises(ConfigError, match="net_delay_ms"):
        config_from(_args(tier="memory", net_delay_ms=1.0))
    # the memory tier is sized to hold every prefix: --memory-chunks was dropped
    with pytest.raises(ConfigError, match="--memory-chunks"):
        config_from(_args(tier="memory", memory_tier_chunks=4))


def _rendered(table: object) -> str:
    console = Console(width=200, record=True, file=io.StringIO())
    console.print(table)
    return " ".join(console.export_text().split())  # titles wrap to the table's width


def test_results_name_the_tier_and_the_network() -> None:
    run = dataclasses.replace(_run("kvtier-async", (0.01,), (0.01,), ttfts=(0.2,)),
                              ping_ms=0.9)
    redis = InterferenceResult(InterferenceConfig(Path("."), Path("."), tier="redis",
                                                  net_delay_ms=0.5, net_bandwidth_gbps=25.0),
                               (run,), 1.0, {})
    figures, targets = _rendered(figures_table(redis)), _rendered(target_table(redis))
    for text in (figures, targets):
        assert "redis tier over an emulated network (0.5 ms each way, 25 Gbit/s)" in text
    assert "redis PING through the network" in figures and "0.90" in figures
    disk = InterferenceResult(InterferenceConfig(Path("."), Path(".")), (run,), 1.0, {})
    assert "from the disk tier" in _rendered(figures_table(disk))
    assert "PING" not in _rendered(figures_table(disk))


def test_the_json_names_the_tier_and_the_network(tmp_path: Path) -> None:
    run = dataclasses.replace(_run("kvtier-sync", (0.01,), (0.01,), ttfts=(0.2,)), ping_ms=0.9)
    config = InterferenceConfig(tmp_path, tmp_path, tier="redis")
    InterferenceResult(config, (run,), 1.0, {}).write_json(tmp_path / "r.json")
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["config"]["tier"] == "redis" and data["config"]["net_delay_ms"] == 0.25
    assert data["config"]["net_bandwidth_gbps"] == 10.0 and data["runs"][0]["ping_ms"] == 0.9
    assert data["source"] == config.source


def test_arrivals_a_machine_stall_touched_are_reported_apart() -> None:
    """An arrival whose wait for its first token spans a stall of the machine measured the
    machine: the TTFT of the others is shown beside that of all, with the stalls in the
    window (one before the window is left out)."""
    run = dataclasses.replace(_run("kvtier-node", (0.01,), (0.01,), ttfts=(0.2, 1.5, 0.3)),
                              stalls=(Stall(0.2, 0.4), Stall(2.3, 2.8, 0.45, 0.3, 0.0)))
    assert run.window_s == (1.0, 3.5)
    assert run.stalls_in_window == [Stall(2.3, 2.8, 0.45, 0.3, 0.0)]
    assert [r.start_s for r in run.unstalled_arrivals] == [1.0, 3.0]
    assert run.unstalled_ttft.p50 == pytest.approx(0.25) and run.ttft.p50 == 0.3
    figures = _rendered(figures_table(InterferenceResult(
        InterferenceConfig(Path("."), Path(".")), (run,), 1.0, {})))
    assert "(2 of 3)" in figures and "1, longest 500 ms; 1 host" in figures
    quiet = dataclasses.replace(run, stalls=())
    assert len(quiet.unstalled_arrivals) == 3
    assert "none" in _rendered(figures_table(InterferenceResult(
        InterferenceConfig(Path("."), Path(".")), (quiet,), 1.0, {})))


def test_the_json_lists_the_stalls_in_the_window(tmp_path: Path) -> None:
    run = dataclasses.replace(_run("kvtier-node", (0.01,), (0.01,), ttfts=(0.2, 1.5)),
                              stalls=(Stall(2.5, 3.0, 0.01, None, None),))
    InterferenceResult(InterferenceConfig(tmp_path, tmp_path), (run,), 1.0, {}).write_json(
        tmp_path / "r.json")
    (written,) = json.loads((tmp_path / "r.json").read_text())["runs"]
    assert written["stalls_in_window"] == [
        {"start_s": 2.5, "end_s": 3.0, "queued_s": 0.01, "idle_s": None, "steal_s": None}]
    assert written["unstalled_ttft"]["count"] == 1
