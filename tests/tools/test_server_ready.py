"""`VllmServer.wait_ready` counts a server ready only when the port that answers is its own.

Two test processes once picked the same port for servers started at once: the later one's
health checks were answered by the other, and `kvtier demo --node` reported its engine A
ready, sent it nothing it could serve and "crashed" no process of it. Plain processes stand in
for vLLM here (a static HTTP server has /health when its folder holds a file of that name).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from kvtier.errors import ServerError
from kvtier.tools.ops.server import VllmServer, free_port, running_server
from kvtier.tools.ops.serving import ServeCommand


def health_server(folder: Path, port: int) -> ServeCommand:
    """A process answering GET /health with 200 on `port`."""
    folder.mkdir(exist_ok=True)
    (folder / "health").write_text("ok")
    argv = (sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1",
            "--directory", str(folder))
    return ServeCommand(argv, {}, f"http://127.0.0.1:{port}", None)


def test_a_server_answering_on_its_own_port_is_ready(tmp_path: Path) -> None:
    with running_server(health_server(tmp_path / "www", free_port()),
                        startup_timeout_s=30) as server:
        assert server.proc is not None and server.proc.poll() is None


def test_another_process_answering_on_the_port_is_not_this_server_ready(tmp_path: Path) -> None:
    port = free_port()
    with running_server(health_server(tmp_path / "www", port), startup_timeout_s=30):
        # Starting up for a few seconds, then failing as a server that cannot bind exits.
        late = ServeCommand((sys.executable, "-c", "import time; time.sleep(2); exit(1)"), {},
                            f"http://127.0.0.1:{port}", None)
        server = VllmServer(late, tmp_path / "late.log")
        server.start()
        try:
            with pytest.raises(ServerError, match="exited with code 1 before it was ready"):
                server.wait_ready(30)
        finally:
            server.stop()
