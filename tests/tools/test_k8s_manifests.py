"""The Kubernetes manifests in deploy/kubernetes/, checked without a cluster.

Every document is validated against Kubernetes' own OpenAPI schemas (kubernetes-validate,
which ships them: no network), strictly (an unknown field fails), for the oldest and the
newest Kubernetes release the checks cover. Then what a schema cannot see: the kustomization
lists every manifest, the generated ConfigMaps are the monitoring files of deploy/ verbatim,
the kvtier connector JSON in the Deployment passes kvtier's own schema and equals the
kvtier-config ConfigMap, every tier path is a mounted volume of the right kind and size, the
pod's memory holds the memory tier, and `kvtier audit` finds no error in the Deployment.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import re
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from kvtier.integrations.vllm.config import CONNECTOR_CLASS, ConnectorConfig
from kvtier.tools.cli.main import main
from kvtier.units import parse_size

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "kubernetes"
MODEL_CONFIG = ROOT / "tests" / "data" / "configs" / "llama-3-8b.json"
# The oldest Kubernetes release still common in production, and the newest the bundled
# schemas know.
K8S_VERSIONS = ("1.29", kubernetes_validate.latest_version())
_QUANTITY = re.compile(r"^(\d+(?:\.\d+)?)(Ki|Mi|Gi|Ti|Pi)?$")
_BINARY = {None: 1, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50}


def manifest_files() -> list[Path]:
    return sorted(p for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")


def documents() -> list[tuple[str, dict[str, Any]]]:
    """(file:index kind/name, document) of every document of every manifest."""
    out = []
    for path in manifest_files():
        for i, doc in enumerate(d for d in yaml.safe_load_all(path.read_text()) if d):
            out.append((f"{path.name}:{i} {doc['kind']}/{doc['metadata']['name']}", doc))
    return out


def find(kind: str, name: str) -> dict[str, Any]:
    matches = [d for _, d in documents() if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(matches) == 1, f"{kind}/{name}: {len(matches)} manifests"
    return matches[0]


def vllm_pod() -> dict[str, Any]:
    return find("Deployment", "vllm-kvtier")["spec"]["template"]["spec"]


def vllm_container() -> dict[str, Any]:
    containers = vllm_pod()["containers"]
    return next(c for c in containers if c["command"][:2] == ["vllm", "serve"])


def flag(name: str) -> str:
    """The value following `name` in the vLLM container's args (each flag given once)."""
    args = vllm_container()["args"]
    assert args.count(name) == 1, f"{name} appears {args.count(name)} times"
    return str(args[args.index(name) + 1])


def transfer_config() -> dict[str, Any]:
    parsed = json.loads(flag("--kv-transfer-config"))
    assert isinstance(parsed, dict)
    return parsed


def tiers_with_path() -> list[dict[str, Any]]:
    return [t for t in transfer_config()["kv_connector_extra_config"]["tiers"] if "path" in t]


def quantity_bytes(text: str) -> int:
    """A Kubernetes binary quantity ("104Gi", "1Ti") in bytes."""
    match = _QUANTITY.match(str(text))
    assert match, f"{text!r}: not a binary quantity this test reads"
    return int(float(match.group(1)) * _BINARY[match.group(2)])


def under(tmp_path: Path, path: str) -> str:
    """`path` (absolute, a pod's) moved under tmp_path: tier paths are checked for being
    creatable on the machine that parses them, and / is not writable by every test user."""
    return str(tmp_path / path.lstrip("/"))


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("where,doc", documents(), ids=[w for w, _ in documents()])
def test_every_manifest_is_valid_kubernetes(where: str, doc: dict[str, Any],
                                            version: str) -> None:
    try:
        kubernetes_validate.validate(doc, version, strict=True)
    except kubernetes_validate.ValidationError as exc:
        pytest.fail(f"{where} (Kubernetes {version}): {exc.message} at "
                    f"{'.'.join(str(p) for p in exc.path)}")


@pytest.mark.parametrize("breakage", ["unknown field", "wrong type", "missing field"])
def test_the_validation_rejects_a_broken_deployment(breakage: str) -> None:
    # What the test above would say of a mistyped manifest: it must not pass.
    doc = copy.deepcopy(find("Deployment", "vllm-kvtier"))
    container = doc["spec"]["template"]["spec"]["containers"][0]
    if breakage == "unknown field":
        container["readinessProbe"]["httpGet"]["paht"] = "/health"
    elif breakage == "wrong type":
        doc["spec"]["replicas"] = "two"
    else:
        del doc["spec"]["selector"]
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(doc, K8S_VERSIONS[-1], strict=True)


def test_the_kustomization_lists_every_manifest() -> None:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    resources = kustomization["resources"]
    assert len(resources) == len(set(resources))
    assert sorted(resources) == [p.name for p in manifest_files()]
    namespaces = [d for _, d in documents() if d["kind"] == "Namespace"]
    assert [n["metadata"]["name"] for n in namespaces] == [kustomization["namespace"]]


def test_the_configmaps_are_the_monitoring_files_verbatim() -> None:
    spec = importlib.util.spec_from_file_location("render_configmaps",
                                                  K8S / "render_configmaps.py")
    assert spec is not None and spec.loader is not None
    render = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = render  # dataclasses look their module up there
    spec.loader.exec_module(render)
    assert {s.source.parent.name for s in render.SOURCES} == {"grafana", "prometheus"}
    for source in render.SOURCES:
        configmap = yaml.safe_load(source.target.read_text())
        assert configmap["data"] == {source.key: source.source.read_text()}, (
            f"{source.target.name} differs from {source.source}: run "
            "python3 deploy/kubernetes/render_configmaps.py")
    assert render.stale() == []
    dashboard = find("ConfigMap", "kvtier-grafana-dashboard")
    assert dashboard["metadata"]["labels"] == {"grafana_dashboard": "1"}


def test_the_connector_config_passes_kvtiers_schema(tmp_path: Path) -> None:
    config = transfer_config()
    assert config["kv_connector"] == CONNECTOR_CLASS  # by name: the plugin entry point
    assert config["kv_role"] == "kv_both"
    extra = copy.deepcopy(config["kv_connector_extra_config"])
    for tier in extra["tiers"]:
        if "path" in tier:
            tier["path"] = under(tmp_path, tier["path"])
    parsed = ConnectorConfig.parse(extra)
    parsed.check_block_size(int(flag("--block-size")))
    assert [t.kind for t in parsed.store.tiers] == ["memory", "disk", "redis", "shared"]


def test_the_kvtier_configmap_equals_the_deployments_config() -> None:
    configmap = find("ConfigMap", "kvtier-config")
    from_file = yaml.safe_load(configmap["data"]["kvtier.yaml"])
    assert from_file == transfer_config()["kv_connector_extra_config"]
    mounts = {m["name"]: m for m in vllm_container()["volumeMounts"]}
    volume = next(v for v in vllm_pod()["volumes"] if v.get("configMap"))
    assert volume["configMap"]["name"] == "kvtier-config"
    assert mounts[volume["name"]]["mountPath"] == "/etc/kvtier"
    assert mounts[volume["name"]]["readOnly"] is True


def test_each_tier_path_is_a_volume_of_its_kind() -> None:
    mounts = {m["mountPath"]: m["name"] for m in vllm_container()["volumeMounts"]}
    volumes = {v["name"]: v for v in vllm_pod()["volumes"]}
    kinds = {}
    for tier in tiers_with_path():
        assert tier["path"] in mounts, f"{tier['kind']} tier path {tier['path']} is not mounted"
        volume = volumes[mounts[tier["path"]]]
        kinds[tier["kind"]] = volume
    # The shared tier: the ReadWriteMany claim every pod mounts, larger than kvtier's quota.
    claim = find("PersistentVolumeClaim",
                 kinds["shared"]["persistentVolumeClaim"]["claimName"])
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    shared = next(t for t in tiers_with_path() if t["kind"] == "shared")
    assert parse_size(shared["capacity"], "capacity") < quantity_bytes(
        claim["spec"]["resources"]["requests"]["storage"])
    # The disk tier: the pod's own volume, which the kubelet lets grow past the tier's size.
    disk = next(t for t in tiers_with_path() if t["kind"] == "disk")
    assert parse_size(disk["capacity"], "capacity") < quantity_bytes(
        kinds["disk"]["emptyDir"]["sizeLimit"])


def test_the_pod_memory_holds_the_memory_tier() -> None:
    resources = vllm_container()["resources"]
    memory = next(t for t in transfer_config()["kv_connector_extra_config"]["tiers"]
                  if t["kind"] == "memory")
    tier_bytes = parse_size(memory["capacity"], "capacity")
    assert resources["requests"]["memory"] == resources["limits"]["memory"]
    assert quantity_bytes(resources["limits"]["memory"]) >= tier_bytes + 16 * 2**30


def test_probes_service_and_redis_url_agree_with_the_pods() -> None:
    container = vllm_container()
    (port,) = container["ports"]
    assert int(flag("--port")) == port["containerPort"]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": "/health", "port": port["name"]}
    service = find("Service", "vllm-kvtier")
    labels = find("Deployment", "vllm-kvtier")["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    assert service["metadata"]["annotations"]["prometheus.io/port"] == str(port["containerPort"])
    redis_tier = next(t for t in transfer_config()["kv_connector_extra_config"]["tiers"]
                      if t["kind"] == "redis")
    redis_service = find("Service", "kvtier-redis")
    assert redis_tier["url"].startswith(
        f"redis://{redis_service['metadata']['name']}:{redis_service['spec']['ports'][0]['port']}/")


def test_kvtier_audit_finds_no_error_in_the_deployment(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text = (K8S / "vllm-deployment.yaml").read_text()
    for tier in tiers_with_path():
        text = text.replace(tier["path"], under(tmp_path, tier["path"]))
    manifest = tmp_path / "vllm-deployment.yaml"
    manifest.write_text(text)
    code = main(["audit", str(manifest), "--model-config", str(MODEL_CONFIG), "--json"])
    report = json.loads(capsys.readouterr().out)
    errors = [f for f in report["findings"] if f["severity"] == "error"]
    assert code == 0 and report["ok"] and not errors, errors
    assert report["vllm_version"] in ([0, 32, 0], "v0.32.0", "0.32.0")  # from the image tag
    assert report["model"] == "meta-llama/Meta-Llama-3-8B-Instruct"
