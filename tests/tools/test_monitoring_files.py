"""The Grafana dashboard and the Prometheus alerting rules in deploy/, checked without an engine.

`promtool check rules` parses the alerts; `promtool test rules` feeds each failure mode's series
to them (deploy/prometheus/kvtier-alerts.test.yml) and expects its alert, a healthy engine none.
That every kvtier series they name is one kvtier exports is checked in
tests/connector/test_connector_metrics.py, and every query against a scraped vLLM in
tests/engine/test_prometheus_scrape.py.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "kvtier-dashboard.json"
ALERTS = ROOT / "deploy" / "prometheus" / "kvtier-alerts.yml"
ALERT_TESTS = ROOT / "deploy" / "prometheus" / "kvtier-alerts.test.yml"
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None, reason="promtool is not installed (Debian: apt-get install prometheus)")


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title, PromQL) of every target of every panel."""
    panels = json.loads(DASHBOARD.read_text())["panels"]
    return [(p["title"], t["expr"]) for p in panels for t in p.get("targets", [])]


@needs_promtool
def test_promtool_accepts_the_alerting_rules() -> None:
    result = subprocess.run([str(PROMTOOL), "check", "rules", str(ALERTS)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


@needs_promtool
def test_each_failure_mode_fires_its_alert() -> None:
    result = subprocess.run([str(PROMTOOL), "test", "rules", str(ALERT_TESTS)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_panel_has_a_query_on_a_templated_datasource() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    assert len(panels) >= 15
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in panels:
        assert panel["targets"], panel["title"]
        assert panel["datasource"]["uid"] == "${datasource}"



def test_every_tier_fault_kvtier_counts_is_charted_and_alerted() -> None:
    """Each way a tier call goes wrong that an engine counts is on a panel of the Faults row
    and in an alert: before, a lookup past the redis or s3 tier's deadline
    (vllm:kvtier_tier_lookup_timeouts_total, a miss of a chunk the tier holds) was exported
    but charted nowhere, and no alert said that lookups kept missing for want of time."""
    rows: dict[str, list[str]] = {}
    row = ""
    for panel in json.loads(DASHBOARD.read_text())["panels"]:
        if panel["type"] == "row":
            row = panel["title"]
        rows.setdefault(row, []).extend(t["expr"] for t in panel.get("targets", []))
    charted = " ".join(rows["Faults"])
    alerted = ALERTS.read_text()
    for counter in ("tier_failures", "tier_corrupt_reads", "tier_dropped_writes",
                    "tier_lookup_timeouts"):
        series = f"vllm:kvtier_{counter}_total"
        assert series in charted, f"{series} is on no panel of the Faults row"
        assert series in alerted, f"no alert over {series}"
