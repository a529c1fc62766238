"""`kvtier serve` refuses a disk directory that a running engine of the same model owns before
it starts vLLM: vLLM opens the tiers only once its model is loaded, so the second server's
refusal (`DirectoryInUse`, tiers/files/owner.py) came a whole start-up later.

The owner is a real process holding a disk tier open on tmp_path (its lock, its manifest);
`kvtier serve` runs through its CLI entry point, its vLLM start replaced by a failure (the
fault: no vLLM is started here whatever happens). An owner killed with SIGKILL leaves its
directory to the next server: the kernel releases its flock.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from tierkit import tiny_layout

from kvtier.errors import DirectoryInUse, ServerError
from kvtier.tiers import open_store, refuse_owned
from kvtier.tiers.storeconfig import StoreConfig
from kvtier.tools.cli.main import main
from kvtier.tools.cli.serve import refuse_owned_disks
from kvtier.tools.ops.server import VllmServer
from kvtier.tools.ops.serving import ServeConfig, build_command

REPO = Path(__file__).resolve().parents[2]
MODEL = "org/some-model"
# A disk tier of `MODEL` opened and held until stdin closes (an engine's worker, in short).
OWNER = """
import sys
from kvtier.tiers import open_store
from kvtier.tiers.manifest import NamespaceInfo
from kvtier.tiers.storeconfig import StoreConfig
from tierkit import tiny_layout

store = open_store(StoreConfig.parse({"tiers": [
    {"kind": "disk", "path": sys.argv[1], "capacity": "1MiB"}]}), tiny_layout(),
    NamespaceInfo(sys.argv[2], "", 0))
print("ready", flush=True)
sys.stdin.read()
store.close()
"""


@pytest.fixture
def owner(tmp_path: Path) -> Iterator[subprocess.Popen[str]]:
    """A process of its own owning the disk directory of MODEL under tmp_path/disk."""
    env = {**os.environ,
           "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO / "tests")])}
    proc = subprocess.Popen([sys.executable, "-c", OWNER, str(tmp_path / "disk"), MODEL],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
        yield proc
    finally:
        proc.kill()
        proc.wait()


def store_config(tmp_path: Path) -> dict[str, object]:
    return {"tiers": [{"kind": "memory", "capacity": "1MiB"},
                      {"kind": "disk", "path": str(tmp_path / "disk"), "capacity": "1MiB"}]}


def test_serve_refuses_a_directory_its_model_s_engine_owns_before_starting_vllm(
        tmp_path: Path, owner: subprocess.Popen[str], monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    def vllm_started(self: VllmServer) -> None:  # the fault: nothing is started here
        raise ServerError("vLLM was started")

    monkeypatch.setattr(VllmServer, "start", vllm_started)
    config = tmp_path / "store.json"
    config.write_text(json.dumps(store_config(tmp_path)))

    assert main(["serve", MODEL, "--config", str(config)]) == 1
    refusal = capsys.readouterr().err.strip()
    assert "vLLM was started" not in refusal
    assert refusal.startswith("kvtier: disk tier 'disk': ") and "\n" not in refusal
    assert f"{tmp_path / 'disk'}/" in refusal  # its layout directory
    assert f"another kvtier process (pid {owner.pid})" in refusal
    assert "give each engine a disk path of its own" in refusal

    # Served under another name (--served-model-name), MODEL's engine is still this one.
    assert main(["serve", "./elsewhere", "--config", str(config), "--",
                 f"--served-model-name={MODEL}"]) == 1
    assert f"pid {owner.pid}" in capsys.readouterr().err


def test_another_model_s_directory_on_the_same_path_is_not_refused(
        tmp_path: Path, owner: subprocess.Popen[str]) -> None:
    store = StoreConfig.parse(store_config(tmp_path))
    refuse_owned(store, {"org/another-model"})  # its engine opens a directory of its own
    with pytest.raises(DirectoryInUse):
        refuse_owned(store, {MODEL})


def test_a_directory_whose_owner_died_is_served_and_the_check_holds_no_lock(
        tmp_path: Path, owner: subprocess.Popen[str]) -> None:
    command = build_command(ServeConfig(MODEL, extra_config=store_config(tmp_path), cpu=True))
    cfg = ServeConfig(MODEL)
    with pytest.raises(DirectoryInUse):
        refuse_owned_disks(cfg, command)
    owner.send_signal(signal.SIGKILL)  # no close: the kernel lets the lock go
    owner.wait()
    refuse_owned_disks(cfg, command)
    refuse_owned_disks(cfg, command)  # a check takes no lock it keeps

    # The next engine's tier opens the directory (the check left it free).
    store = open_store(StoreConfig.parse(store_config(tmp_path)), tiny_layout())
    try:
        with pytest.raises(DirectoryInUse):  # and the check sees the new owner, this process
            refuse_owned_disks(cfg, command)
    finally:
        store.close()
