"""The node's socket file is never open to others, not even between its bind and the chmod
that gives it to the node's group. The file took the process's mode bits at the bind: under
umask 0 (some container images' default) it was 0777 until the chmod, and any user of the
host could connect in between and keep that connection (store chunks, borrow them). The
chmod is observed as it is called (a wrapper of the real os.chmod); the node is real, in this
process, under umask 0.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
from nodekit import connect, node_tiers, put_chunks

from kvtier.node import server
from kvtier.node.config import NodeConfig
from kvtier.node.server import running_node
from kvtier.tiers.storeconfig import StoreConfig

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def no_umask() -> Iterator[None]:
    before = os.umask(0)
    try:
        yield
    finally:
        os.umask(before)


def test_the_socket_is_never_open_to_others_under_umask_0(
        tmp_path: Path, socket_path: Path, node_name: str, no_umask: None,
        monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[int] = []
    real_chmod = os.chmod

    def chmod(path: os.PathLike[str] | str, mode: int) -> None:
        if Path(path) == socket_path:  # the mode it had from its bind until now
            seen.append(stat.S_IMODE(os.stat(path).st_mode))
        real_chmod(path, mode)

    monkeypatch.setattr(server.os, "chmod", chmod)
    config = NodeConfig(StoreConfig.parse(node_tiers(tmp_path, ram_chunks=4)), socket_path,
                        name=node_name)
    with running_node(config) as node:
        assert seen and not seen[0] & 0o077, f"bound {oct(seen[0])}, before its chmod"
        assert stat.S_IMODE(os.stat(node.config.socket_path).st_mode) == 0o660
        _client, engine = connect(node.config.socket_path)
        assert put_chunks(engine, [0]) == [True]
