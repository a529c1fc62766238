"""A streaming-input session (vLLM's resumable request: one request id, its input in pieces)
follows each piece's kv_transfer_params, in a real vLLM on the CPU backend (in process).

vLLM gives the session each new piece's sampling params (`Scheduler._update_request_as_session`)
but keeps `request.kv_transfer_params` the first piece's: kvtier read the switches once, so a
piece sent with skip_store still stored what the session computed for it. Driven as
test_streaming_sessions.py drives a session (pieces of one request id, `resumable=True`).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from vllm_harness import greedy, kvtier_counter, kvtier_transfer_config, start_engine

pytestmark = pytest.mark.vllm

CHUNK = 64
BYPASS = {"skip_load": True, "skip_store": True}
MAX_STEPS = 100  # a bound on the steps an input piece takes


@pytest.fixture(scope="module")
def llm(tiny_model_dir: Path) -> Iterator[Any]:
    config = kvtier_transfer_config([{"kind": "memory", "capacity": "8MiB"}], CHUNK)
    with start_engine(tiny_model_dir, config) as engine:
        yield engine


def send_pieces(llm: Any, name: str, pieces: list[tuple[list[int], dict[str, Any] | None]]
                ) -> list[int]:
    """Run a session of `pieces` (token ids, kv_transfer_params), each to its end; the
    session's token ids at the last one's end. Aborted on return."""
    from vllm.sampling_params import RequestOutputKind

    engine = llm.llm_engine
    scheduler = engine.engine_core.engine_core.scheduler
    ids: list[str] = []
    try:
        for tokens, controls in pieces:
            params = greedy(4, controls)
            params.output_kind = RequestOutputKind.DELTA
            request = engine.input_processor.process_inputs(
                request_id=ids[0] if ids else name, prompt={"prompt_token_ids": tokens},
                params=params, resumable=True, supported_tasks=("generate",))
            if not ids:
                ids.append(engine.add_request(name, request, params))
            else:
                request.external_req_id = name
                engine.engine_core.add_request(request)
            for _ in range(MAX_STEPS):
                engine.step()
                running = scheduler.requests[ids[0]]
                if running.status.name == "WAITING_FOR_STREAMING_REQ":
                    break
            else:
                raise AssertionError(f"the piece did not end in {MAX_STEPS} steps")
        return list(running.all_token_ids)
    finally:
        if ids:
            engine.abort_request(ids, internal=True)


def reset_prefix_cache(llm: Any, timeout_s: float = 60.0) -> None:
    """vLLM's prefix cache emptied: refused while stores still hold blocks of the session, so
    asked again, a step of a bypass request between (the stores' reports come with steps)."""
    deadline = time.monotonic() + timeout_s
    while not llm.reset_prefix_cache():
        assert time.monotonic() < deadline, "vLLM's prefix cache was never reset"
        llm.generate([{"prompt_token_ids": [1, 2, 3]}], greedy(1, BYPASS), use_tqdm=False)


def test_a_piece_sent_with_skip_store_stores_nothing_of_the_session(llm: Any) -> None:
    first = list(range(100, 200))  # chunk 0 computed and stored with it
    later = list(range(300, 450))  # skip_store: chunks 1-3 computed, never stored
    tokens = send_pieces(llm, "session", [(first, None), (later, {"skip_store": True})])
    prompt = {"prompt_token_ids": tokens[:4 * CHUNK]}
    reset_prefix_cache(llm)
    loaded = kvtier_counter("loaded_tokens")
    llm.generate([prompt], greedy(1, {"skip_store": True}), use_tqdm=False)
    assert kvtier_counter("loaded_tokens") - loaded == CHUNK  # the first piece's chunk only
