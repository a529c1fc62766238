"""A bench sized beyond the machine's memory is refused before it allocates, in one line
naming the option, its value, the bytes it needs and the bytes available
(kvtier.tools.bench.headroom). Before, `kvtier bench copy --blocks 100000000` ended in
torch's allocation error, `bench storage --sizes 100000` in numpy's MemoryError, a size
just over the RAM free in the OOM killer. The memory available is lowered here to inject
the fault; the command lines with sizes no machine has: tests/tools/test_odd_arguments.py."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from kvtier.errors import NotEnoughMemory
from kvtier.tools.bench import headroom
from kvtier.tools.bench.copy import CopyBenchConfig
from kvtier.tools.bench.diskload import DiskLoadConfig
from kvtier.tools.bench.fleet_fs import FleetConfig
from kvtier.tools.bench.mover import MoverBenchConfig
from kvtier.tools.bench.node import NodeBenchConfig
from kvtier.tools.bench.storage import MIB, BenchConfig
from kvtier.tools.cli import bench_storage
from kvtier.tools.cli.main import main

GIB = 1 << 30


@pytest.fixture
def ram(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The host RAM the benches see as available (MemAvailable): set `ram[0]`."""
    available = [64 * MIB]
    monkeypatch.setattr(headroom, "available_host_bytes", lambda: available[0])
    return available


def _quick_configs(tmp_path: Path) -> dict[str, object]:
    """Each bench's config as its --quick resolves it."""
    return {"copy": CopyBenchConfig(device="cpu", blocks=32, trials=2),
            "storage": BenchConfig(directory=tmp_path, trials=3, trial_bytes=32 * MIB,
                                   min_chunks=2),
            "mover": MoverBenchConfig(chunks=8, trials=2),
            "node": NodeBenchConfig(chunks=16, trials=2),
            "disk-load": DiskLoadConfig(trials=5),
            "fleet": FleetConfig(chunks=(1_000, 10_000), seconds=3.0)}


@pytest.mark.parametrize("bench, option", [
    ("copy", "--blocks"), ("storage", "--sizes"), ("mover", "--chunks"), ("node", "--chunks"),
    ("disk-load", "--chunks"), ("fleet", "--chunks")])
def test_a_quick_run_fits_a_small_machine_and_is_refused_below_it(
        tmp_path: Path, ram: list[int], bench: str, option: str) -> None:
    config = _quick_configs(tmp_path)[bench]
    need = config.memory_need()  # type: ignore[attr-defined]
    assert 0 < need.host_bytes < 1 * GIB, need  # --quick stays a smoke test on a small VM
    ram[0] = need.host_bytes
    config.validate()  # type: ignore[attr-defined]  # exactly enough: runs
    ram[0] = need.host_bytes - 1
    with pytest.raises(NotEnoughMemory) as refused:
        config.validate()  # type: ignore[attr-defined]
    message = str(refused.value)
    assert option in message and "available (MemAvailable)" in message, message
    assert refused.value.needed_bytes == need.host_bytes


def test_storage_names_the_trial_bytes_when_they_size_the_round(tmp_path: Path,
                                                                ram: list[int]) -> None:
    ram[0] = 100 * GIB
    config = BenchConfig(directory=tmp_path, sizes_bytes=(2 * MIB,), trial_bytes=40 * GIB,
                         tiers=("memory", "redis"))
    with pytest.raises(NotEnoughMemory, match=r"--trial-bytes=42949672960: the run needs "
                                              r"200.0 GiB of host RAM \(20480 chunks of 2.0 "
                                              r"MiB, 5 copies\), 100.0 GiB is available"):
        config.validate()


def test_the_copy_bench_on_cuda_counts_the_kv_against_the_device(
        monkeypatch: pytest.MonkeyPatch) -> None:
    config = CopyBenchConfig(device="cpu", blocks=64)
    on_cpu = config.memory_need()
    monkeypatch.setattr(CopyBenchConfig, "resolved_device", lambda self: "cuda")
    on_cuda = config.memory_need()
    moved = 64 * config.block_size * config.bytes_per_token
    assert on_cuda.device_bytes == 3 * moved + config.block_size * config.bytes_per_token
    assert on_cpu.host_bytes == on_cuda.host_bytes + on_cuda.device_bytes
    monkeypatch.setattr(headroom, "available_cuda_bytes", lambda: on_cuda.device_bytes - 1)
    with pytest.raises(NotEnoughMemory, match=r"--blocks=64: the run needs .* of CUDA memory"
                                              r".*available \(torch.cuda.mem_get_info\)"):
        headroom.require_memory(on_cuda)


def test_the_cli_refuses_before_the_spinner_in_one_line(
        monkeypatch: pytest.MonkeyPatch, ram: list[int],
        capsys: pytest.CaptureFixture[str]) -> None:
    def started(*args: object, **kwargs: object) -> None:
        raise AssertionError("the bench started")

    monkeypatch.setattr("kvtier.tools.cli.bench_mover.run_and_report", started)
    ram[0] = 8 * MIB
    assert main(["bench", "mover", "--quick", "--chunks", "64"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("kvtier: invalid config --chunks=64: the run needs 660.0 MiB of "
                          "host RAM (64 chunks of 2.0 MiB"), err
    assert err.endswith("8.0 MiB is available (MemAvailable)") and "\n" not in err


def test_bench_trace_refuses_a_capacity_beyond_ram_before_it_makes_the_model(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, ram: list[int]) -> None:
    from kvtier.tools.bench import tracebench
    from kvtier.tools.cli.bench_trace import config_from

    def started(*args: object, **kwargs: object) -> None:
        raise AssertionError("the model was made")

    monkeypatch.setattr(tracebench, "make_preset_model", started)
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": i, "input_length": 1024,
                                         "hash_ids": [1, 2 + i]}) + "\n" for i in range(4)))
    args = argparse.Namespace(trace=trace, sample=1.0, seed=0, limit=None, capacity="1G",
                              block_tokens=32, max_blocks=32, trace_block_tokens=512,
                              policy=["lru", "arc"], no_plain=False, model_root=tmp_path)
    ram[0] = 1 * GIB
    with pytest.raises(NotEnoughMemory, match=r"--capacity=1000000000: the run needs .* "
                                              r"\(2 memory tier\(s\) of 1953125 chunks"):
        tracebench.run_trace_bench(config_from(args, tmp_path))


def test_storage_config_from_the_command_line_checks_the_same(tmp_path: Path,
                                                             ram: list[int]) -> None:
    parsed = argparse.Namespace(quick=True, trials=None, trial_bytes=None, lmcache_python=None,
                                dir=tmp_path, sizes="4096", tier=["memory"], threads=1)
    with pytest.raises(NotEnoughMemory, match=r"--sizes='4096 MiB'"):
        bench_storage.config_from(parsed).validate()
