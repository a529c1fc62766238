"""The Kubernetes manifests in deploy/kubernetes/, checked without a cluster.

Every document is validated against Kubernetes' own OpenAPI schemas (kubernetes-validate,
which ships them: no network), strictly (an unknown field fails), for the oldest and the
newest Kubernetes release the checks cover. Then what a schema cannot see: the kustomization
lists every manifest, the generated ConfigMaps are the monitoring files of deploy/ verbatim,
the kvtier connector JSON in the Deployment passes kvtier's own schema and equals the
kvtier-config ConfigMap, every tier path is a mounted volume of the right kind and size, the
pod's memory holds the memory tier, and `kvtier audit` finds no error in the Deployment.

deploy/kubernetes-node/ (kvtier as one cache per Kubernetes node: an overlay of the base with
a `kvtier node` DaemonSet and engines in node mode) goes through the same schema validation,
plus: its kustomization is the base less the base's engines, the node's config passes
kvtier's schema and each of its paths is mounted, the node's memory holds its RAM tier, its
metrics port agrees with its Service, the engines' connector JSON names the node's socket, the
engines and the node mount the same host socket directory and /dev/shm and run in the same
group, and `kvtier audit` finds no error in the engines' Deployment.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import logging
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from kvtier.integrations.vllm.config import CONNECTOR_CLASS, ConnectorConfig
from kvtier.node.cli import check_shm_room
from kvtier.node.config import NodeConfig
from kvtier.tiers.shmslab import SHM_DIR
from kvtier.tiers.storeconfig import StoreConfig
from kvtier.tools.cli.main import main
from kvtier.units import parse_size

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "kubernetes"
NODE = ROOT / "deploy" / "kubernetes-node"  # the overlay: one cache per node
MODEL_CONFIG = ROOT / "tests" / "data" / "configs" / "llama-3-8b.json"
# The oldest Kubernetes release still common in production, and the newest the bundled
# schemas know.
K8S_VERSIONS = ("1.29", kubernetes_validate.latest_version())
_QUANTITY = re.compile(r"^(\d+(?:\.\d+)?)(Ki|Mi|Gi|Ti|Pi)?$")
_BINARY = {None: 1, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50}


def manifest_files(folder: Path = K8S) -> list[Path]:
    return sorted(p for p in folder.glob("*.yaml") if p.name != "kustomization.yaml")


def documents() -> list[tuple[str, dict[str, Any]]]:
    """(file:index kind/name, document) of every document of every manifest, the base's
    and the node overlay's (its files named with their folder)."""
    out = []
    for path in manifest_files() + manifest_files(NODE):
        name = path.name if path.parent == K8S else f"{path.parent.name}/{path.name}"
        for i, doc in enumerate(d for d in yaml.safe_load_all(path.read_text()) if d):
            out.append((f"{name}:{i} {doc['kind']}/{doc['metadata']['name']}", doc))
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


# -- deploy/kubernetes-node: one cache per node --------------------------------------------

def node_pod() -> dict[str, Any]:
    return find("DaemonSet", "kvtier-node")["spec"]["template"]["spec"]


def node_container() -> dict[str, Any]:
    return next(c for c in node_pod()["containers"] if c["command"] == ["kvtier", "node", "serve"])


def node_flag(name: str) -> str:
    args = node_container()["args"]
    assert args.count(name) == 1, f"{name} appears {args.count(name)} times"
    return str(args[args.index(name) + 1])


def engine_pod() -> dict[str, Any]:
    return find("Deployment", "vllm-kvtier-node")["spec"]["template"]["spec"]


def engine_container() -> dict[str, Any]:
    return next(c for c in engine_pod()["containers"] if c["command"][:2] == ["vllm", "serve"])


def engine_flag(name: str) -> str:
    args = engine_container()["args"]
    assert args.count(name) == 1, f"{name} appears {args.count(name)} times"
    return str(args[args.index(name) + 1])


def engine_extra() -> dict[str, Any]:
    extra = json.loads(engine_flag("--kv-transfer-config"))["kv_connector_extra_config"]
    assert isinstance(extra, dict)
    return extra


def node_tiers() -> list[dict[str, Any]]:
    config = yaml.safe_load(find("ConfigMap", "kvtier-node-config")["data"]["node.yaml"])
    tiers: list[dict[str, Any]] = config["tiers"]
    return tiers


def host_path_at(pod: dict[str, Any], container: dict[str, Any], mount_path: str) -> str:
    """The host directory `container` sees at `mount_path` (a hostPath volume)."""
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    assert mount_path in mounts, f"{container['name']}: nothing mounted at {mount_path}"
    volume = next(v for v in pod["volumes"] if v["name"] == mounts[mount_path])
    assert "hostPath" in volume, f"{container['name']}: {mount_path} is not a hostPath"
    return str(volume["hostPath"]["path"])


def run_as_group(pod: dict[str, Any], container: dict[str, Any]) -> int | None:
    """The group the container's processes run as (the container's setting wins)."""
    group = container.get("securityContext", {}).get("runAsGroup")
    return group if group is not None else pod.get("securityContext", {}).get("runAsGroup")


def test_the_node_kustomization_is_the_base_with_a_node_cache_for_its_engines() -> None:
    kustomization = yaml.safe_load((NODE / "kustomization.yaml").read_text())
    base = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert kustomization["namespace"] == base["namespace"]
    resources = kustomization["resources"]
    assert resources[0] == "../kubernetes"
    assert sorted(resources[1:]) == [p.name for p in manifest_files(NODE)]
    patches = [yaml.safe_load(p["patch"]) for p in kustomization["patches"]]
    # The base's engines (tiers in each pod) are deleted: the node-mode engines replace them.
    assert {"$patch": "delete", "apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": "vllm-kvtier"}} in patches
    # Redis is the node's tier now: the node's pods are let in.
    (policy_patch,) = [p for p in kustomization["patches"]
                       if p.get("target", {}).get("kind") == "NetworkPolicy"]
    policy = find("NetworkPolicy", policy_patch["target"]["name"])
    [operation] = yaml.safe_load(policy_patch["patch"])
    assert operation["op"] == "add" and operation["path"] == "/spec/ingress/0/from/-"
    assert policy["spec"]["ingress"][0]["from"]
    node_labels = find("DaemonSet", "kvtier-node")["spec"]["template"]["metadata"]["labels"]
    assert operation["value"]["podSelector"]["matchLabels"].items() <= node_labels.items()
    # The engines keep the base's pod labels: the Service and the NetworkPolicy select them.
    engine_labels = find("Deployment", "vllm-kvtier-node")["spec"]["template"]["metadata"][
        "labels"]
    assert find("Service", "vllm-kvtier")["spec"]["selector"].items() <= engine_labels.items()


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
def test_kustomize_renders_the_node_overlay_into_valid_kubernetes() -> None:
    rendered = subprocess.run(["kubectl", "kustomize", str(NODE)], capture_output=True,
                              text=True, timeout=120)
    assert rendered.returncode == 0, rendered.stderr
    docs = [d for d in yaml.safe_load_all(rendered.stdout) if d]
    for doc in docs:
        kubernetes_validate.validate(doc, K8S_VERSIONS[-1], strict=True)
    names = {(d["kind"], d["metadata"]["name"]) for d in docs}
    assert ("DaemonSet", "kvtier-node") in names
    assert sorted(n for k, n in names if k == "Deployment") == ["kvtier-redis",
                                                               "vllm-kvtier-node"]
    assert {d["metadata"]["namespace"] for d in docs if d["kind"] != "Namespace"} == {"kvtier"}


def test_the_node_config_passes_kvtiers_schema_and_each_path_is_mounted(tmp_path: Path) -> None:
    tiers = copy.deepcopy(node_tiers())
    assert [t["kind"] for t in tiers] == ["memory", "disk", "redis", "shared"]
    mounts = {m["mountPath"]: m["name"] for m in node_container()["volumeMounts"]}
    volumes = {v["name"]: v for v in node_pod()["volumes"]}
    for tier in tiers:
        if "path" in tier:
            assert tier["path"] in mounts, f"{tier['kind']} tier path {tier['path']}"
            tier["path"] = under(tmp_path, tier["path"])
    NodeConfig(StoreConfig.parse({"tiers": tiers}), tmp_path / "node.sock")
    # The disk tier on the host (it outlives the node's pod), the shared tier the base's claim.
    disk = next(t for t in node_tiers() if t["kind"] == "disk")
    assert host_path_at(node_pod(), node_container(), disk["path"]) == disk["path"]
    shared = next(t for t in node_tiers() if t["kind"] == "shared")
    claim = volumes[mounts[shared["path"]]]["persistentVolumeClaim"]["claimName"]
    assert find("PersistentVolumeClaim", claim)["spec"]["accessModes"] == ["ReadWriteMany"]
    # --config is the ConfigMap's file.
    config_path = Path(node_flag("--config"))
    volume = volumes[mounts[str(config_path.parent)]]
    assert volume["configMap"]["name"] == "kvtier-node-config"
    assert config_path.name in find("ConfigMap", "kvtier-node-config")["data"]


def test_the_node_pod_memory_holds_its_ram_tier() -> None:
    resources = node_container()["resources"]
    memory = next(t for t in node_tiers() if t["kind"] == "memory")
    assert resources["requests"]["memory"] == resources["limits"]["memory"]
    assert quantity_bytes(resources["limits"]["memory"]) >= parse_size(
        memory["capacity"], "capacity") + 8 * 2**30


def test_the_node_ram_tier_and_pod_memory_are_what_kvtier_plan_gives(
        capsys: pytest.CaptureFixture[str]) -> None:
    """The overlay sizes the node as its comments say: eight 8B engines on a node of 1TiB RAM,
    the host's /dev/shm half of it. Before, its 480GiB RAM tier left /dev/shm 32GiB of 512,
    where the plan holds the tier to 90% of it (460.78GiB)."""
    assert main(["plan", str(MODEL_CONFIG), "--node-engines", "8", "--host-ram", "1TiB",
                 "--node-shm", "512GiB", "--vllm-version", "0.21.0", "--json"]) == 0
    planned = json.loads(capsys.readouterr().out)["node"]
    memory = next(t for t in node_tiers() if t["kind"] == "memory")
    assert memory == planned["node_config"]["tiers"][0]
    limit = node_container()["resources"]["limits"]["memory"]
    assert quantity_bytes(limit) == -(-planned["pod_memory_bytes"] // 2**30) * 2**30


def test_the_node_sizing_command_of_deploy_md_gives_the_overlays_tiers(
        capsys: pytest.CaptureFixture[str]) -> None:
    """deploy.md's `kvtier plan ... --node-engines 8` command, run as written, sizes the
    overlay's RAM and disk tiers. Before, it passed `--nvme 8TB` (decimal: a 6705.52GiB disk
    tier) where the overlay holds 7.2TiB (90% of 8TiB, the base's 1TiB per pod times 8)."""
    text = (ROOT / "docs" / "deploy.md").read_text().replace("\\\n", " ")
    line = next(line.strip() for line in text.splitlines()
                if line.strip().startswith("kvtier plan ") and "--node-engines" in line)
    assert main([*shlex.split(line)[1:], "--json"]) == 0
    planned = json.loads(capsys.readouterr().out)["node"]["node_config"]["tiers"]
    sizes = {t["kind"]: parse_size(t["capacity"], "capacity") for t in node_tiers()
             if t["kind"] in ("memory", "disk")}
    assert {t["kind"]: parse_size(t["capacity"], "capacity") for t in planned} == sizes

def test_the_node_max_layouts_is_what_the_hosts_shm_holds(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """--max-layouts is the number of RAM slabs the host's /dev/shm (512GiB: the plan above)
    holds, and the engines' layouts fit in it (one model at TP 1). Before, the default 4
    stood beside a /dev/shm of one slab: the node warned "holds 1 RAM slab, fewer than
    max_layouts (4)" at every start, and an engine of a second layout was let through to be
    refused only when its slab could not be made."""
    memory = next(t for t in node_tiers() if t["kind"] == "memory")
    host_shm = parse_size("512GiB", "node-shm")
    max_layouts = int(node_flag("--max-layouts"))
    assert max_layouts == host_shm // parse_size(memory["capacity"], "capacity")
    assert int(engine_flag("--tensor-parallel-size")) <= max_layouts  # a layout per rank
    config = NodeConfig(StoreConfig.parse({"tiers": [memory]}), tmp_path / "node.sock",
                        max_layouts=max_layouts)
    with caplog.at_level(logging.WARNING, logger="kvtier.node.cli"):
        check_shm_room(config, "kvtier-node-config.yaml", shm_bytes=host_shm)
    assert [r.getMessage() for r in caplog.records] == []


def test_the_node_metrics_port_agrees_with_its_service() -> None:
    (port,) = node_container()["ports"]
    assert int(node_flag("--metrics-port")) == port["containerPort"]
    assert node_flag("--metrics-host") == "0.0.0.0"  # the pod's network: a scraper elsewhere
    service = find("Service", "kvtier-node")
    assert service["spec"]["selector"].items() <= find("DaemonSet", "kvtier-node")[
        "spec"]["template"]["metadata"]["labels"].items()
    assert service["metadata"]["annotations"]["prometheus.io/port"] == str(port["containerPort"])
    assert service["spec"]["ports"][0]["targetPort"] == port["name"]


def test_the_engines_connector_config_names_the_nodes_socket() -> None:
    extra = engine_extra()
    parsed = ConnectorConfig.parse(extra)
    parsed.check_block_size(int(engine_flag("--block-size")))
    assert parsed.node == node_flag("--socket")
    assert "tiers" not in extra  # the node's
    # Chunks are shared with engines of the base's settings only at the same chunking.
    base = transfer_config()["kv_connector_extra_config"]
    assert extra["tokens_per_chunk"] == base["tokens_per_chunk"]
    assert engine_flag("--block-size") == flag("--block-size")


def test_the_node_and_its_engines_share_the_socket_directory_shm_and_group() -> None:
    socket_dir = str(Path(node_flag("--socket")).parent)
    assert str(Path(engine_extra()["node"]).parent) == socket_dir
    for mount_path in (socket_dir, str(SHM_DIR)):  # the socket; the RAM tier's slabs
        assert host_path_at(node_pod(), node_container(), mount_path) == host_path_at(
            engine_pod(), engine_container(), mount_path), mount_path
    assert host_path_at(node_pod(), node_container(), str(SHM_DIR)) == str(SHM_DIR)
    # The socket and the slabs are mode 0660: the engines must run in the node's group.
    group = run_as_group(node_pod(), node_container())
    assert group is not None and group != 0
    assert run_as_group(engine_pod(), engine_container()) == group
    # The hostPath directories start root-owned: the node's init container hands them over.
    (init,) = node_pod()["initContainers"]
    assert f"chown {node_pod()['securityContext']['runAsUser']}:{group} {socket_dir}" in \
        " ".join(init["args"])


def test_kvtier_audit_finds_no_error_in_the_node_engines(
        capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["audit", str(NODE / "vllm-node-deployment.yaml"),
                 "--model-config", str(MODEL_CONFIG), "--json"])
    report = json.loads(capsys.readouterr().out)
    errors = [f for f in report["findings"] if f["severity"] == "error"]
    assert code == 0 and report["ok"] and not errors, errors
