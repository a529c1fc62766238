"""The memory tier commits its slab's RAM in the background (tiers/prefault.py).

Stores into never-touched slab pages ran 9x slower than into reused ones on this project's
VM (first-touch page faults; issue 10's 0%-hit throughput), so the slab is faulted in ahead
of use, without changing a byte of what stores put there meanwhile.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
from tierkit import key, tiny_layout

from kvtier.core.layout import KVLayout
from kvtier.tiers import memory as memory_module
from kvtier.tiers import prefault
from kvtier.tiers.memory import MemoryTier, MemoryTierConfig

LAYOUT = KVLayout(num_layers=4, num_kv_heads=4, head_size=64, dtype="float16",
                  tokens_per_chunk=256)  # 1 MiB chunks
SLAB_MIB = 96


def rss_mib() -> float:
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024


def tier(prefault: bool) -> MemoryTier:
    config = MemoryTierConfig(kind="memory", capacity=f"{SLAB_MIB}MiB", pin="off",
                              prefault=prefault)
    return MemoryTier(config, LAYOUT)


def test_the_slab_is_committed_in_the_background() -> None:
    before = rss_mib()
    lazy = tier(prefault=False)
    assert lazy.prefaulting is None
    assert rss_mib() - before < SLAB_MIB / 4  # an untouched slab costs no RAM
    eager = tier(prefault=True)
    assert eager.prefaulting is not None
    eager.prefaulting.join(timeout=60)
    assert not eager.prefaulting.is_alive()
    assert rss_mib() - before > SLAB_MIB * 0.9
    lazy.close()
    eager.close()


def test_chunks_stored_while_it_commits_keep_their_bytes() -> None:
    memory = tier(prefault=True)
    chunks = {key(i): os.urandom(LAYOUT.bytes_per_chunk) for i in range(SLAB_MIB)}
    for k, data in chunks.items():
        assert memory.put(k, memoryview(data)).ok
    assert memory.prefaulting is not None
    memory.prefaulting.join(timeout=60)
    out = bytearray(LAYOUT.bytes_per_chunk)
    for k, data in chunks.items():
        assert memory.get_into(k, memoryview(out)).ok
        assert out == data
    memory.close()


def rss_shmem_mib() -> float:
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith("RssShmem:"))
    return int(line.split()[1]) / 1024


def test_a_shared_slab_is_mapped_in_the_background() -> None:
    """A node's slab (/dev/shm): its pages are allocated with the file, but each still faults
    on its first touch through this process's mapping until mapped."""
    before = rss_shmem_mib()
    config = MemoryTierConfig(kind="memory", capacity=f"{SLAB_MIB}MiB", pin="off",
                              shared_memory=f"kvtier-test-prefault-{os.getpid()}")
    memory = MemoryTier(config, LAYOUT)
    try:
        assert memory.prefaulting is not None
        memory.prefaulting.join(timeout=60)
        assert rss_shmem_mib() - before > SLAB_MIB * 0.9
    finally:
        memory.close()
    assert memory.shared_memory_path is not None and not memory.shared_memory_path.exists()


def test_closing_stops_it() -> None:
    memory = MemoryTier(MemoryTierConfig(kind="memory", capacity="4GiB", pin="off"),
                        tiny_layout(4))
    memory.close()
    assert memory.prefaulting is not None
    memory.prefaulting.join(timeout=5)
    assert not memory.prefaulting.is_alive()


def test_a_slab_larger_than_the_available_ram_is_not_committed_ahead(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A capacity the host can map but not hold (20 GiB with 17 available): the prefault
    would commit it whole at start-up, until the OOM killer ended a process. The host's
    MemAvailable is injected (a real slab that large would starve the machine's tenants)."""
    monkeypatch.setattr(memory_module, "available_bytes", lambda: (SLAB_MIB // 2) << 20,
                        raising=False)
    with caplog.at_level(logging.WARNING, logger="kvtier.tiers.memory"):
        big = tier(prefault=True)
    try:
        assert big.prefaulting is None
        assert f"capacity {SLAB_MIB}.0 MiB is more than the {SLAB_MIB // 2}.0 MiB" in caplog.text
        assert big.put(key(0), memoryview(os.urandom(LAYOUT.bytes_per_chunk))).ok
    finally:
        big.close()


def cgroup_v2(tmp_path: Path, max_bytes: int | str, current: int, inactive_file: int = 0
              ) -> tuple[Path, Path]:
    """A cgroup v2 tree (real files) whose pod cgroup has `max_bytes` and `current`, and the
    /proc/self/cgroup naming it."""
    root = tmp_path / "cgroup"
    pod = root / "kubepods" / "pod1"
    pod.mkdir(parents=True)
    (pod / "memory.max").write_text(f"{max_bytes}\n")
    (pod / "memory.current").write_text(f"{current}\n")
    (pod / "memory.stat").write_text(f"anon {current}\ninactive_file {inactive_file}\n")
    (root / "kubepods" / "memory.max").write_text("max\n")
    (root / "kubepods" / "memory.current").write_text(f"{current}\n")
    self_cgroup = tmp_path / "self-cgroup"
    self_cgroup.write_text("0::/kubepods/pod1\n")
    return root, self_cgroup


def test_a_slab_larger_than_its_containers_memory_limit_leaves_is_not_committed_ahead(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """In a container (a pod with a memory limit) /proc/meminfo shows the host's RAM: a slab
    that fit the host but not the pod was committed whole at start-up, and the pod
    OOM-killed. The cgroup's files are real files in a temp dir, pointed at."""
    root, self_cgroup = cgroup_v2(tmp_path, max_bytes=(SLAB_MIB // 2 + 8) << 20,
                                  current=16 << 20, inactive_file=8 << 20)
    monkeypatch.setattr(prefault, "CGROUP_ROOT", root)
    monkeypatch.setattr(prefault, "SELF_CGROUP", self_cgroup)
    assert prefault.cgroup_headroom_bytes() == (SLAB_MIB // 2) << 20
    with caplog.at_level(logging.WARNING, logger="kvtier.tiers.memory"):
        big = tier(prefault=True)
    try:
        assert big.prefaulting is None
        assert f"capacity {SLAB_MIB}.0 MiB is more than the {SLAB_MIB // 2}.0 MiB" in caplog.text
    finally:
        big.close()


def test_cgroup_headroom_unlimited_unreadable_and_v1(tmp_path: Path) -> None:
    root, self_cgroup = cgroup_v2(tmp_path, max_bytes="max", current=1 << 20)
    assert prefault.cgroup_headroom_bytes(root, self_cgroup) is None  # no limit anywhere
    assert prefault.cgroup_headroom_bytes(root, tmp_path / "absent") is None
    v1 = tmp_path / "v1"
    (v1 / "memory").mkdir(parents=True)
    (v1 / "memory" / "memory.limit_in_bytes").write_text(f"{64 << 20}\n")
    (v1 / "memory" / "memory.usage_in_bytes").write_text(f"{24 << 20}\n")
    (v1 / "memory" / "memory.stat").write_text(f"total_inactive_file {8 << 20}\n")
    v1_self = tmp_path / "v1-self"
    v1_self.write_text("4:memory:/not/under/the/mount\n3:cpuset:/\n")  # a container's view
    assert prefault.cgroup_headroom_bytes(v1, v1_self) == 48 << 20
