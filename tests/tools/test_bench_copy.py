"""`kvtier bench copy` end to end on tiny shapes, without vLLM: the connector's CPU mover
round-trips the bytes in every layout it is given, a sweep measures each chunk size over one
KV allocation (and a size whose loads write nothing is caught, not hidden by the size before
it), and the command writes its JSON and markdown. Not timed tests: figures are not checked.
"""

from __future__ import annotations

import dataclasses
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from rich.console import Console

from kvtier.errors import ConfigError
from kvtier.integrations.vllm.worker.paged import PagedKV
from kvtier.tools.bench.copy import (
    TARGET_RATIO,
    CopyBenchConfig,
    CopySweep,
    Figure,
    RunnerFigure,
    run_copy_bench,
    run_copy_sweep,
)
from kvtier.tools.cli.bench_copy import SWEEP_CHUNK_MIB, sizes_table
from kvtier.tools.cli.main import main

# 2 layers x 2 heads x 2 (K, V) x 64 x 2 bytes = 1 KiB a token: a block of 16 is 16 KiB.
TINY = {"device": "cpu", "layers": 2, "kv_heads": 2, "head_size": 64, "block_size": 16,
        "trials": 1}


def test_blocks_stored_and_loaded_through_the_mover_come_back_identical() -> None:
    config = CopyBenchConfig(**TINY, tokens_per_chunk=32, blocks=8)  # type: ignore[arg-type]
    result = run_copy_bench(config)
    assert result.verified and result.single_allocation and result.kv_layout == "cpu"
    assert {f.name for f in result.figures} >= {"store", "load", "raw out", "raw in"}
    assert result.runner is not None and result.runner.chunks == 4


def test_the_command_writes_json_and_refuses_a_partial_chunk(tmp_path: Path) -> None:
    out = tmp_path / "copy.json"
    assert main(["bench", "copy", "--device", "cpu", "--layers", "2", "--kv-heads", "2",
                 "--blocks", "16", "--trials", "1", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["verified"] is True
    with pytest.raises(ConfigError, match="blocks"):
        CopyBenchConfig(blocks=15).validate()


@pytest.mark.parametrize("sizes", [["--chunk-mib", "2,4"], ["--sweep"]])
def test_a_chunk_in_tokens_beside_chunk_sizes_is_refused(sizes: list[str]) -> None:
    """--chunk-mib and --sweep measure their own sizes: --tokens-per-chunk beside them was
    dropped without a word (its help says "instead of")."""
    from kvtier.tools.cli.bench_copy import config_from
    from kvtier.tools.cli.main import build_parser

    args = build_parser().parse_args(["bench", "copy", *sizes, "--tokens-per-chunk", "64"])
    with pytest.raises(ConfigError, match="--tokens-per-chunk"):
        config_from(args)
    alone = build_parser().parse_args(["bench", "copy", "--tokens-per-chunk", "64"])
    assert config_from(alone).tokens_per_chunk == 64


@pytest.mark.parametrize(("layout", "dtype"), [
    ("cpu", "bfloat16"), ("LBNHC", "bfloat16"), ("LBHNC", "bfloat16"), ("BLHNC", "bfloat16"),
    ("LBNHC", "fp8"), ("BLHNC", "fp8")])
def test_a_sweep_moves_every_chunk_size_in_every_layout(layout: str, dtype: str) -> None:
    """64 and 128 KiB chunks (4 and 8 blocks of bf16, 8 and 16 of fp8) of vLLM 0.33's views."""
    config = CopyBenchConfig(**TINY, layout=layout, dtype=dtype,  # type: ignore[arg-type]
                             chunk_mib=(1 / 16, 1 / 8), blocks=32)
    sweep = run_copy_sweep(config)
    assert [r.chunk_bytes for r in sweep.results] == [64 << 10, 128 << 10]
    assert sweep.verified and all(r.kv_layout == layout for r in sweep.results)
    for r in sweep.results:
        assert set(r.ratios) == {"store", "load"} and r.passed == (min(r.ratios.values())
                                                                   >= TARGET_RATIO)
        assert r.runner is not None and 0 < r.runner.blocked_s <= r.runner.job_s
        assert r.config.tokens_per_chunk * r.config.bytes_per_token == r.chunk_bytes


def test_a_chunk_size_whose_loads_write_nothing_fails_though_the_size_before_loaded(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The destination blocks are poisoned before each size: the 64 KiB run's loads must not
    pass the 128 KiB run's check."""
    scatter = PagedKV.scatter

    def only_small(self: PagedKV, chunk: torch.Tensor, *args: object) -> None:
        if chunk.numel() == 64 << 10:
            scatter(self, chunk, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(PagedKV, "scatter", only_small)
    sweep = run_copy_sweep(CopyBenchConfig(**TINY, chunk_mib=(1 / 16, 1 / 8),  # type: ignore[arg-type]
                                           blocks=32))
    assert [r.verified for r in sweep.results] == [True, False]


def test_sweep_sizes_and_layouts_are_validated() -> None:
    assert SWEEP_CHUNK_MIB == (2, 4, 8, 16, 32)
    llama = CopyBenchConfig(device="cpu", chunk_mib=SWEEP_CHUNK_MIB, blocks=64)
    llama.validate()
    assert llama.chunk_tokens() == (16, 32, 64, 128, 256)  # 128 KiB a token in bf16
    assert CopyBenchConfig(dtype="fp8", chunk_mib=(2,)).chunk_tokens() == (32,)
    with pytest.raises(ConfigError, match="chunk_mib"):
        CopyBenchConfig(device="cpu", chunk_mib=(3,)).validate()  # 1.5 blocks
    with pytest.raises(ConfigError, match="layout"):
        CopyBenchConfig(device="cpu", layout="NHD").validate()
    with pytest.raises(ConfigError, match="dtype"):
        CopyBenchConfig(device="cpu", dtype="int4").validate()


def test_the_sweep_command_runs_without_vllm_and_writes_markdown(tmp_path: Path) -> None:
    """`--sweep` (2-32 MiB chunks; 1 layer of 8 heads x 128 in blocks of 256 tokens: 1 MiB
    blocks) in a Python where `import vllm` fails, as on the GPU run-book's machine."""
    out, md = tmp_path / "sweep.json", tmp_path / "sweep.md"
    argv = ["bench", "copy", "--device", "cpu", "--sweep", "--layout", "LBNHC", "--layers",
            "1", "--block-size", "256", "--blocks", "32", "--trials", "1", "--json", str(out),
            "--markdown", str(md)]
    code = ("import sys; sys.modules['vllm'] = None\n"  # `import vllm` raises ImportError
            "from kvtier.tools.cli.main import main\n"
            f"status = main({argv!r})\n"
            "assert not [m for m in sys.modules if m.startswith('vllm.')]\n"
            "sys.exit(status)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    data = json.loads(out.read_text())
    assert data["verified"] is True
    assert [r["chunk_bytes"] >> 20 for r in data["results"]] == [2, 4, 8, 16, 32]
    table = md.read_text()
    assert table.count("\n| ") == 6 and "runner blocked" in table  # header + 5 sizes


def test_the_chunk_size_table_fits_a_pipe_without_cutting_a_figure() -> None:
    """Printed into a pipe (80 columns), the sweep's table once cut its load ratio and its
    verdict to "0.7…" and "FA…" as soon as a runner's job took 10 ms: every cell must show
    whole, here with wide figures (GB/s of two digits, a 133 ms job, loaded bytes that differ).
    """
    result = run_copy_sweep(CopyBenchConfig(**TINY, chunk_mib=(1 / 16,),  # type: ignore[arg-type]
                                            blocks=32)).results[0]
    wide = dataclasses.replace(
        result, chunk_bytes=32 << 20, ratios={"store": 1.25, "load": 0.75}, verified=False,
        figures=tuple(Figure(f.name, f.bytes_moved, (f.bytes_moved / 54.32e9,))
                      for f in result.figures),
        runner=RunnerFigure(chunks=16, blocked_s=0.02345, job_s=0.13345))
    out = io.StringIO()
    Console(file=out, width=80).print(sizes_table(CopySweep((wide, wide))))
    text = out.getvalue()
    assert "…" not in text
    assert "54.32" in text and "0.75x" in text and "23.45/133.5" in text and "DIFFER" in text
