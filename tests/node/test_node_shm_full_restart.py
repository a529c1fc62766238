"""A node restarted on a /dev/shm with room for one slab (the shipped Kubernetes sizing: a RAM
tier of 460.78 GiB on a 512 GiB /dev/shm), an engine connected and reading in place: the
restarted node drops its predecessor's slab to make room, and the engine, once the new node
answers, lets its mapping and its readers' files of the old slab go, so that the new slab is
created and the engine (and any other) is welcomed, without restarting it; an idle engine
(no request after the restart) too, at the node's hang-up of its connections. Before, the old
slab's pages stayed allocated for as long as the engine lived: the new slab's creation failed
(ENOSPC), and every engine was refused.

The case runs in a mount namespace of its own (`unshare --mount`) whose /dev/shm is a tmpfs
of 1.2 MiB (tests/node/shmfullrestart.py): no other process sees it. Skipped where no such
namespace can be made (not root, no unshare)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from nodekit import SLOT_BYTES

from kvtier.tiers.shmslab import slab_file_bytes

pytestmark = pytest.mark.timeout(180)
SHM_BYTES = 1200 << 10  # the tmpfs: one slab of RAM_CHUNKS slots fits, two do not
RAM_CHUNKS = 200
HELPER = Path(__file__).with_name("shmfullrestart.py")


def _in_own_mount_namespace(*command: str, timeout_s: float
                            ) -> subprocess.CompletedProcess[str]:
    """`command` run with a tmpfs of SHM_BYTES on /dev/shm, in a mount namespace of its own
    (its mounts private: the host's /dev/shm is untouched)."""
    script = f'mount -t tmpfs -o size={SHM_BYTES} kvtier-test /dev/shm && exec "$@"'
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    return subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c",
                           script, "sh", *command], capture_output=True, text=True,
                          timeout=timeout_s, env=env, check=False)


@pytest.fixture(scope="module")
def mount_namespace() -> None:
    if shutil.which("unshare") is None:
        pytest.skip("no unshare(1)")
    probe = _in_own_mount_namespace("true", timeout_s=30)
    if probe.returncode != 0:
        pytest.skip(f"no mount namespace with a tmpfs here: {probe.stderr.strip()}")


def test_a_restarted_node_on_a_one_slab_dev_shm_welcomes_the_engine_that_read_its_old_slab(
        mount_namespace: None) -> None:
    slab_bytes = slab_file_bytes(SLOT_BYTES, RAM_CHUNKS)
    assert slab_bytes < SHM_BYTES < 2 * slab_bytes  # room for one slab, not two
    run = _in_own_mount_namespace(sys.executable, str(HELPER), str(RAM_CHUNKS), timeout_s=150)
    assert run.returncode == 0, run.stdout + run.stderr
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["shm_bytes"] == SHM_BYTES
    assert result["stored_after_restart"], result
    assert result["other_engine_stored"], result


def test_an_idle_engine_of_the_old_node_keeps_no_engine_refused(mount_namespace: None) -> None:
    """The engine that read the old slab asks nothing after the restart: it lets the slab go at
    the node's hang-up, and a fresh engine is welcomed (within DEADLINE_S: ~0.2 s after the
    restart here). Before, the fresh engine was refused until the idle one's next request."""
    run = _in_own_mount_namespace(sys.executable, str(HELPER), str(RAM_CHUNKS), "idle",
                                  timeout_s=150)
    assert run.returncode == 0, run.stdout + run.stderr
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["stored_after_restart"], result  # the fresh engine's
    assert result["other_engine_stored"], result  # then the idle one's
