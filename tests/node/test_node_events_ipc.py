"""The node's `--events-endpoint ipc://PATH`: a socket file, which libzmq replaces when it binds
and leaves behind when it closes. The node removes its own file when it stops (not a
successor's), binds over one left by a killed node, and refuses a PATH a running node still
publishes on (binding would take that node's routers).
"""

from __future__ import annotations

import errno
import socket
import stat
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from nodekit import NodeProcess, left_in_shm, node_tiers, write_config

from kvtier.node.eventpub import EventPublisher, ipc_path


def identity(path: Path) -> tuple[int, int]:
    found = path.stat()
    return found.st_dev, found.st_ino


def test_a_stopped_node_removes_its_ipc_socket_file(
        tmp_path: Path, socket_path: Path, start_node: Callable[..., NodeProcess]):
    events = socket_path.parent / "events.sock"
    node = start_node(node_tiers(tmp_path, ram_chunks=4),
                      args=("--events-endpoint", f"ipc://{events}"))
    assert events.is_socket()
    assert node.stop() == 0  # SIGTERM
    assert not events.exists()  # before: left behind, a socket no one listens on
    assert not socket_path.exists()


@pytest.mark.parametrize("umask", [0o000, 0o022])
def test_the_ipc_socket_file_is_the_nodes_groups_whatever_the_umask(
        tmp_path: Path, socket_path: Path, start_node: Callable[..., NodeProcess], umask: int):
    """As the node's socket: 0660. Before: 0777 less the umask, so every user could read the
    prompts' token ids (umask 000), or a router in the node's group could not connect (022)."""
    events = socket_path.parent / "events.sock"
    start_node(node_tiers(tmp_path, ram_chunks=4), umask=umask,
               args=("--events-endpoint", f"ipc://{events}"))
    assert stat.S_IMODE(events.stat().st_mode) == 0o660


def test_a_node_refuses_the_ipc_endpoint_a_running_node_publishes_on(
        tmp_path: Path, socket_path: Path, start_node: Callable[..., NodeProcess]):
    events = socket_path.parent / "events.sock"
    endpoint = f"ipc://{events}"
    start_node(node_tiers(tmp_path, ram_chunks=4), args=("--events-endpoint", endpoint))
    bound = identity(events)
    config = write_config(tmp_path / "second.json", node_tiers(tmp_path, ram_chunks=4))
    other = socket_path.parent / "other.sock"
    name = f"{tmp_path.name}-second"[:60]
    # A process, not cli.main: before, the second node started and served until killed.
    try:
        second = subprocess.run(
            [sys.executable, "-m", "kvtier.node", "serve", "--config", str(config), "--socket",
             str(other), "--name", name, "--drop-ram", "--events-endpoint", endpoint],
            capture_output=True, text=True, timeout=60)
    finally:
        for path in left_in_shm(name):
            path.unlink(missing_ok=True)
    assert second.returncode == 2
    assert f"cannot publish KV events on {endpoint}: another process" in second.stderr
    assert identity(events) == bound  # before: replaced by the second node's
    assert not other.exists()


def test_a_publisher_binds_over_a_file_a_killed_node_left_and_removes_it(socket_path: Path):
    events = socket_path.parent / "events.sock"
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(events))  # a killed node's: bound, never unlinked, no one listening
    stale.close()
    publisher = EventPublisher(f"ipc://{events}")
    publisher.close(linger_ms=0)
    assert not events.exists()


def test_a_publisher_leaves_a_successors_ipc_file(socket_path: Path):
    events = socket_path.parent / "events.sock"
    publisher = EventPublisher(f"ipc://{events}")
    events.unlink()
    successor = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        successor.bind(str(events))
        theirs = identity(events)
        publisher.close(linger_ms=0)
        assert identity(events) == theirs
    finally:
        successor.close()
        events.unlink()


def test_a_publisher_refused_a_live_path_says_so_with_eaddrinuse(socket_path: Path):
    events = socket_path.parent / "events.sock"
    live = EventPublisher(f"ipc://{events}")
    try:
        with pytest.raises(OSError) as refused:
            EventPublisher(f"ipc://{events}")
        assert refused.value.errno == errno.EADDRINUSE
    finally:
        live.close(linger_ms=0)
    assert not events.exists()


@pytest.mark.parametrize("what", ["a regular file", "a link to one"])
def test_a_publisher_never_replaces_a_file_that_is_not_a_socket(socket_path: Path, what: str):
    """libzmq unlinks whatever is at PATH as it binds: an ipc:// path naming a file by mistake
    (the node's config, a typo) deleted it, and the node served on (its stop then removed its
    own socket there: the file was gone for good). Refused, as the node's --socket is."""
    precious = socket_path.parent / "node.yaml"
    precious.write_text("tiers: []\n")
    events = precious if what == "a regular file" else socket_path.parent / "events.sock"
    if events != precious:
        events.symlink_to(precious)
    with pytest.raises(OSError) as refused:
        EventPublisher(f"ipc://{events}")
    assert refused.value.errno == errno.EEXIST and str(events) in str(refused.value)
    assert precious.read_text() == "tiers: []\n" and events.exists()


def test_serve_refuses_an_ipc_endpoint_at_a_file_and_leaves_it(tmp_path: Path, socket_path: Path):
    config = write_config(tmp_path / "node.json", node_tiers(tmp_path, ram_chunks=4))
    name = tmp_path.name[:60]
    try:
        served = subprocess.run(
            [sys.executable, "-m", "kvtier.node", "serve", "--config", str(config), "--socket",
             str(socket_path), "--name", name, "--events-endpoint", f"ipc://{config}"],
            capture_output=True, text=True, timeout=60)
    finally:
        for path in left_in_shm(name):
            path.unlink(missing_ok=True)
    assert served.returncode == 2, served.stderr
    assert f"cannot publish KV events on ipc://{config}" in served.stderr
    assert "not a socket" in served.stderr
    assert config.is_file() and not socket_path.exists()


@pytest.mark.parametrize(("endpoint", "path"), [
    ("ipc:///run/kvtier/events", "/run/kvtier/events"), ("ipc://@kvtier-events", None),
    ("tcp://127.0.0.1:5557", None)])
def test_ipc_path_is_the_socket_file_if_there_is_one(endpoint: str, path: str | None):
    assert ipc_path(endpoint) == path
