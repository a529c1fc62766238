"""The docs' metric names against the code that exports them: docs/configuration.md's table
of every `vllm:kvtier_*` metric (name, type and labels) is the connector's exact set, docs/
deploy.md's list of a node's `kvtier_node_*` metrics is the node's exact set, and no page an
operator reads names a metric that does not exist. Before this test the reference named fewer
than half of the engine's metrics, deploy.md's node list lacked eight of the node's (its
engines' four, `read_in_place`, `received_chunks`, `sent_chunks`,
`tier_policy_horizon_ops`), and sharing.md named two counters without their `_total`."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvtier.integrations.vllm import metrics as engine_metrics
from kvtier.node import metrics as node_metrics

ROOT = Path(__file__).resolve().parents[2]
PAGES = ("README.md", "docs/configuration.md", "docs/deploy.md", "docs/node.md",
         "docs/sharing.md", "docs/s3.md", "docs/retention.md")
HISTOGRAM_SERIES = ("_bucket", "_sum", "_count")


def engine_table() -> dict[str, tuple[str, str]]:
    """configuration.md's metric table: name -> (type, labels)."""
    text = (ROOT / "docs/configuration.md").read_text()
    rows = [line.split("|") for line in text.splitlines() if line.startswith("| `vllm:kvtier_")]
    return {row[1].strip().strip("`"): (row[2].strip(), row[3].replace("`", "").strip())
            for row in rows}


def engine_exported() -> dict[str, tuple[str, str]]:
    """What the connector exports: name -> (type, labels beyond vLLM's own)."""
    kinds = (("counter", engine_metrics.COUNTERS), ("gauge", engine_metrics.GAUGES),
             ("histogram", engine_metrics.HISTOGRAMS))
    return {engine_metrics.PREFIX + name + ("_total" if kind == "counter" else ""):
            (kind, ", ".join(engine_metrics.LABELS.get(name, [])) or "-")
            for kind, names in kinds for name in names}


def node_exported() -> set[str]:
    """The names a node's /metrics carries (histogram series apart)."""
    prefix = node_metrics.PREFIX
    return ({f"{prefix}tier_{name}_total" for name in node_metrics.TIER_COUNTERS}
            | {f"{prefix}tier_{name}_total" for name, _ in node_metrics.TIER_SECONDS.values()}
            | {f"{prefix}tier_{name}" for name in node_metrics.TIER_GAUGES}
            | {f"{prefix}engine_{name}" for name in node_metrics.ENGINE_GAUGES}
            | {f"{prefix}{name}" for name in node_metrics.NODE_GAUGES}
            | {f"{prefix}{name}_total" for name in node_metrics.NODE_COUNTERS}
            | {f"{prefix}engine_evictions_total", f"{prefix}borrow_seconds",
               f"{prefix}info"})


def expanded(text: str) -> str:
    """`a_{b,c}_d` written out as `a_b_d a_c_d`, as a reader expands it (not a label set:
    `a{tier,reason}`)."""
    return re.sub(r"(\w*_)\{(\w+(?:,\w+)+)\}(\w*)", lambda m: " ".join(
        m.group(1) + part + m.group(3) for part in m.group(2).split(",")), text)


def test_the_reference_table_is_every_metric_the_connector_exports() -> None:
    assert engine_table() == engine_exported()


def test_deploy_lists_every_metric_of_a_node() -> None:
    text = expanded((ROOT / "docs/deploy.md").read_text())
    listed = set(re.findall(r"kvtier_node_\w+", text.split("**Metrics.**", 1)[1]))
    assert listed == node_exported()


@pytest.mark.parametrize("page", PAGES)
def test_every_metric_a_page_names_exists(page: str) -> None:
    exported = set(engine_exported()) | node_exported()
    exported |= {name + series for name in exported for series in HISTOGRAM_SERIES}
    named = set(re.findall(r"(?:vllm:kvtier|kvtier_node)_\w+", expanded((ROOT / page)
                                                                         .read_text())))
    assert {name for name in named if not name.endswith("_")} <= exported
