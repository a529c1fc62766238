"""Helpers for end-to-end tests on a real vLLM (CPU backend) with a generated model.

Engines start in this process by default (`start_engine`: VLLM_ENABLE_V1_MULTIPROCESSING=0,
vLLM's engine core and model runner in the test's process), in ~5-10 s. vLLM's own processes
(EngineCore, then its worker; an OpenAI server adds its API server) each import vLLM afresh,
about 20 s of one core each on these machines, one after the other: a start took ~50 s here.
They are kept for what only they have: tensor parallel ranks, a worker process's threads and
cores, faults injected into spawned processes (slow_files.py), a refusal reported by the
engine core process, and OpenAI servers (the tools' tests: tests/tools/serverkit.py). Each
test module still builds its engine once (module-scoped fixture through `start_engine`) and
its cases share it; a module's engine is shut down before the next module starts one, so at
most one engine runs in a pytest process.

Primitives:
  - `start_engine(model_dir, kv_transfer_config, processes=None, **overrides)`: a context
    manager that yields an `LLM` with small CPU settings and shuts it down afterwards.
  - `random_prompts`, `greedy`, `token_ids`, `metric`: small helpers for the cases.
  - `kvtier_transfer_config(tiers)`: the KVTierConnector config (64-token chunks, every
    hit loaded).
  - `kvtier_counter(name, tier)`: one of kvtier's own counters (the connector's stats, as
    vLLM exports them on /metrics).
  - `chunk_files(root)`: the chunk files a disk or shared tier holds under `root`;
    `settle(roots)`, `wait_for_new_file(root, before)`, `chunk_payload(path)`,
    `flip_byte(path)`: waiting for the write-behind, naming the one chunk file a run added,
    reading a chunk file's KV, damaging one.
  - `refusal_line(model_dir, config)`: kvtier's one-line refusal of a model.
"""

from __future__ import annotations

import contextlib
import os
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from slow_files import injecting

from kvtier.core.chunkformat import HEADER_BYTES
from kvtier.integrations.vllm.config import kvtier_transfer_config as transfer_config
from kvtier.testing.engines import kvtier_counter, offline_engine
from kvtier.testing.tinymodel import FIRST_WORD_ID, PRESETS

__all__ = ["kvtier_counter"]  # re-exported for the cases

# Small, fast settings: 32-token blocks (the CPU backend's minimum) so that short prompts
# span several blocks; a fixed, small number of KV blocks (4,096 tokens).
BLOCK_SIZE = 32
NUM_BLOCKS = 128
MAX_MODEL_LEN = 2048


@contextlib.contextmanager
def start_engine(model_dir: Path, kv_transfer_config: dict[str, Any] | None = None, *,
                 processes: bool | None = None, **overrides: Any) -> Iterator[Any]:
    """A `vllm.LLM` on the CPU backend with the tests' small settings, shut down on exit.

    Args:
        model_dir: the model to serve.
        kv_transfer_config: the connector config, or None for no connector.
        processes: False: the engine core and its worker run in this process
            (VLLM_ENABLE_V1_MULTIPROCESSING=0 while the engine is built), a start of ~5-10 s
            rather than ~50 s. True: vLLM's own EngineCore and worker processes, for a test of
            what only separate processes have (tensor parallel ranks, a worker's own threads
            and core binding, faults injected into them). None (the default): False, but True
            inside a block of `slow_files.injected` (its faults reach spawned processes only)
            or under KVTIER_TEST_ENGINE_PROCESSES=1 (to tell whether a failure is in-process).
        **overrides: any other `LLM(...)` argument (e.g. num_gpu_blocks_override;
            max_model_len, MAX_MODEL_LEN unless given).
    """
    if kv_transfer_config is not None:
        overrides.setdefault("kv_transfer_config", kv_transfer_config)
    settings: dict[str, Any] = {"block_size": BLOCK_SIZE, "num_gpu_blocks_override": NUM_BLOCKS,
                                "max_num_batched_tokens": None}  # None: vLLM's default
    max_model_len = overrides.pop("max_model_len", MAX_MODEL_LEN)
    engine = offline_engine(model_dir, max_model_len, **(settings | overrides))
    if processes is None:
        processes = injecting() or os.environ.get("KVTIER_TEST_ENGINE_PROCESSES") == "1"
    if processes:
        with engine as llm:
            yield llm
        return
    with contextlib.ExitStack() as stack:
        stack.enter_context(_process_state_kept())
        # The model runner's threads as vLLM's worker process would have them (its cores,
        # less those reserved for the engine core): more threads here change the rounding of
        # a prefill with its shape, and a hit's tokens then differ from the miss path's.
        reserved = int(os.environ.get("VLLM_CPU_NUM_OF_RESERVED_CPU", "1"))
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) - reserved))
        saved = os.environ.get(IN_PROCESS)
        os.environ[IN_PROCESS] = "0"  # read as vLLM builds the engine
        try:
            llm = stack.enter_context(engine)
        finally:
            _restore_env(IN_PROCESS, saved)
            _uncache_vllm_env()
        _step_while_the_scheduler_holds_requests(llm)
        yield llm


def _step_while_the_scheduler_holds_requests(llm: Any, drain_s: float = 60.0) -> None:
    """`llm.generate` in this process steps the engine as vLLM's engine core process does.

    That process steps its engine while its scheduler holds any request, finished ones
    included: a request whose last step stored KV is held (its blocks in use) until the
    connector reports the stores done, a step or more later. `generate` in this process steps
    only while a request is unfinished for the caller, and would return with such requests
    still holding their blocks (vLLM's `reset_prefix_cache()` then fails). So it also steps
    while the scheduler holds requests, at most `drain_s` after the caller's last one ended."""
    engine = llm.llm_engine
    scheduler = engine.engine_core.engine_core.scheduler
    unfinished = engine.has_unfinished_requests
    drain_until: list[float | None] = [None]

    def has_unfinished_requests() -> bool:
        if unfinished():
            drain_until[0] = None
            return True
        if not scheduler.has_requests():
            return False
        if drain_until[0] is None:
            drain_until[0] = time.monotonic() + drain_s
        return time.monotonic() < drain_until[0]

    engine.has_unfinished_requests = has_unfinished_requests


@contextlib.contextmanager
def _process_state_kept() -> Iterator[None]:
    """This process as it was, after an engine core ran in it. It changes process-wide state
    that vLLM's own processes keep to themselves: it caches vLLM's environment variables (an
    engine built later would not see its test's variables), freezes the garbage collector's
    heap (the engine's cycles would never be collected), replaces torch.set_num_threads with a
    no-op, a worker may bind this process to some of its cores, and a worker keeps its KV
    connector in a global, which only its shutdown ends (a start that failed left it: the next
    engine here took another model's connector for its own). The heap is left frozen
    once the engine's cycles are collected: in a process that collected the whole suite a
    full collection takes 0.4-0.5 s, and each engine's start makes one (`freeze_gc_heap`)."""
    import gc

    from vllm.distributed.kv_transfer.kv_transfer_state import ensure_kv_transfer_shutdown

    cores = os.sched_getaffinity(0)
    set_num_threads, num_threads = torch.set_num_threads, torch.get_num_threads()
    try:
        yield
    finally:
        # vLLM's worker keeps its connector in a global, ended by the worker's shutdown: an
        # engine whose start failed (a model kvtier refuses) left it, and the next engine of
        # this process took it for its own (another model's config: refused again).
        ensure_kv_transfer_shutdown()
        _uncache_vllm_env()
        if gc.get_freeze_count():  # no engine shut down (vLLM's shutdown unfreezes the heap
            gc.unfreeze()  # and `offline_engine` then collects it): its cycles are collected
            gc.collect()
        gc.freeze()
        torch.set_num_threads = set_num_threads
        torch.set_num_threads(num_threads)
        os.sched_setaffinity(0, cores)


def _uncache_vllm_env() -> None:
    import vllm.envs

    vllm.envs.disable_envs_cache()


IN_PROCESS = "VLLM_ENABLE_V1_MULTIPROCESSING"


def _restore_env(name: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value


def random_prompts(lengths: list[int], seed: int = 0) -> list[dict[str, list[int]]]:
    """Prompts of random word ids (as token ids, to bypass tokenizer surprises)."""
    rng = random.Random(seed)
    vocab = PRESETS["test"].vocab_size
    return [{"prompt_token_ids": [rng.randrange(FIRST_WORD_ID, vocab) for _ in range(n)]}
            for n in lengths]


def greedy(max_tokens: int = 16, kv_transfer_params: dict[str, Any] | None = None) -> Any:
    """Greedy sampling that never stops early (random models emit EOS at random), with
    optional per-request connector controls (vLLM routes `extra_args["kv_transfer_params"]`
    to `Request.kv_transfer_params`)."""
    from vllm import SamplingParams

    extra = {"kv_transfer_params": kv_transfer_params} if kv_transfer_params else None
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                          extra_args=extra)


def token_ids(llm: Any, prompts: list[dict[str, Any]], max_tokens: int = 16,
              kv_transfer_params: dict[str, Any] | None = None) -> list[list[int]]:
    """Generated token ids, one list per prompt (all prompts submitted at once)."""
    outputs = llm.generate(prompts, greedy(max_tokens, kv_transfer_params), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def kvtier_transfer_config(tiers: list[dict[str, Any]] | None = None,
                           tokens_per_chunk: int = 64, load_when: str = "always",
                           tail_chunks: bool = False) -> dict[str, Any]:
    """`kv_transfer_config` loading kvtier's connector with `tiers` (default: memory only).

    `load_when` is "always" unless a test asks for the rule ("faster", the connector's
    default): the cases count the tokens they load, and on a machine loaded by other tests
    the rule may rightly recompute this tiny model's hit rather than read it from disk (a
    test that then sees fewer loaded tokens fails for no fault of kvtier's). The rule has
    its own engine tests (test_load_or_recompute.py). `tail_chunks` is off unless a test
    asks for it (on is the connector's default): these cases count hits, chunks and chunk
    files at chunk granularity; hits at block boundaries have their own engine tests
    (test_block_hits.py)."""
    extra: dict[str, Any] = {"tokens_per_chunk": tokens_per_chunk, "load_when": load_when,
                             "tail_chunks": tail_chunks}
    if tiers is not None:
        extra["tiers"] = tiers
    return transfer_config(extra)


def chunk_files(root: Path) -> list[Path]:
    """The chunk files under a disk or shared tier's directory, sorted. Walked with os.walk,
    which passes over a directory that goes as it is listed (a tier evicting its last chunk
    removes it: rglob raised FileNotFoundError under a live engine's eviction)."""
    return sorted(Path(directory) / name for directory, _, names in os.walk(root)
                  for name in names if name.endswith(".kvc"))


def settle(roots: list[Path], timeout_s: float = 30.0, quiet_s: float = 1.0) -> None:
    """Wait until no chunk file appears under `roots` for `quiet_s` (write-behind is
    asynchronous)."""
    deadline = time.monotonic() + timeout_s
    seen, since = -1, time.monotonic()
    while time.monotonic() < deadline:
        count = sum(len(chunk_files(r)) for r in roots)
        if count != seen:
            seen, since = count, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            return
        time.sleep(0.1)


def wait_for_new_file(root: Path, before: set[str], timeout_s: float = 30.0) -> str:
    """The name of the one chunk file added under `root` since `before`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        new = {f.name for f in chunk_files(root)} - before
        if new:
            time.sleep(0.2)  # a second file would be a test bug: check below
            new = {f.name for f in chunk_files(root)} - before
            assert len(new) == 1, new
            return new.pop()
        time.sleep(0.05)
    raise AssertionError(f"no new chunk file under {root}")


def chunk_payload(path: Path) -> torch.Tensor:
    """A chunk file's KV values (the generated model is bfloat16), as float32."""
    data = bytearray(path.read_bytes()[HEADER_BYTES:])
    return torch.frombuffer(data, dtype=torch.bfloat16).float()


def flip_byte(path: Path) -> None:
    """Flip one payload byte of a chunk file (its checksum then fails)."""
    with open(path, "r+b") as f:
        f.seek(HEADER_BYTES + 1000)
        byte = f.read(1)
        f.seek(HEADER_BYTES + 1000)
        f.write(bytes([byte[0] ^ 0xFF]))


def refusal_line(model_dir: Path, kv_transfer_config: dict[str, Any],
                 **overrides: Any) -> str:
    """kvtier's one-line refusal of `model_dir`: the engine must not start.

    In this process (the engine core raises kvtier's ConfigError here, ~5-10 s; through vLLM's
    processes, where the front end reports it as a failed start, 35-70 s a model): that the
    line reaches a server's output from the engine core process is test_disk_owner_e2e's."""
    import pytest

    from kvtier.errors import ConfigError

    with (pytest.raises(ConfigError, match="kvtier cannot serve it") as refused,
          start_engine(model_dir, kv_transfer_config, processes=False, **overrides)):
        pass
    [line] = str(refused.value).splitlines()
    return line


def metric(llm: Any, name: str) -> float:
    """The value of one of vLLM's counters/gauges (summed over label sets), 0 if absent."""
    total = 0.0
    for m in llm.get_metrics():
        if m.name == name and isinstance(getattr(m, "value", None), (int, float)):
            total += m.value
    return total
