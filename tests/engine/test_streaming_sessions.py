"""A streaming-input session (vLLM's resumable request) whose image comes with a later input
chunk, in a real vLLM on the CPU backend with a tiny vision-language model (tiny_vlm.py).

vLLM runs a session as one request id whose input arrives in chunks (AsyncLLM's streaming
input): between them the request waits, and each new chunk extends its prompt, images
included (`Scheduler._update_request_as_session`; vLLM's block hashes of the new blocks carry
the image's identifier). kvtier decided once, at the session's first input chunk (text only),
that its chunks carried no extra keys, and keyed the chunks over the image's placeholders
by their token ids alone: a text request of the same token ids then loaded the image's KV
(192 tokens) and generated other tokens than its miss path's. The request is asked again at
each chunk key now (`RequestState.has_extras`).

The session is driven in this process the way AsyncLLM drives it (input chunks of one
request id, `resumable=True`, added to the engine core and stepped), then aborted.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
from tiny_vlm import image, make_tiny_idefics3, words
from vllm_harness import greedy, kvtier_counter, kvtier_transfer_config, start_engine

pytestmark = pytest.mark.vllm

CHUNK = 64
BYPASS = {"skip_load": True, "skip_store": True}
MAX_STEPS = 100  # a bound on the steps an input chunk takes (4 tokens each, a few prefills)


@pytest.fixture(scope="module")
def vlm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    model_dir = make_tiny_idefics3(tmp_path_factory.mktemp("vlm"))
    config = kvtier_transfer_config([{"kind": "memory", "capacity": "8MiB"}], CHUNK)
    # No multimodal processor cache: each input chunk carries its image's data to the engine
    # core (the cache assumes AsyncLLM's bookkeeping of what the core already holds).
    with start_engine(model_dir, config, limit_mm_per_prompt={"image": 1},
                      mm_processor_cache_gb=0) as engine:
        yield engine


@contextlib.contextmanager
def session(llm: Any, name: str) -> Iterator[Any]:
    """A streaming-input session: yields a function that sends one input chunk and steps the
    engine until the session waits for the next; the session's vLLM request (scheduler
    side). Aborted on exit."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    engine = llm.llm_engine
    scheduler = engine.engine_core.engine_core.scheduler
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA)
    ids: list[str] = []

    def send(prompt: dict[str, Any]) -> Any:
        request = engine.input_processor.process_inputs(
            request_id=ids[0] if ids else name, prompt=prompt, params=params,
            resumable=True, supported_tasks=("generate",))
        if not ids:
            ids.append(engine.add_request(name, request, params))  # names its internal id
        else:
            request.external_req_id = name
            engine.engine_core.add_request(request)
        for _ in range(MAX_STEPS):
            engine.step()
            running = scheduler.requests[ids[0]]
            if running.status.name == "WAITING_FOR_STREAMING_REQ":
                return running
        raise AssertionError(f"the input chunk did not end in {MAX_STEPS} steps")

    try:
        yield send
    finally:
        if ids:
            engine.abort_request(ids, internal=True)


def test_chunks_after_an_image_sent_in_a_later_input_chunk_are_keyed_with_it(vlm: Any) -> None:
    with session(vlm, "stream") as send:
        send({"prompt": words(7, 70)})  # text only: chunk 0 ends inside the image below
        request = send({"prompt": " <image> " + words(8, 80),
                        "multi_modal_data": {"image": image(1)}})
        assert len(request.mm_features) == 1
        text_of_its_tokens = {"prompt_token_ids": list(request.all_token_ids[:200])}
    assert vlm.reset_prefix_cache()
    [miss] = vlm.generate([text_of_its_tokens], greedy(8, BYPASS), use_tqdm=False)
    assert vlm.reset_prefix_cache()
    loaded = kvtier_counter("loaded_tokens")
    [hit] = vlm.generate([text_of_its_tokens], greedy(8), use_tqdm=False)
    assert kvtier_counter("loaded_tokens") - loaded == CHUNK  # the text before the image
    assert list(hit.outputs[0].token_ids) == list(miss.outputs[0].token_ids)
