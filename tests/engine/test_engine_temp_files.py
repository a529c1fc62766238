"""An engine the harness started leaves nothing in the temp dir, even when its processes are
killed: vLLM's rendezvous file (`vllm_dist_<uuid>`, kvtier.testing.vllmtmp) stayed in /tmp for
every engine whose worker died rather than shut down, ~40 a suite run with the servers. The
test's own temp dir stands for /tmp: whatever the engine left is there to see."""

from __future__ import annotations

import tempfile
from pathlib import Path

import psutil
import pytest
from vllm_harness import start_engine

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def test_an_engine_whose_worker_was_killed_leaves_no_rendezvous_file(
        tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    temp = tmp_path / "tmp"
    temp.mkdir()
    monkeypatch.setenv("TMPDIR", str(temp))
    monkeypatch.setattr(tempfile, "tempdir", None)
    with start_engine(tiny_model_dir, processes=True):
        workers = [p for p in psutil.Process().children(recursive=True)
                   if p.name() == "VLLM::Worker"]
        assert workers, "vLLM's worker process, where its model runs"
        for worker in workers:
            worker.kill()  # as a crash would: torch's FileStore never removes its file
        psutil.wait_procs(workers, timeout=30)
    assert [p.name for p in temp.rglob("vllm_dist_*")] == []


def test_an_in_process_engine_leaves_vllms_lock_folder_where_it_was(tiny_model_dir: Path) -> None:
    """The harness names the engine's own temp dir while it builds the engine: a module of
    vLLM that reads the temp dir once, at its import during the build (its download locks),
    would keep a folder removed with the engine (and the next engine's downloads fail)."""
    from kvtier.testing.vllmtmp import PREFIX

    with start_engine(tiny_model_dir):
        pass
    from vllm.model_executor.model_loader import weight_utils

    assert PREFIX not in weight_utils.temp_dir and Path(weight_utils.temp_dir).is_dir()
