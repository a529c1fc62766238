"""The node's settings are checked where they are given, naming the field: a node's first tier
must be a memory tier (its RAM, shared with its engines), each of its other settings of its
type and in its range (a ConfigError naming the field, the value and what is allowed: never a
TypeError, nor nonsense kept), and an engine's `node` must be an absolute socket path with no
`tiers` of its own beside it (in node mode every tier is the node's: tiers set in the engine
would be silently ignored). Also `kvtier node serve` with such a config: exit status 2 and the
field named, no node started. And its start-up warning where it shares a CPU group (a
session, under the kernel's autogroup) with what started it. A RAM tier larger than
/dev/shm, where the node keeps it, is refused by `kvtier node serve` the same way.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvtier.errors import ConfigError
from kvtier.integrations.vllm.config import ConnectorConfig
from kvtier.node.cli import AUTOGROUP
from kvtier.node.config import NodeConfig
from kvtier.tiers.shmslab import SHM_DIR, shm_size_bytes
from kvtier.tiers.storeconfig import StoreConfig
from kvtier.units import format_size

pytestmark = pytest.mark.timeout(120)  # a hang fails here, not at the suite's 900 s

MEMORY = {"tiers": [{"kind": "memory", "capacity": "1MiB"}]}
SOCKET = Path("/run/kvtier/node.sock")
# A store of its own (an engine's disk-only store), not a node's: no RAM to share.
DISK_FIRST = {"tiers": [{"kind": "disk", "path": "/tmp/kvtier-never-made", "capacity": "1GiB"}]}


def test_a_node_whose_first_tier_is_not_memory_is_refused(tmp_path: Path):
    with pytest.raises(ConfigError) as raised:
        NodeConfig(StoreConfig.parse(DISK_FIRST), tmp_path / "node.sock")
    assert raised.value.field == "tiers[0].kind" and raised.value.value == "disk"
    assert "tiers[0].kind" in str(raised.value)


@pytest.mark.parametrize(("config", "flags", "named"), [
    (DISK_FIRST, (), "tiers[0].kind"),
    (MEMORY, ("--max-layouts", "0"), "max_layouts=0"),  # the flag docs/node.md lists
    # `--name "$NODE_NAME"` with the variable unset: it was the host name (the pod's), so the
    # events' topic named no Kubernetes node and a new pod found no slabs to recover
    (MEMORY, ("--name", ""), "name=''"),
    # "" binds every interface: `--metrics-host "$HOST"` unset exposed the metrics
    (MEMORY, ("--metrics-port", "9400", "--metrics-host", ""), "argument --metrics-host"),
    # the node names its slabs itself (kvtier-<name>-<layout>): a name given here was dropped
    # without a word, the slab not where the operator looked for it
    ({"tiers": [{**MEMORY["tiers"][0], "shared_memory": "kv-slab"}]}, (),
     "tiers[0].shared_memory='kv-slab'"),
])
def test_kvtier_node_serve_names_the_bad_field(
        tmp_path: Path, config: dict[str, Any], flags: tuple[str, ...], named: str):
    path = tmp_path / "node.json"
    path.write_text(json.dumps(config))
    served = subprocess.run(
        [sys.executable, "-m", "kvtier.node", "serve", "--config", str(path),
         "--socket", str(tmp_path / "node.sock"), "--name", tmp_path.name, *flags],
        capture_output=True, text=True, timeout=60)
    assert served.returncode == 2, served.stderr
    assert named in served.stderr
    assert not (tmp_path / "node.sock").exists()


def test_kvtier_node_serve_names_a_socket_it_cannot_bind(tmp_path: Path):
    # A directory the node may not create a file in (here procfs; a /run/kvtier of another
    # user's is the common case): the bind's error names no path, and the node said only
    # "kvtier node: [Errno 2] No such file or directory", naming neither setting nor file.
    socket_path = Path(f"/proc/kvtier-{tmp_path.name}.sock")
    path = tmp_path / "node.json"
    path.write_text(json.dumps(MEMORY))
    served = subprocess.run(
        [sys.executable, "-m", "kvtier.node", "serve", "--config", str(path),
         "--socket", str(socket_path), "--name", tmp_path.name],
        capture_output=True, text=True, timeout=60)
    assert served.returncode == 2, served.stderr
    # Its errno's text too (ENOENT as root, EACCES for another user: procfs creates nothing).
    assert f"socket_path {socket_path}: cannot listen there (" in served.stderr, served.stderr


@pytest.mark.skipif(shm_size_bytes() is None, reason=f"no {SHM_DIR}")
def test_kvtier_node_serve_refuses_a_ram_tier_larger_than_dev_shm(tmp_path: Path):
    # The node used to start and serve, then refuse every engine: /dev/shm full (ENOSPC)
    # when it created the first layout's slab, logged once per layout.
    shm = shm_size_bytes()
    assert shm is not None
    path = tmp_path / "node.json"
    path.write_text(json.dumps({"tiers": [{"kind": "memory", "capacity": shm + 2**30}]}))
    served = subprocess.run(
        [sys.executable, "-m", "kvtier.node", "serve", "--config", str(path),
         "--socket", str(tmp_path / "node.sock"), "--name", tmp_path.name],
        capture_output=True, text=True, timeout=60)
    assert served.returncode == 2, served.stderr
    assert f"{path}: tiers[0].capacity='{format_size(shm + 2**30)}'" in served.stderr
    assert f"at most {format_size(shm)}, the size of {SHM_DIR}" in served.stderr
    assert not (tmp_path / "node.sock").exists()


@pytest.mark.parametrize(("field", "value", "allowed"), [
    ("store", MEMORY, "a StoreConfig"),  # a dict, not parsed
    ("socket_path", Path("run/kvtier/node.sock"), "an absolute path"),
    ("socket_path", str(SOCKET), "pathlib.Path"),
    ("socket_path", Path("/"), "an absolute path"),  # a directory
    ("socket_path", Path("/run/kvtier/node\0.sock"), "no NUL"),
    ("socket_path", Path("/" + "s" * 107), "at most 107 bytes"),  # sun_path's 108, with NUL
    ("name", 5, "1-64 letters"),
    ("max_layouts", 0, "a positive integer"),  # every engine refused
    ("max_layouts", -3, "a positive integer"),
    ("max_layouts", "4", "a positive integer"),
    ("max_layouts", True, "a positive integer"),
    ("max_layouts", 4.0, "a positive integer"),
    ("max_layouts", 10**6, "at most 1024"),
    ("keep_ram", "no", "True or False"),  # truthy: it kept the slabs
    ("keep_ram", 0, "True or False"),
    ("events_endpoint", 5557, "tcp://HOST:PORT"),
    ("stop_flush_s", "5", "seconds"),
    ("stop_flush_s", True, "seconds"),
    ("lease_timeout_s", 0, "above 0"),  # every lending taken back at once
    ("lease_timeout_s", -1.0, "above 0"),
    ("lease_timeout_s", float("inf"), "a finite number"),
    ("lease_timeout_s", "60", "seconds"),
    ("lease_timeout_s", True, "seconds"),
    ("lease_timeout_s", 1e300, "at most 31,536,000"),  # finite: every connection then reset
    ("stop_flush_s", 1e13, "at most 31,536,000"),
])
def test_a_node_setting_of_the_wrong_type_or_range_is_refused(
        field: str, value: object, allowed: str):
    settings: dict[str, Any] = {"store": StoreConfig.parse(MEMORY), "socket_path": SOCKET,
                                "name": "test-node", field: value}
    with pytest.raises(ConfigError) as raised:
        NodeConfig(**settings)
    assert (raised.value.field, raised.value.value) == (field, value)
    assert allowed in raised.value.allowed
    assert f"{field}={value!r}" in str(raised.value)


def test_a_node_setting_at_the_edge_of_its_range_is_kept():
    edge = Path("/" + "s" * 106)  # 107 bytes, Linux's longest Unix socket path
    config = NodeConfig(StoreConfig.parse(MEMORY), edge, name="n" * 64, max_layouts=1,
                        keep_ram=False, events_endpoint="ipc:///run/kvtier/events",
                        event_block_size=16, stop_flush_s=0)
    assert (config.socket_path, config.max_layouts, config.stop_flush_s) == (edge, 1, 0)
    assert NodeConfig(StoreConfig.parse(MEMORY), SOCKET, name="n", stop_flush_s=0.5)
    assert NodeConfig(StoreConfig.parse(MEMORY), SOCKET, name="n",
                      lease_timeout_s=0.25).lease_timeout_s == 0.25
    year = 365 * 86400
    assert NodeConfig(StoreConfig.parse(MEMORY), SOCKET, name="n", lease_timeout_s=year,
                      stop_flush_s=year).lease_timeout_s == year


@pytest.mark.parametrize(("extra", "field"), [
    ({"node": "relative/node.sock"}, "kv_connector_extra_config.node"),
    ({"node": 7}, "kv_connector_extra_config.node"),
    ({"node": "/run/kvtier/node.sock", "tiers": [{"kind": "memory", "capacity": "1GiB"}]},
     "kv_connector_extra_config.tiers"),
])
def test_an_engines_node_setting_is_checked(extra: dict[str, object], field: str):
    with pytest.raises(ConfigError) as raised:
        ConnectorConfig.parse(extra)
    assert raised.value.field == field
    assert field in str(raised.value)


def test_an_engines_node_setting_is_kept():
    config = ConnectorConfig.parse({"node": "/run/kvtier/node.sock"})
    assert config.node == "/run/kvtier/node.sock"
    assert config.tier_names() == ["node", "node-below"]  # its RAM, and the tiers below


def _warns_of_its_cpu_group(new_session: bool) -> bool:
    started = subprocess.run(
        [sys.executable, "-c", "import logging; logging.basicConfig(); "
         "from kvtier.node.cli import note_cpu_group; note_cpu_group()"],
        capture_output=True, text=True, timeout=60, start_new_session=new_session)
    assert started.returncode == 0, started.stderr
    return "start it with setsid or as a service" in started.stderr


def test_a_node_sharing_its_starters_session_under_autogroup_says_so() -> None:
    autogroup = AUTOGROUP.exists() and AUTOGROUP.read_text().strip() == "1"
    assert _warns_of_its_cpu_group(new_session=False) is autogroup  # this machine's setting
    assert not _warns_of_its_cpu_group(new_session=True)  # its session's leader


def test_a_node_of_the_longest_lease_timeout_serves_its_engines(tmp_path: Path,
                                                                socket_path: Path,
                                                                node_name: str) -> None:
    """A year, the bound, is a send timeout each connection takes (a finite 1e300 passed the
    check before, and every connection was reset as it opened)."""
    from nodekit import connect, node_tiers, put_chunks

    from kvtier.node.server import running_node

    config = NodeConfig(StoreConfig.parse(node_tiers(tmp_path, ram_chunks=4)), socket_path,
                        name=node_name, lease_timeout_s=365 * 86400, stop_flush_s=365 * 86400)
    with running_node(config) as node:
        client, store = connect(socket_path)
        assert put_chunks(store, [0]) == [True]
        assert node.status()["counters"]["committed_chunks"] == 1
        client.close()
