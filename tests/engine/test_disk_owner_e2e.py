"""A second engine on a disk path whose directory a running engine's disk tier owns (two
servers on one host with the same model and path; vLLM's data-parallel ranks, which share one
config) is refused at start-up, in one line naming the directory, the owner's pid and the
remedy (tiers/files/owner.py). Before, it started: each engine exceeded the capacity by the
other's files and evicted the other's chunks behind its index.

The owner runs in this process; the refused engine in vLLM's own processes (its worker raises
as it opens its store, which vLLM's front end reports as a failed start): the suite's check
that a refusal raised in the engine core process reaches the user as its one line
(`refusal_line` checks kvtier's refusals of a model in the test's process).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from vllm_harness import kvtier_transfer_config, start_engine

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def test_a_second_engine_on_an_owned_disk_path_is_refused_in_one_line(
        tiny_model_dir: Path, tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "disk"
    config = kvtier_transfer_config([{"kind": "disk", "path": str(root),
                                      "capacity": "64MiB"}], 64)
    with start_engine(tiny_model_dir, config, processes=False):
        capfd.readouterr()
        with (pytest.raises(RuntimeError, match="Engine core initialization failed"),
              start_engine(tiny_model_dir, config, processes=True)):
            pass
        captured = capfd.readouterr()
    output = captured.out + captured.err
    [line] = {line.split("DirectoryInUse: ", 1)[1] for line in output.splitlines()
              if "DirectoryInUse: " in line}
    assert str(root) in line
    assert f"another kvtier process (pid {os.getpid()})" in line
    assert "a disk path of its own" in line and "kind: shared" in line
