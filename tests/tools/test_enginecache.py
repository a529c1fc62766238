"""`kvtier inspect --metrics URL`: what the engine's cache did and holds (issue 46): the tokens
it found, loaded, and found but did not load by reason, and each tier's chunks and bytes now;
read from a real HTTP server on 127.0.0.1 serving the series the connector exports, written
through the connector's own Prometheus metrics class."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from kvtier.tools.cli.main import main
from kvtier.tools.ops import enginecache
from kvtier.tools.ops.enginecache import TierResidency, parse_engine_cache


def metrics_text() -> str:
    """Two engines' series: 1,000 tokens found, 600 loaded, 256 cut by the rule, 128 lost to
    a failed load, 16 declined by vLLM; a memory and a disk tier, and a redis tier of capacity 0
    (the server's maxmemory bounds it: kvtier counts nothing there)."""
    reg = CollectorRegistry()
    lost = Counter(enginecache.LOST_COUNTER.removesuffix("_total"), "lost",
                   ["engine", "reason"], registry=reg)
    lost.labels("0", "recompute_faster").inc(256)
    lost.labels("0", "load_failed").inc(100)
    lost.labels("1", "load_failed").inc(28)
    lost.labels("1", "vllm_declined").inc(16)
    found = Counter(enginecache.FOUND_COUNTER.removesuffix("_total"), "f", ["engine"],
                    registry=reg)
    found.labels("0").inc(900)
    found.labels("1").inc(100)
    Counter(enginecache.LOADED_COUNTER.removesuffix("_total"), "l", registry=reg).inc(600)
    for gauge, values in (("tier_chunks", (10, 200)), ("tier_used_bytes", (1 << 20, 50 << 20)),
                          ("tier_capacity_bytes", (4 << 20, 1 << 30))):
        g = Gauge(enginecache.PREFIX + gauge, gauge, ["engine", "tier"], registry=reg)
        g.labels("0", "memory").set(values[0])
        g.labels("0", "disk").set(values[1])
        g.labels("0", "redis").set(0)  # capacity 0: no index, nothing counted
    return generate_latest(reg).decode()


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    body = metrics_text().encode()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def test_the_reasons_and_names_are_the_connectors() -> None:
    pytest.importorskip("vllm")
    from kvtier.integrations.vllm.metrics import COUNTERS, GAUGES, LOST_HIT_REASONS, PREFIX

    assert enginecache.LOST_HIT_REASONS == LOST_HIT_REASONS
    for name in (enginecache.LOST_COUNTER, enginecache.FOUND_COUNTER,
                 enginecache.LOADED_COUNTER):
        assert name.removeprefix(PREFIX).removesuffix("_total") in COUNTERS
    for name in ("tier_chunks", "tier_used_bytes", "tier_capacity_bytes"):
        assert name in GAUGES


def test_engines_are_summed_and_every_reason_is_listed() -> None:
    cache = parse_engine_cache(metrics_text())
    assert cache.found_tokens == 1000 and cache.loaded_tokens == 600
    assert cache.lost_tokens == {"recompute_faster": 256, "vllm_declined": 16,
                                 "load_failed": 128, "load_too_slow": 0, "no_state": 0}
    assert cache.residency == {"memory": TierResidency(10, 1 << 20, 4 << 20),
                               "disk": TierResidency(200, 50 << 20, 1 << 30),
                               "redis": TierResidency(0, 0, 0)}


def test_inspect_shows_lost_hits_by_reason_and_residency(
        server: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", "--metrics", server]) == 0
    out = capsys.readouterr().out
    assert "hits found and not loaded" in out and "residency now" in out
    line = next(x for x in out.splitlines() if "recompute_faster" in x and "256" in x)
    assert "25.6%" in line
    line = next(x for x in out.splitlines() if "disk" in x and "200" in x)
    assert "50.0 MiB" in line or "50 MiB" in line
    assert main(["inspect", "--metrics", server, "--json"]) == 0
    cache = json.loads(capsys.readouterr().out)["engine_cache"]
    assert cache["lost_tokens"]["load_failed"] == 128
    assert cache["residency"]["memory"] == {"chunks": 10, "used_bytes": 1 << 20,
                                            "capacity_bytes": 4 << 20}


def test_a_tier_without_a_bound_shows_no_count_rather_than_zero(
        server: str, capsys: pytest.CaptureFixture[str]) -> None:
    """A redis tier of capacity 0 (the default) keeps no index: its gauges are 0 whatever the
    server holds. Its row read "0 / 0 B / 0 B" beside the chunks `--config`'s table counted on
    the same server (a new user's redis tier looked empty and disabled)."""
    assert main(["inspect", "--metrics", server]) == 0
    out = capsys.readouterr().out
    row = next(x for x in out.splitlines() if x.startswith("│ redis"))
    assert "0 B" not in row and "no bound" in row
    assert "not counted by the engine" in out
