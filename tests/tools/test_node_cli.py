"""`kvtier node status` (the tools' table over the node's status) and `kvtier node serve`'s
refusals, on a real node serving in this process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tierkit import key, tiny_layout

from kvtier.core.retention import DEFAULT_META
from kvtier.node.cli import main as node_main
from kvtier.node.client import NodeClient
from kvtier.node.config import NodeConfig
from kvtier.node.nodestore import NodeStore
from kvtier.node.server import running_node
from kvtier.tiers.manifest import NamespaceInfo
from kvtier.tiers.storeconfig import StoreConfig
from kvtier.tools.cli.main import main

LAYOUT = tiny_layout()


def test_status_shows_the_layouts_tiers_and_engines(tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    socket_path = tmp_path / "n.sock"
    config = NodeConfig(StoreConfig.parse({"tiers": [{"kind": "memory", "capacity": "1MiB"}]}),
                        socket_path, name=f"cli-{tmp_path.name}"[:40], keep_ram=False)
    with running_node(config):
        store = NodeStore(NodeClient(str(socket_path), LAYOUT, NamespaceInfo("m", "", 0)),
                          LAYOUT.bytes_per_chunk)
        store.plan_puts([key(1)], [DEFAULT_META])
        assert store.put(key(1), memoryview(bytes(LAYOUT.bytes_per_chunk)))
        with store.lend_as_landed([key(1), key(2)], [memoryview(bytearray(16))]) as lending:
            assert len(list(lending)) == 1  # a Borrow: chunk 1 from RAM, then a miss
            assert main(["node", "status", "--socket", str(socket_path)]) == 0
            out = " ".join(capsys.readouterr().out.split())  # wrapped at 80 columns
            assert "held: " in out and " 1 chunk (1 lease)" in out  # the loan, held
        assert main(["node", "status", "--socket", str(socket_path)]) == 0
        table = capsys.readouterr().out
        assert LAYOUT.digest()[:8] in table and "memory" in table and "engines:" in table
        assert "borrows: ram 1 (mean " in table and "below 0" in table
        assert main(["node", "status", "--socket", str(socket_path), "--json"]) == 0
        status = json.loads(capsys.readouterr().out)
        assert status["layouts"][LAYOUT.digest()]["tiers"][0]["chunks"] == 1
        store.close()
    assert main(["node", "status", "--socket", str(socket_path)]) == 1


def test_serve_refuses_a_config_whose_first_tier_is_not_memory(tmp_path: Path) -> None:
    config = tmp_path / "node.yaml"
    config.write_text("tiers:\n- {kind: disk, path: " + str(tmp_path / "d") + ", capacity: 1MiB}\n")
    assert main(["node", "serve", "--config", str(config), "--socket",
                 str(tmp_path / "n.sock")]) == 2
    assert not (tmp_path / "n.sock").exists()


def test_status_prints_what_engines_call_themselves_verbatim(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """An engine names itself in its Hello (any string), an operator its socket: the table
    read both as rich markup, mangling them (`[b]` bold, `[/]` its end), or ending `kvtier
    node status` with a MarkupError (a `[/]` with nothing to close)."""
    # Wide: at 80 columns a long temp path (an xdist worker's) wrapped inside "n[b].sock".
    monkeypatch.setenv("COLUMNS", "400")
    socket_path = tmp_path / "n[b].sock"
    config = NodeConfig(StoreConfig.parse({"tiers": [{"kind": "memory", "capacity": "1MiB"}]}),
                        socket_path, name=f"cli-{tmp_path.name}"[:40], keep_ram=False)
    with running_node(config):
        client = NodeClient(str(socket_path), LAYOUT, NamespaceInfo("m", "", 0),
                            engine="gpu[/]0 [bold]x")
        store = NodeStore(client, LAYOUT.bytes_per_chunk)
        assert not store.contains(key(1))  # connected: the node knows the engine
        assert main(["node", "status", "--socket", str(socket_path)]) == 0
        out = " ".join(capsys.readouterr().out.split())  # the console wraps at 80 columns
        assert "engines: gpu[/]0 [bold]x" in out and "n[b].sock" in out
        store.close()


def test_status_names_the_engines_whose_connection_the_node_closed(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A frozen engine's connection ended for a reply it never read keeps its slots until it
    closes its end or its process ends (tests/node/test_node_send_stalled.py checks the
    node's `quarantined`): the table names it and its pid, the one to kill to get them back
    (a pid the node cannot see: another pid namespace). Before, the table showed such an
    engine only in `held`, not among the engines, with nothing to say why; and counts of one
    read "1 connections"."""
    socket_path = tmp_path / "n.sock"
    config = NodeConfig(StoreConfig.parse({"tiers": [{"kind": "memory", "capacity": "1MiB"}]}),
                        socket_path, name=f"cli-{tmp_path.name}"[:40], keep_ram=False)
    with running_node(config) as node:
        status = node.status()
    assert status["quarantined"] == {}
    # As a node reports two such engines (the fault: their replies never read).
    status["quarantined"] = {"host:4242": 4242, "pod:7": 0}
    monkeypatch.setattr("kvtier.tools.cli.node.node_status", lambda _socket: status)
    assert main(["node", "status", "--socket", str(socket_path)]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert ("ended, kept until the engine closes its end or exits: host:4242 (pid 4242), "
            "pod:7 (pid not visible)") in out
    assert "0 connections, 0 leases" in out
    status.update(connections=1, leases=1, held={"host:4242": {"chunks": 1, "leases": 1}})
    assert main(["node", "status", "--socket", str(socket_path)]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "1 connection, 1 lease;" in out and "held: host:4242 1 chunk (1 lease)" in out


@pytest.mark.parametrize("argv", [["node", "status", "--socket", ""],
                                  ["node", "status", "--socket", " "],
                                  ["node", "serve", "--config", "node.yaml", "--socket", ""]])
def test_an_empty_socket_is_a_usage_error_not_a_node_down(
        argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    """`--socket "$NODE_SOCKET"` with the variable unset: exit 2 naming the option (status
    said "no node answers", exit 1: a node down to a probe)."""
    with pytest.raises(SystemExit) as stop:
        main(argv)
    assert stop.value.code == 2
    assert "--socket" in capsys.readouterr().err


def test_the_nodes_own_entry_point_refuses_an_empty_socket_too(
        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stop:
        node_main(["status", "--socket", ""])
    assert stop.value.code == 2
    assert "--socket" in capsys.readouterr().err
