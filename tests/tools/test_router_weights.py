"""What a hit on each tier is worth to a router (issue 26): `kvtier plan` models it, and with
`--metrics URL` it and `kvtier inspect` read it from a server's /metrics, here a real HTTP
server on 127.0.0.1 serving the series a kvtier-served vLLM exports."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from tierkit import key, tiny_layout

from kvtier.tiers import build_tier
from kvtier.tiers.storeconfig import StoreConfig
from kvtier.tools.cli.main import main
from kvtier.tools.ops.restorecost import (
    DECISIONS_COUNTER,
    RECOMPUTE_GAUGE,
    RESTORE_GAUGE,
    STATIC_WEIGHTS,
    router_weight,
)

CONFIG = str(Path(__file__).parents[1] / "data" / "configs" / "llama-3-70b.json")
PLAN = ["plan", CONFIG, "--tp", "8", "--vllm-version", "0.21.0"]


def metrics_text() -> str:
    """A server whose disk tier restores 1k tokens in 20 ms and whose redis tier, behind a
    slow link, in 500 ms, against 100 ms to recompute them."""
    reg = CollectorRegistry()
    restore = Gauge(RESTORE_GAUGE, "restore", ["tier"], registry=reg)
    restore.labels("disk").set(0.02)
    restore.labels("redis").set(0.5)
    Gauge(RECOMPUTE_GAUGE, "recompute", registry=reg).set(0.1)
    decisions = Counter(DECISIONS_COUNTER, "decisions", ["tier", "reason"], registry=reg)
    decisions.labels("disk", "loaded").inc(40)
    decisions.labels("redis", "recompute_faster").inc(12)
    decisions.labels("cpu", "loaded").inc(3)  # loaded, not timed yet
    return generate_latest(reg).decode()


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    body = metrics_text().encode()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path not in ("/metrics", "/page"):
                self.send_error(404)
                return
            # /page: another service's answer, as a wrong port or a proxy's login page gives
            page = b"<html><body>hello</body></html>\n" if self.path == "/page" else body
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(page)))
            self.end_headers()
            self.wfile.write(page)

        def log_message(self, *args: object) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture()
def store(tmp_path: Path) -> str:
    path = tmp_path / "store.json"
    path.write_text(json.dumps({"tiers": [
        {"kind": "memory", "name": "cpu", "capacity": "64MiB"},
        {"kind": "disk", "path": str(tmp_path / "disk"), "capacity": "64MiB"},
        {"kind": "redis", "url": "redis://127.0.0.1:9", "capacity": "64MiB"}]}))
    (tmp_path / "disk").mkdir()  # the disk tier has started (a missing directory: status 1)
    return str(path)


def run_json(capsys: pytest.CaptureFixture[str], argv: list[str]) -> dict[str, object]:
    assert main(argv) == 0
    out: dict[str, object] = json.loads(capsys.readouterr().out)
    return out


def test_plan_models_a_weight_per_tier_next_to_the_static_guesses(
        capsys: pytest.CaptureFixture[str]) -> None:
    out = run_json(capsys, [*PLAN, "--json"])
    rows = {w["tier"]: w for w in out["router_weights"]}  # type: ignore[attr-defined]
    tiers = {t["name"]: t for t in out["tiers"]}  # type: ignore[attr-defined]
    assert list(rows) == ["GPU HBM", "CPU DRAM", "NVMe"]
    assert out["router_weight_formula"] == "weight = 1 - restore_s / recompute_s, clipped to [0, 1]"
    for name, row in rows.items():
        assert row["source"] == "model"
        # per 1k tokens, the same ratio as one session's load against its re-prefill
        assert row["weight"] == pytest.approx(
            router_weight(tiers[name]["load_s"], out["reprefill_s"]))  # type: ignore[arg-type]
    assert rows["GPU HBM"]["weight"] == 1.0
    assert rows["GPU HBM"]["static"] == {"llm-d": STATIC_WEIGHTS["llm-d"]["gpu"]}
    assert rows["CPU DRAM"]["static"] == {"llm-d": 0.8, "dynamo": 0.75}
    assert rows["NVMe"]["static"] == {"dynamo": 0.25}


def test_plan_with_metrics_adds_the_measured_weights(
        server: str, store: str, capsys: pytest.CaptureFixture[str]) -> None:
    out = run_json(capsys, [*PLAN, "--json", "--metrics", server + "/metrics",
                            "--store-config", store])
    measured = {w["tier"]: w for w in out["router_weights"]  # type: ignore[attr-defined]
                if w["source"] == "measured"}
    assert measured["disk"]["weight"] == pytest.approx(0.8)
    assert measured["disk"]["static"] == {"dynamo": 0.25}  # a STORAGE tier: Dynamo's disk
    assert measured["redis"]["weight"] == 0.0  # slower than recompute: worth nothing
    assert measured["cpu"]["weight"] is None and measured["cpu"]["static"] == {
        "llm-d": 0.8, "dynamo": 0.75}
    # Without the store config the tiers' media are unknown: no static guess is claimed.
    out = run_json(capsys, [*PLAN, "--json", "--metrics", server])  # the base URL works too
    measured = {w["tier"]: w for w in out["router_weights"]  # type: ignore[attr-defined]
                if w["source"] == "measured"}
    assert measured["disk"]["medium"] is None and measured["disk"]["static"] == {}


def test_plan_table_prints_the_weights(server: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*PLAN, "--metrics", server]) == 0
    out = capsys.readouterr().out
    assert "router weights" in out and "llm-d static" in out and "dynamo static" in out
    assert "0.0200" in out and "0.1000" in out and "0.80" in out


def test_inspect_metrics_shows_restore_recompute_and_weights(
        server: str, store: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", "--metrics", server]) == 0
    out = capsys.readouterr().out
    for text in ("restore s", "recompute s", "weight", "disk", "0.0200", "0.5000", "0.1000",
                 "0.80", "not measured", "trial/recomputed"):
        assert text in out
    # what the engine did with each tier's hit chunks: loaded / trial / recomputed
    assert "40/0/0" in out and "0/0/12" in out and "3/0/0" in out
    out_json = run_json(capsys, ["inspect", "--config", store, "--tier", "disk", "--metrics",
                                 server, "--json"])
    costs = out_json["restore_costs"]
    assert costs == {"restore_s_per_1k": {"disk": 0.02, "redis": 0.5},  # type: ignore[comparison-overlap]
                     "recompute_s_per_1k": 0.1,
                     "decisions": {"disk": {"loaded": 40.0}, "redis": {"recompute_faster": 12.0},
                                   "cpu": {"loaded": 3.0}}}
    rows = {w["tier"]: w for w in out_json["router_weights"]}  # type: ignore[attr-defined]
    assert rows["disk"]["weight"] == pytest.approx(0.8) and rows["disk"]["medium"] == "STORAGE"


def test_inspect_table_has_the_restore_columns(
        server: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "disk-only.json"
    path.write_text(json.dumps({"tiers": [{"kind": "disk", "path": str(tmp_path / "d"),
                                           "capacity": "64MiB"}]}))
    layout = tiny_layout(16)
    tier = build_tier(StoreConfig.load(path).tiers[0], layout)
    assert tier.put(key(1), memoryview(b"\x01" * layout.bytes_per_chunk))
    tier.close()
    assert main(["inspect", "--config", str(path), "--metrics", server]) == 0
    out = capsys.readouterr().out
    assert "restore s/1k tok" in out
    line = next(x for x in out.splitlines() if "disk" in x and "0.0200" in x)
    assert "0.80" in line


@pytest.mark.parametrize("argv", [["inspect", "--metrics", "http://127.0.0.1:9"],
                                  [*PLAN, "--metrics", "http://127.0.0.1:9/metrics"],
                                  ["inspect", "--metrics", "ftp://example/metrics"]])
def test_unreadable_metrics_exits_2(
        argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "invalid config" in err and len(err.strip().splitlines()) == 1
    if "--metrics" in argv:  # the option as typed, its value (not a config field metrics=)
        assert f"--metrics={argv[-1]!r}" in err and " metrics=" not in err


@pytest.mark.parametrize("command", [["inspect"], PLAN])
@pytest.mark.parametrize("url", ["127.0.0.1:8000/metrics", "ftp://example/metrics", ""])
def test_a_metrics_value_that_is_no_http_url_says_what_is(
        command: list[str], url: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*command, "--metrics", url]) == 2  # "": an unset variable, not left out
    err = capsys.readouterr().err
    assert f"--metrics={url!r}" in err
    assert "http(s) URL" in err and "http://HOST:PORT/metrics" in err


def test_nothing_to_inspect_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as ended:  # argparse's error: usage, then the option names
        main(["inspect"])
    assert ended.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: kvtier inspect")
    assert "give --config FILE, --metrics URL, or both" in err and "config=None" not in err


@pytest.mark.parametrize("metrics", [[], ["--metrics", "http://127.0.0.1:9/metrics"]])
def test_an_empty_store_config_is_refused_not_left_out(
        metrics: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    # "$STORE_CONFIG" with the variable unset: refused by name, not planned without it
    assert main([*PLAN, *metrics, "--store-config", ""]) == 2
    assert "--store-config=''" in capsys.readouterr().err


def test_a_path_that_is_not_metrics_exits_2(server: str,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", "--metrics", server + "/nope"]) == 2
    assert "HTTP 404" in capsys.readouterr().err


@pytest.mark.parametrize("command", [["inspect"], PLAN])
def test_an_answer_that_is_not_prometheus_text_exits_2_naming_the_option(
        command: list[str], server: str, capsys: pytest.CaptureFixture[str]) -> None:
    """A page that is not Prometheus text ended as "invalid input: could not convert string
    to float", naming neither --metrics nor its URL."""
    assert main([*command, "--metrics", server + "/page"]) == 2
    err = capsys.readouterr().err
    assert f"--metrics='{server}/page'" in err
    assert "answered with something other than Prometheus metrics" in err
