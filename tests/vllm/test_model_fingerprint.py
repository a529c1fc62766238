"""The model fingerprint end to end: new weights at the same path never hit old KV; the same
weights at another path do.

Three engines, one after the other, on one disk tier (start ~20-45 s each):
  1. the generated model (seed 0) at `served/`: computes the prompts, writes their chunks;
  2. `served/`'s safetensors overwritten in place with another seed's (same names, shapes,
     config): zero kvtier hits, and its outputs are the recompute path's (the same tokens again
     with kvtier's loads skipped); it writes the new weights' chunks;
  3. a copy of the new `served/` at another path (another node's mount): every loadable chunk
     hits, with engine 2's outputs.
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import pytest
from vllm_harness import (
    chunk_files,
    kvtier_counter,
    kvtier_transfer_config,
    metric,
    random_prompts,
    start_engine,
    token_ids,
)

from kvtier.bench.tinymodel import PRESETS, write_model

pytestmark = pytest.mark.vllm

CHUNK = 64
HITS = "vllm:external_prefix_cache_hits"
LENGTHS = [300, 200]


def test_new_weights_in_place_never_hit_and_a_copy_at_another_path_does(tmp_path: Path) -> None:
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

    elsewhere = tmp_path / "node-b" / "models" / "tiny"
    shutil.copytree(served, elsewhere)
    with start_engine(elsewhere, config) as llm:
        hits = metric(llm, HITS)
        assert token_ids(llm, prompts) == new_outputs
        assert metric(llm, HITS) - hits == sum((n - 1) // CHUNK * CHUNK for n in LENGTHS)
