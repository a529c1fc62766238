"""Write the ConfigMaps that carry deploy/'s monitoring files into a cluster.

    python3 deploy/kubernetes/render_configmaps.py          # rewrite them
    python3 deploy/kubernetes/render_configmaps.py --check  # exit 1 when one is stale

The Grafana dashboard (deploy/grafana/kvtier-dashboard.json) and the Prometheus alerting
rules (deploy/prometheus/kvtier-alerts.yml) are kept once, where they are tested; each
ConfigMap here holds a verbatim copy, generated, never edited by hand. Kustomize's
configMapGenerator cannot read files outside its folder, hence a generated file.
tests/tools/test_k8s_manifests.py fails when a copy differs from its source.

Primitives: `ConfigMapSource`, `SOURCES`, `render(source)`, `stale()`.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEPLOY = HERE.parent


@dataclass(frozen=True, slots=True)
class ConfigMapSource:
    """One ConfigMap holding one file of deploy/."""

    source: Path  # the file copied, verbatim
    target: Path  # the ConfigMap manifest written
    name: str  # metadata.name
    purpose: str  # the comment at the top: who reads this ConfigMap and how
    labels: dict[str, str] = field(default_factory=dict)  # metadata.labels

    @property
    def key(self) -> str:
        """The data key: the source's file name (what a mount of the ConfigMap shows)."""
        return self.source.name


SOURCES = (
    ConfigMapSource(
        source=DEPLOY / "grafana" / "kvtier-dashboard.json",
        target=HERE / "grafana-dashboard-configmap.yaml",
        name="kvtier-grafana-dashboard",
        purpose="The kvtier Grafana dashboard. Grafana's dashboard sidecar\n"
                "(kube-prometheus-stack, the Grafana Helm chart) loads ConfigMaps labelled\n"
                "grafana_dashboard=1 in the namespaces it watches; without the sidecar,\n"
                "import the JSON in Grafana's UI.",
        labels={"grafana_dashboard": "1"},
    ),
    ConfigMapSource(
        source=DEPLOY / "prometheus" / "kvtier-alerts.yml",
        target=HERE / "prometheus-rules-configmap.yaml",
        name="kvtier-prometheus-rules",
        purpose="kvtier's Prometheus alerting rules, to mount into a Prometheus server and list\n"
                "under rule_files: (e.g. /etc/prometheus/rules/kvtier-alerts.yml). With the\n"
                "Prometheus Operator, use a PrometheusRule instead (docs/deploy.md).",
    ),
)


def render(source: ConfigMapSource) -> str:
    """The ConfigMap manifest holding `source.source`'s text as a YAML literal block.

    Raises:
        ValueError: when the text cannot be held verbatim in a literal block (a line with
            trailing whitespace or a tab, a leading space, more than one final newline).
    """
    text = source.source.read_text(encoding="utf-8")
    # "|" keeps one final newline, "|-" none: the text must end with at most one.
    body, chomp = (text[:-1], "") if text.endswith("\n") else (text, "-")
    lines = body.split("\n")
    bad = [n for n, line in enumerate(lines, 1) if line != line.rstrip() or "\t" in line]
    if bad or body.startswith(" ") or body.endswith("\n"):
        raise ValueError(f"{source.source}: cannot go verbatim into a YAML literal block "
                         "(trailing whitespace or a tab on a line, a leading space, or more "
                         f"than one final newline; line {bad[0] if bad else 1})")
    relative = source.source.relative_to(DEPLOY.parent)
    header = [f"# GENERATED from {relative} by deploy/kubernetes/render_configmaps.py:",
              "# edit the source, then rerun the script. Do not edit by hand.", "#"]
    header += [f"# {line}" for line in source.purpose.split("\n")]
    out = [*header, "apiVersion: v1", "kind: ConfigMap", "metadata:", f"  name: {source.name}"]
    if source.labels:
        out.append("  labels:")
        out += [f'    {key}: "{value}"' for key, value in source.labels.items()]
    out += ["data:", f"  {source.key}: |{chomp}"]
    out += [f"    {line}" if line else "" for line in lines]
    return "\n".join(out) + "\n"


def stale() -> list[Path]:
    """The ConfigMap manifests whose content differs from what `render` writes."""
    return [s.target for s in SOURCES
            if not s.target.exists() or s.target.read_text(encoding="utf-8") != render(s)]


def main(argv: list[str]) -> int:
    if argv == ["--check"]:
        out_of_date = stale()
        for path in out_of_date:
            print(f"stale: {path} (run {Path(__file__).name})")
        return 1 if out_of_date else 0
    if argv:
        print(__doc__)
        return 2
    for source in SOURCES:
        source.target.write_text(render(source), encoding="utf-8")
        print(f"wrote {source.target}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
