"""`kvtier bench codecs` end to end without an engine: on synthetic bf16 and on the chunk
files of a kvtier disk directory (--kv-dir), every codec and the encryption settings are
measured and written to JSON. Not a timed test: only what the figures must be by
construction is checked (ratios; the lossy flag; the sealed tier's reads served)."""

from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from kvtier.core.keys import ChunkKey
from kvtier.core.layout import KVLayout
from kvtier.errors import ConfigError
from kvtier.tiers import build_tier
from kvtier.tiers.storeconfig import StoreConfig
from kvtier.tools.bench.codecs_inputs import read_chunk_files
from kvtier.tools.cli.main import main


def test_synthetic_run_measures_every_codec_and_encryption(tmp_path: Path) -> None:
    out = tmp_path / "codecs.json"
    assert main(["bench", "codecs", "--synthetic", "--quick", "--dir", str(tmp_path),
                 "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    codecs = {c["codec"]: c for c in result["codecs"]}
    assert {"none", "zstd", "lz4", "fp8", "zstd, no byte planes"} <= set(codecs)
    assert codecs["none"]["ratio"] == 1.0 and codecs["fp8"]["lossy"] is True
    assert codecs["zstd"]["ratio"] < codecs["zstd, no byte planes"]["ratio"] <= 1.0
    assert [s["setting"] for s in result["sealing"]] == [
        "none, in clear", "none, sealed", "zstd, in clear", "zstd, sealed"]
    assert all(s["tier_get_gbps"] > 0 for s in result["sealing"])
    assert "kvtier-bench-codecs-not-a-secret" not in out.read_text()


def test_kv_dir_measures_the_chunk_files_of_a_tier(tmp_path: Path) -> None:
    layout = KVLayout(num_layers=2, num_kv_heads=2, head_size=64, dtype="bfloat16",
                      tokens_per_chunk=64)
    tier = build_tier(StoreConfig.parse({"tiers": [
        {"kind": "disk", "path": str(tmp_path / "kv"), "capacity": "16MiB"}]}).tiers[0], layout)
    rng = np.random.default_rng(0)
    for i in range(4):
        values = rng.standard_normal(layout.bytes_per_chunk // 2).astype(ml_dtypes.bfloat16)
        assert tier.put(ChunkKey(i.to_bytes(16, "big")), memoryview(values.tobytes()))
    tier.close()
    out = tmp_path / "codecs.json"
    assert main(["bench", "codecs", "--kv-dir", str(tmp_path / "kv"), "--quick", "--dir",
                 str(tmp_path), "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["chunks"] == 4 and result["chunk_bytes"] == layout.bytes_per_chunk
    assert main(["bench", "codecs", "--kv-dir", str(tmp_path / "missing")]) == 2
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="kv_dir"):
        read_chunk_files(tmp_path / "empty", 4)


def test_encryption_ratios_are_paired_over_enough_rounds_even_under_quick(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`--quick` timed the encryption settings once (--trials 1), each setting's ops in a
    fixed order, and the table divided the medians: sealed / in clear swung 0.89-2.47x from
    run to run on a loaded 2-core VM. Now at least MIN_SEALING_ROUNDS rounds after an
    untimed one, and a ratio is the median of each round's pair."""
    from kvtier.tools.bench.codecs import MIN_SEALING_ROUNDS

    out = tmp_path / "codecs.json"
    assert main(["bench", "codecs", "--synthetic", "--quick", "--max-chunks", "2",
                 "--dir", str(tmp_path), "--json", str(out)]) == 0
    assert f"medians of {MIN_SEALING_ROUNDS} rounds" in " ".join(capsys.readouterr().out.split())
    sealing = {s["setting"]: s for s in json.loads(out.read_text())["sealing"]}
    for codec in ("none", "zstd"):
        clear, sealed = sealing[f"{codec}, in clear"], sealing[f"{codec}, sealed"]
        assert clear["tier_put_ratio"] == clear["tier_get_ratio"] == 1.0
        assert sealed["tier_put_ratio"] > 0 and sealed["tier_get_ratio"] > 0


def test_neither_setting_of_a_pair_always_goes_first() -> None:
    from kvtier.tools.bench.codecs import SETTINGS, _time_round

    def first_of_each_round(trial: int) -> list[tuple[str, bool]]:
        calls: list[tuple[str, bool]] = []
        _time_round({s: (lambda i, s=s: calls.append(s)) for s in SETTINGS}, 2, trial)
        return calls

    assert first_of_each_round(0) == [s for s in SETTINGS for _ in range(2)]
    assert first_of_each_round(1) == [s for s in reversed(SETTINGS) for _ in range(2)]


def test_a_dtype_is_refused_where_the_chunks_are_bf16_whatever_it_says(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--dtype says what --kv-dir's chunks hold; `--synthetic --dtype float32` measured the
    synthetic bf16 as float32 (its byte planes, its fp8 codec) without a word."""
    assert main(["bench", "codecs", "--synthetic", "--quick", "--dtype", "float32",
                 "--dir", str(tmp_path), "--json", str(tmp_path / "c.json")]) == 2
    err = capsys.readouterr().err
    assert "dtype='float32'" in err and "bfloat16 without --kv-dir" in err, err
    assert not (tmp_path / "c.json").exists()
