"""A LoRA adapter's KV is keyed by the adapter's content, not by its name or path.

Guards against what vLLM's own block hash does (name and path, `lora_name` / `lora_path` in the
extra keys of `kv_cache_utils`): an adapter name re-pointed at a retrained adapter, or two
tenants' adapters that happen to share a name, would serve each other's KV from a persistent or
shared tier, where no restart clears it; and one adapter mounted at two paths (two nodes of a
fleet) would never share. kvtier names the adapter by a fingerprint of its directory's files
(`core/fingerprint.adapter_fingerprint`, through `request_keys.lora_identity`), and falls back
to name and path, logged, where the path is not a local directory.

Real adapter files on disk (a PEFT-style `adapter_config.json` and `adapter_model.safetensors`
written with safetensors), real vLLM `Request`s and `LoRARequest`s, one `ConnectorScheduler` (no
engine). Chunks of 64 tokens over vLLM blocks of 32.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

import torch
from safetensors.torch import save_file
from vllm import SamplingParams
from vllm.lora.request import LoRARequest
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import Request

from kvtier.core.fingerprint import adapter_fingerprint
from kvtier.core.locator import ChunkLocator
from kvtier.integrations.vllm.config import ConnectorConfig
from kvtier.integrations.vllm.messages import KVTierWorkerMetadata
from kvtier.integrations.vllm.scheduler import request_keys
from kvtier.integrations.vllm.scheduler.connector_scheduler import ConnectorScheduler

CHUNK, BLOCK = 64, 32
PROMPT = list(range(1000, 1200))  # 3 full chunks before the last token
HIT = 3 * CHUNK


def write_adapter(directory: Path, seed: int, rank: int = 4) -> Path:
    """A PEFT-style LoRA adapter whose weights are drawn from `seed`."""
    directory.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    tensors = {f"base_model.model.model.layers.{i}.self_attn.{proj}.lora_{ab}.weight":
               torch.randn(*((rank, 64) if ab == "A" else (64, rank)), generator=gen)
               for i in range(2) for proj in ("q_proj", "v_proj") for ab in ("A", "B")}
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    (directory / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"],
        "base_model_name_or_path": "tiny"}))
    return directory


class Scheduler:
    """kvtier's scheduler side: store a request's prefill, ask what another would load."""

    def __init__(self) -> None:
        self.sched = ConnectorScheduler(ConnectorConfig.parse({"tokens_per_chunk": CHUNK}),
                                        block_size=BLOCK, model_id="tiny",
                                        layout_digest="0" * 32,
                                        locator=ChunkLocator({}, max_keys=1024))
        self.count = 0

    def request(self, lora: LoRARequest | None) -> Request:
        self.count += 1
        return Request(f"r{self.count}", list(PROMPT), SamplingParams(max_tokens=4), None,
                       lora_request=lora)

    def store(self, lora: LoRARequest | None, chunks: int = 3,
              meanwhile: Callable[[], None] | None = None) -> None:
        """Run the prompt under `lora` once, nothing loaded: its prefill stores `chunks` of
        its full chunks (0: the request is not cached); `meanwhile` runs between its lookup
        and its step."""
        req = self.request(lora)
        external, _ = self.sched.get_num_new_matched_tokens(req, 0)
        assert external == 0
        if meanwhile is not None:
            meanwhile()
        blocks = list(range(7))
        self.sched.update_state_after_alloc(
            req, SimpleNamespace(get_block_ids=lambda: (blocks,)), 0)  # type: ignore[arg-type]
        output = SimpleNamespace(
            scheduled_new_reqs=[SimpleNamespace(req_id=req.request_id, block_ids=(blocks,),
                                                num_computed_tokens=0)],
            scheduled_cached_reqs=SimpleNamespace(req_ids=[], new_block_ids=[],
                                                  num_computed_tokens=[], resumed_req_ids=set()),
            num_scheduled_tokens={req.request_id: len(PROMPT)}, preempted_req_ids=set())
        meta = self.sched.build_connector_meta(output)  # type: ignore[arg-type]
        assert len(meta.stores) == chunks
        self.sched.update_connector_output(KVConnectorOutput(
            kv_connector_worker_meta=KVTierWorkerMetadata(
                stored={t.key for t in meta.stores}, stores_through=meta.step)))
        self.sched.request_finished(req)

    def hit(self, lora: LoRARequest | None) -> int:
        """Tokens kvtier would load for the prompt under `lora`, asked in a step of its own
        (kvtier looks at an adapter's files once a step)."""
        self.sched.build_connector_meta(SimpleNamespace(  # type: ignore[arg-type]
            scheduled_new_reqs=[], preempted_req_ids=set(), num_scheduled_tokens={},
            scheduled_cached_reqs=SimpleNamespace(req_ids=[], new_block_ids=[],
                                                  num_computed_tokens=[], resumed_req_ids=set())))
        req = self.request(lora)
        external, _ = self.sched.get_num_new_matched_tokens(req, 0)
        assert external is not None
        self.sched.request_finished(req)
        return external


def test_two_adapters_under_one_name_never_share_kv(tmp_path: Path) -> None:
    """The name re-pointed at a retrained adapter (a new path: vLLM's server gives it a new
    id), and at a retrained adapter written over the old one in place: misses every time."""
    sched = Scheduler()
    first = write_adapter(tmp_path / "support-v1", seed=1)
    sched.store(LoRARequest("support", 1, str(first)))
    assert sched.hit(LoRARequest("support", 1, str(first))) == HIT
    retrained = write_adapter(tmp_path / "support-v2", seed=2)
    assert sched.hit(LoRARequest("support", 2, str(retrained))) == 0
    # Rewritten in place (another mtime, other bytes), read by a new id: the old fingerprint
    # is not reused.
    write_adapter(first, seed=3)
    os.utime(first / "adapter_model.safetensors", ns=(1, 1))
    assert sched.hit(LoRARequest("support", 3, str(first))) == 0
    # Nor is a request without an adapter served an adapter's KV, or the other way round.
    assert sched.hit(None) == 0
    sched.store(None)
    assert sched.hit(LoRARequest("support", 2, str(retrained))) == 0


def test_an_adapter_rewritten_under_its_id_is_not_cached_under_that_id_again(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """vLLM's workers keep the weights they loaded for an id whatever its files hold later:
    a request of that id after its files changed computes with the old weights (or the new
    ones, once the worker evicts the adapter and reads it again). Keyed by the files' new
    content, its KV would be served to a request that runs the new weights (found by trying:
    an engine served id 10's old-weights KV to id 11, which loaded the new files). kvtier
    neither looks such a request up nor stores it, nor any of that id's from then on, and
    says so once; the new files under a new id are cached."""
    sched = Scheduler()
    adapter = write_adapter(tmp_path / "policy", seed=1)
    sched.store(LoRARequest("policy", 10, str(adapter)))
    write_adapter(adapter, seed=2)  # the trainer writes new weights over the old ones
    os.utime(adapter / "adapter_model.safetensors", ns=(1, 1))
    log = "kvtier.integrations.vllm.scheduler.request_keys"
    with caplog.at_level(logging.WARNING, logger=log):
        for _ in range(2):
            assert sched.hit(LoRARequest("policy", 10, str(adapter))) == 0
            sched.store(LoRARequest("policy", 10, str(adapter)), chunks=0)
    assert sum("changed since vLLM's workers loaded it" in r.getMessage()
               for r in caplog.records) == 1
    # A new id loads the new files: its own KV, stored and found.
    assert sched.hit(LoRARequest("policy-v2", 11, str(adapter))) == 0
    sched.store(LoRARequest("policy-v2", 11, str(adapter)))
    assert sched.hit(LoRARequest("policy-v2", 11, str(adapter))) == HIT
    # Files put back as they were do not make id 10 known again (its worker may have read
    # the new ones meanwhile), nor does a reload in place (its step is the workers').
    write_adapter(adapter, seed=1)
    os.utime(adapter / "adapter_model.safetensors", ns=(2, 2))
    assert sched.hit(LoRARequest("policy", 10, str(adapter))) == 0
    assert sched.hit(LoRARequest("policy", 10, str(adapter), load_inplace=True)) == 0
    stats = sched.sched.take_stats()
    assert stats is not None
    assert sum(stats.data["counters"]["uncacheable_requests"].values()) == 6  # counted


def test_a_request_whose_adapter_changes_before_its_step_stores_nothing(
        tmp_path: Path) -> None:
    """Keyed by its adapter's content at its lookup; the files rewritten before its step (a
    worker that evicted the adapter reads the new ones): its KV is not its keys', not stored."""
    sched = Scheduler()
    adapter = write_adapter(tmp_path / "policy", seed=1)

    def rewrite() -> None:
        write_adapter(adapter, seed=2)
        os.utime(adapter / "adapter_model.safetensors", ns=(1, 1))

    sched.store(LoRARequest("policy", 10, str(adapter)), chunks=0, meanwhile=rewrite)
    assert sched.hit(LoRARequest("policy", 10, str(adapter))) == 0


def test_a_request_that_reloads_its_adapter_in_place_is_not_cached(tmp_path: Path) -> None:
    """`load_inplace`: its workers read the files again at a step kvtier does not see."""
    sched = Scheduler()
    adapter = write_adapter(tmp_path / "policy", seed=1)
    sched.store(LoRARequest("policy", 10, str(adapter)))
    reload = LoRARequest("policy", 10, str(adapter), load_inplace=True)
    assert sched.hit(reload) == 0
    sched.store(reload, chunks=0)


def test_one_adapter_at_two_paths_under_two_names_shares_kv(tmp_path: Path) -> None:
    """The same files copied to another path (another node's mount), served under another
    name and id: the same KV, so the same keys."""
    sched = Scheduler()
    here = write_adapter(tmp_path / "node-a" / "adapter", seed=7)
    there = tmp_path / "node-b" / "mounted-elsewhere"
    shutil.copytree(here, there)
    assert adapter_fingerprint(here) == adapter_fingerprint(there)
    sched.store(LoRARequest("support", 1, str(here)))
    assert sched.hit(LoRARequest("helpdesk", 9, str(there))) == HIT


def test_an_adapter_that_is_not_a_local_directory_is_keyed_by_name_and_path(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A path kvtier cannot read (a hub id that vLLM resolves in its workers): name and path,
    as vLLM's block hash, logged once."""
    sched = Scheduler()
    remote = LoRARequest("support", 1, "org/support-adapter")
    with caplog.at_level(logging.WARNING, logger="kvtier.integrations.vllm.scheduler.request_keys"):
        sched.store(remote)
        assert sched.hit(LoRARequest("support", 1, "org/support-adapter")) == HIT
    assert sum("keyed by its name and path" in r.getMessage() for r in caplog.records) == 1
    assert sched.hit(LoRARequest("support", 1, "org/other-adapter")) == 0
    assert sched.hit(LoRARequest("other", 1, "org/support-adapter")) == 0
    # A local adapter of that name is keyed by its content: not the remote one's KV.
    local = write_adapter(tmp_path / "support", seed=1)
    assert sched.hit(LoRARequest("support", 1, str(local))) == 0


def test_the_fingerprint_covers_every_file_and_is_computed_once_per_version(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    adapter = write_adapter(tmp_path / "a", seed=1)
    digest = adapter_fingerprint(adapter)
    assert digest is not None and len(digest) == 32
    assert adapter_fingerprint(tmp_path / "missing") is None
    assert adapter_fingerprint(adapter / "adapter_config.json") is None  # a file, not a dir
    reads: list[str] = []
    real_open = open

    def counting_open(path: object, *args: object, **kwargs: object) -> object:
        reads.append(str(path))
        return real_open(path, *args, **kwargs)  # type: ignore[call-overload]

    monkeypatch.setattr("builtins.open", counting_open)
    assert adapter_fingerprint(adapter) == digest
    assert reads == []  # the same files (names, sizes, mtimes): not read again
    config = json.loads((adapter / "adapter_config.json").read_text())
    config["lora_alpha"] = 16  # scales the adapter's output: other KV
    (adapter / "adapter_config.json").write_text(json.dumps(config))
    os.utime(adapter / "adapter_config.json", ns=(2, 2))
    assert adapter_fingerprint(adapter) != digest


def test_a_waiting_request_whose_adapter_changed_is_not_looked_up_again(
        tmp_path: Path) -> None:
    """A request looked up before its adapter's files changed and asked again later (it
    waited for blocks, or was preempted): its keys name the old content, which a worker that
    evicted the adapter no longer computes with, so it is not looked up again (as its stores
    are not: `adapter_unchanged`)."""
    sched = Scheduler()
    adapter = write_adapter(tmp_path / "policy", seed=1)
    sched.store(LoRARequest("policy", 10, str(adapter)))
    waiting = sched.request(LoRARequest("policy", 10, str(adapter)))
    assert sched.sched.get_num_new_matched_tokens(waiting, 0)[0] == HIT
    write_adapter(adapter, seed=2)
    os.utime(adapter / "adapter_model.safetensors", ns=(1, 1))
    sched.sched.build_connector_meta(SimpleNamespace(  # type: ignore[arg-type]
        scheduled_new_reqs=[], preempted_req_ids=set(), num_scheduled_tokens={},
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], new_block_ids=[],
                                              num_computed_tokens=[], resumed_req_ids=set())))
    assert sched.sched.get_num_new_matched_tokens(waiting, 0)[0] == 0  # the next step's ask


def test_adapters_keyed_by_name_and_path_are_remembered_as_logged_up_to_a_bound(
        caplog: pytest.LogCaptureFixture) -> None:
    """The adapters whose fallback was logged are an LRU of `MAX_WARNED_ADAPTERS`: each logged
    once while remembered, the least recently seen forgotten (logged again if it comes back),
    so a stream of distinct unreadable adapters holds bounded memory."""
    bound = request_keys.MAX_WARNED_ADAPTERS

    def remote(i: int) -> LoRARequest:
        return LoRARequest(f"bounded-{i}", 1, f"org/bounded-adapter-{i}")

    def warnings_for(lora: LoRARequest) -> int:
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger=request_keys.__name__):
            request_keys.lora_identity(lora)
        return sum("keyed by its name and path" in r.getMessage() for r in caplog.records)

    assert warnings_for(remote(0)) == 1
    assert warnings_for(remote(1)) == 1
    assert warnings_for(remote(0)) == 0  # remembered, and now the most recently seen
    for i in range(2, bound + 1):  # `bound` adapters seen since remote(1): it is forgotten
        assert warnings_for(remote(i)) == 1
    assert warnings_for(remote(0)) == 0
    assert warnings_for(remote(1)) == 1
    assert warnings_for(remote(bound)) == 0
