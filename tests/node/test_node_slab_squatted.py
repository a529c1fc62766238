"""Names in /dev/shm another user took first. /dev/shm is writable by every user of the host,
and a node's files there have predictable names (its slabs', kvtier-<name>-<layout digest>,
the one a warm restart moves its predecessor's to, <slab>.old, and its name's lock,
kvtier-<name>.lock). Before:
- a directory at a slab's name was moved aside by a node running as root, and stayed at
  <slab>.old, where every later start of the node failed to move its own slab (EISDIR): the
  layout was refused, its engines recomputed, until an operator removed it; a directory
  planted at <slab>.old did so from the first restart;
- a lock file another user planted, and held the flock of, had the node refuse to start as
  "a kvtier node named ... is running".
Now a slab's name held by anything but the node's own file is left alone and the slab made at a
fresh name (logged, naming the holder; removed when the node stops: no successor looks for
it); a predecessor's slab is moved aside to a fresh name where <slab>.old is taken; and a
foreign lock file is removed where the node may, else the start is refused naming it and its
owner. Real nodes in this process, restarted, and files handed to another user (root only).
"""

from __future__ import annotations

import fcntl
import os
import shutil
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path

import pytest
from nodekit import LAYOUT, connect, expected, key, lend, node_tiers, put_chunks, wait_for

from kvtier.node.config import NodeConfig
from kvtier.node.layouts import slab_name
from kvtier.node.server import NodeServer
from kvtier.tiers.shmslab import SHM_DIR, is_own_file
from kvtier.tiers.storeconfig import StoreConfig

STRANGER = 12345
pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif(os.geteuid() != 0, reason="handing a file to another user "
                                                           "takes root")]
Start = Callable[..., AbstractContextManager[NodeServer]]


@pytest.fixture
def slab(node_name: str) -> Iterator[Path]:
    """The path of the test layout's slab; whatever the test planted removed at the end."""
    path = SHM_DIR / slab_name(node_name, LAYOUT.digest())
    yield path
    for planted in [*SHM_DIR.glob(f"{path.name}*"), SHM_DIR / f"kvtier-{node_name}.lock"]:
        if planted.is_dir() and not planted.is_symlink():
            shutil.rmtree(planted)
        else:
            planted.unlink(missing_ok=True)


def plant(path: Path, kind: str) -> None:
    """A `kind` at `path`, another user's."""
    if kind == "file":
        path.write_bytes(b"\x66" * 4096)
    elif kind == "directory":
        path.mkdir()
        (path / "inside").write_bytes(b"x")
    else:
        path.symlink_to("/etc/hostname")
    os.lchown(path, STRANGER, STRANGER)


def serves(node: NodeServer, ids: list[int]) -> None:
    """An engine stores chunks `ids` and is lent them back; the slab it maps is the node's."""
    client, engine = connect(node.config.socket_path)
    assert put_chunks(engine, ids) == [True] * len(ids)
    assert lend(engine, [key(i) for i in ids]).chunks == expected(ids)
    welcome = client.welcomed()
    assert welcome is not None and is_own_file(Path(welcome.shm_path))
    assert node.status()["counters"]["refused"] == 0
    client.close()


@pytest.mark.parametrize("kind", ["file", "directory", "link"])
def test_a_slab_name_another_user_holds_costs_no_layout(
        tmp_path: Path, in_process_node: Start, slab: Path, kind: str) -> None:
    plant(slab, kind)
    for restart in range(3):
        with in_process_node(node_tiers(tmp_path, ram_chunks=8)) as node:
            serves(node, [restart])
        assert os.lstat(slab).st_uid == STRANGER, "the planted entry is the operator's to remove"
        fresh = [p for p in SHM_DIR.glob(f"{slab.name}.*") if is_own_file(p)]
        assert fresh == [], "a slab at a fresh name is removed when the node stops"


@pytest.mark.parametrize("kind", ["file", "directory"])
def test_a_name_another_user_holds_at_the_aside_name_keeps_the_warm_restart(
        tmp_path: Path, in_process_node: Start, slab: Path, kind: str) -> None:
    plant(slab.with_name(f"{slab.name}.old"), kind)
    config = node_tiers(tmp_path, ram_chunks=8)
    with in_process_node(config) as node:
        serves(node, [0, 1, 2])
    with in_process_node(config) as restarted:
        # The first Hello builds the layout; its predecessor's chunks are recovered behind.
        client, engine = connect(restarted.config.socket_path)
        assert put_chunks(engine, [3]) == [True]
        wait_for(lambda: restarted.status()["counters"]["recovered_chunks"] == 3, 30,
                 "the last node's chunks recovered")
        assert lend(engine, [key(i) for i in range(4)]).chunks == expected(range(4))
        client.close()


def test_a_lock_file_another_user_holds_does_not_stop_the_node(
        tmp_path: Path, in_process_node: Start, node_name: str, slab: Path) -> None:
    lock = SHM_DIR / f"kvtier-{node_name}.lock"
    plant(lock, "file")
    squatter = os.open(lock, os.O_RDONLY)
    try:
        fcntl.flock(squatter, fcntl.LOCK_EX | fcntl.LOCK_NB)  # as the other user would
        with in_process_node(node_tiers(tmp_path, ram_chunks=8)) as node:
            serves(node, [0])
    finally:
        os.close(squatter)


def test_a_lock_name_the_node_cannot_clear_is_refused_naming_its_owner(
        tmp_path: Path, socket_path: Path, node_name: str, slab: Path) -> None:
    lock = SHM_DIR / f"kvtier-{node_name}.lock"
    plant(lock, "directory")  # not empty: rmdir fails, and the node removes no tree
    config = NodeConfig(StoreConfig.parse(node_tiers(tmp_path, ram_chunks=8)), socket_path,
                        name=node_name)
    with pytest.raises(OSError, match=f"{lock}.*a directory of uid {STRANGER}"):
        NodeServer(config)
