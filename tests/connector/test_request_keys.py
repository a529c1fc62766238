"""Keys name exactly the KV: what vLLM's block hash covers besides token ids is in them too.

Scenarios on real vLLM `Request`s with `MultiModalFeatureSpec`s (no engine): two requests with
the same image placeholder tokens and different images, prompt-embeds requests (all token ids
0), a request whose extra keys kvtier cannot encode, and text requests, which the extra-key
path must leave alone. Chunks of 64 tokens over vLLM blocks of 32.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm")

import torch
from vllm import SamplingParams
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import Request

from kvtier.core.keys import Namespace, chunk_keys
from kvtier.core.locator import ChunkLocator
from kvtier.integrations.vllm.config import ConnectorConfig
from kvtier.integrations.vllm.messages import KVTierWorkerMetadata
from kvtier.integrations.vllm.scheduler.connector_scheduler import ConnectorScheduler
from kvtier.integrations.vllm.scheduler.requeststate import CHUNK_ORDER

CHUNK, BLOCK = 64, 32
IMAGE_TOKEN = 99  # the placeholder token of every image


def image(identifier: Any, offset: int, length: int = 80) -> MultiModalFeatureSpec:
    return MultiModalFeatureSpec(data=None, modality="image", identifier=identifier,
                                 mm_position=PlaceholderRange(offset=offset, length=length),
                                 mm_hash=identifier if isinstance(identifier, str) else None)


def mm_request(rid: str, images: list[MultiModalFeatureSpec], num_tokens: int = 200) -> Request:
    """Text tokens with every image's placeholder tokens at its position."""
    tokens = list(range(1000, 1000 + num_tokens))
    for feature in images:
        pos = feature.mm_position
        tokens[pos.offset: pos.offset + pos.length] = [IMAGE_TOKEN] * pos.length
    return Request(rid, tokens, SamplingParams(max_tokens=4), None, mm_features=images)


def embeds_request(rid: str, seed: int, num_tokens: int = 200) -> Request:
    gen = torch.Generator().manual_seed(seed)
    embeds = torch.randn(num_tokens, 16, generator=gen)
    return Request(rid, None, SamplingParams(max_tokens=4), None, prompt_embeds=embeds)


def text_request(rid: str, num_tokens: int = 200) -> Request:
    return Request(rid, list(range(1000, 1000 + num_tokens)), SamplingParams(max_tokens=4), None)


class Engine:
    """Just enough of vLLM: prefill a request (its chunks stored), then ask about another."""

    def __init__(self) -> None:
        self.sched = ConnectorScheduler(ConnectorConfig.parse({"tokens_per_chunk": CHUNK}),
                                        block_size=BLOCK, model_id="tiny",
                                        layout_digest="0" * 32, weights_fingerprint="w" * 32,
                                        locator=ChunkLocator({}, max_keys=1024))

    def prefill(self, req: Request) -> list[bytes]:
        """Run the request's prefill; the keys of the chunks it stored."""
        blocks = list(range(req.num_tokens // BLOCK + 1))
        assert self.hit_tokens(req) == 0
        self.sched.update_state_after_alloc(
            req, SimpleNamespace(get_block_ids=lambda: (blocks,)), 0)  # type: ignore[arg-type]
        output = SimpleNamespace(
            scheduled_new_reqs=[SimpleNamespace(req_id=req.request_id, block_ids=(blocks,),
                                                num_computed_tokens=0)],
            scheduled_cached_reqs=SimpleNamespace(req_ids=[], new_block_ids=[],
                                                  num_computed_tokens=[], resumed_req_ids=set()),
            num_scheduled_tokens={req.request_id: req.num_tokens}, preempted_req_ids=set())
        stored = [t.key for t in self.sched.build_connector_meta(output).stores]  # type: ignore
        self.sched.update_connector_output(KVConnectorOutput(
            kv_connector_worker_meta=KVTierWorkerMetadata(stored=set(stored))))
        self.sched.request_finished(req)
        return stored

    def hit_tokens(self, req: Request) -> int:
        tokens, is_async = self.sched.get_num_new_matched_tokens(req, 0)
        assert tokens is not None and not is_async
        return tokens


def test_the_same_placeholder_tokens_with_another_image_never_hit() -> None:
    engine = Engine()
    engine.prefill(mm_request("cat", [image("hash-of-cat", offset=10)]))
    # Token ids are equal (the same 80 placeholder tokens); only the image differs.
    assert engine.hit_tokens(mm_request("dog", [image("hash-of-dog", offset=10)])) == 0
    assert engine.hit_tokens(mm_request("cat2", [image("hash-of-cat", offset=10)])) == 192


def test_the_image_counts_only_from_the_chunk_that_holds_it() -> None:
    engine = Engine()
    # An image at token 130 leaves chunks 0 and 1 (tokens 0-127) text only: they are shared.
    engine.prefill(mm_request("cat", [image("hash-of-cat", offset=130, length=40)]))
    assert engine.hit_tokens(mm_request("dog", [image("hash-of-dog", offset=130, length=40)])) \
        == 128


def test_the_same_image_at_another_position_is_another_prefix() -> None:
    engine = Engine()
    # Equal token ids (placeholders at 10-89) and the same image, which starts at 10 in one
    # request and at 12 in the other (e.g. a processor that pads differently).
    first = mm_request("a", [image("img", offset=10, length=80)])
    second = mm_request("b", [image("img", offset=12, length=78)])
    second._all_token_ids[10:12] = [IMAGE_TOKEN] * 2
    assert list(first.all_token_ids) == list(second.all_token_ids)
    engine.prefill(first)
    assert engine.hit_tokens(second) == 0


def test_prompt_embeds_requests_share_only_equal_embeddings() -> None:
    engine = Engine()
    engine.prefill(embeds_request("a", seed=1))
    other = embeds_request("b", seed=2)
    assert list(other.all_token_ids) == [0] * 200  # the token ids say nothing
    assert engine.hit_tokens(other) == 0
    assert engine.hit_tokens(embeds_request("c", seed=1)) == 192


def test_a_request_whose_extra_keys_cannot_be_encoded_is_neither_looked_up_nor_stored() -> None:
    engine = Engine()
    engine.prefill(mm_request("a", [image("img", offset=10)]))

    class Opaque:  # an identifier kvtier has no canonical encoding for
        pass

    odd = mm_request("b", [image(Opaque(), offset=10)])
    assert engine.prefill(odd) == []
    stats = engine.sched.take_stats()
    assert stats is not None and stats.data["counters"]["uncacheable_requests"] == {"": 1}


def test_a_text_request_keys_exactly_as_without_the_extra_key_path() -> None:
    engine = Engine()
    stored = engine.prefill(text_request("a"))
    namespace = Namespace(model_id="tiny", layout_digest="0" * 32, weights_fingerprint="w" * 32,
                          extra=(CHUNK_ORDER, f"block-size={BLOCK}"))
    assert stored == chunk_keys(list(range(1000, 1200)), namespace, CHUNK)


_KEYS_IN_A_FRESH_PROCESS = """
import json, sys
sys.path.insert(0, sys.argv[1])
import test_request_keys as t
engine = t.Engine()
keys = {
    "text": engine.prefill(t.text_request("a")),
    "image": engine.prefill(t.mm_request("b", [t.image("img", offset=10)])),
    "embeds": engine.prefill(t.embeds_request("c", seed=1)),
}
print(json.dumps({name: [k.hex() for k in ks] for name, ks in keys.items()}))
"""


def _keys_in_subprocess(hash_seed: str) -> dict[str, list[str]]:
    env = {**os.environ, "PYTHONHASHSEED": hash_seed}
    done = subprocess.run(
        [sys.executable, "-c", _KEYS_IN_A_FRESH_PROCESS, os.path.dirname(__file__)], env=env,
        capture_output=True, text=True, check=True, timeout=120)
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_keys_with_extras_are_the_same_in_a_fresh_process_with_another_hash_seed() -> None:
    engine = Engine()
    here = {
        "text": engine.prefill(text_request("a")),
        "image": engine.prefill(mm_request("b", [image("img", offset=10)])),
        "embeds": engine.prefill(embeds_request("c", seed=1)),
    }
    there = _keys_in_subprocess("4242")
    assert there == {name: [k.hex() for k in ks] for name, ks in here.items()}
    assert all(len(ks) == 3 for ks in here.values())
