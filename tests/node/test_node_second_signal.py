"""A second SIGTERM or SIGINT while `kvtier node serve` stops (an operator's second Ctrl-C, a
supervisor that signals again) does not cut the stop short: the writes queued behind RAM are
still flushed, within `--stop-flush-s`, and the node then exits as after one. Before, each
signal started a shutdown of its own: the second found nothing left to close (the first had
taken the layouts) and ended at once, the process exited with it, and the writes the first
was flushing were lost, its log saying "stopped" as after a clean stop. Its disk tier's writes
wait for a file (`GO`) the test makes once the second signal is seen: a real process, a real
disk.
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
from nodekit import NodeProcess, connect, node_tiers, put_chunks, wait_for, write_config

pytestmark = pytest.mark.timeout(120)

# `python3 -m kvtier.node` whose disk tier's writes wait for `GO` (a slow disk: each write
# behind RAM lands once it exists); a write that started marks `WRITING`.
SLOW_NODE = """
import os, sys, threading
from pathlib import Path
from kvtier.tiers.files.disk import DiskTier

real_put = DiskTier.put

def slow_put(self, *args, **kwargs):
    Path(os.environ["WRITING"]).touch()
    go = Path(os.environ["GO"])
    for _ in range(6000):
        if go.exists():
            break
        threading.Event().wait(0.01)
    return real_put(self, *args, **kwargs)

DiskTier.put = slow_put
from kvtier.node.cli import main
sys.exit(main())
"""


@pytest.mark.parametrize("second", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_second_signal_while_stopping_still_flushes_the_writes_behind_ram(
        tmp_path: Path, socket_path: Path, node_name: str, monkeypatch: pytest.MonkeyPatch,
        second: signal.Signals) -> None:
    writing, go = tmp_path / "WRITING", tmp_path / "GO"
    monkeypatch.setenv("WRITING", str(writing))
    monkeypatch.setenv("GO", str(go))
    config = write_config(tmp_path / "node.json",
                          node_tiers(tmp_path, ram_chunks=8, disk_chunks=16))
    node = NodeProcess(config, socket_path, node_name, tmp_path / "node.log",
                       entry=("-c", SLOW_NODE))
    try:
        node.start()
        client, engine = connect(socket_path)
        assert put_chunks(engine, range(4)) == [True] * 4  # in RAM; behind it, queued
        wait_for(writing.exists, 10, "a write behind RAM in the disk tier")
        client.close()
        assert node.process is not None
        node.process.send_signal(signal.SIGTERM)
        log = node.log_path
        wait_for(lambda: "SIGTERM: stopping" in log.read_text(), 10, "the stop begun")
        node.process.send_signal(second)
        # Seen by the node (it says so), or it exited: then the flush was cut short.
        wait_for(lambda: "already stopping" in log.read_text()
                 or node.process.poll() is not None, 30, "the second signal handled")
        go.touch()  # the writes land from now on
        assert node.process.wait(timeout=60) == 0
    finally:
        go.touch()
        node.kill()
    files = list((tmp_path / "disk").rglob("*.kvc"))
    assert len(files) == 4, (files, log.read_text())
    assert "dropped" not in log.read_text()
