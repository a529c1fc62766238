"""retain_s / ttl_s per request: read from kv_transfer_params, carried by each planned chunk,
and turned into a pin / expiry by the worker (`chunk_meta`). Pure scheduler logic on real
vLLM `Request`s, as in test_connector_scheduler.py (whose `Engine` driver is reused)."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from test_connector_scheduler import Engine, request

from kvtier.core.retention import DEFAULT_META, tenant_id, tenant_label
from kvtier.integrations.vllm.config import RequestControls
from kvtier.integrations.vllm.messages import chunk_meta


def test_controls_are_read_and_bad_values_ignored() -> None:
    controls = RequestControls.from_params({"retain_s": 3600, "ttl_s": 600.5})
    assert (controls.retain_s, controls.ttl_s) == (3600.0, 600.5)
    for bad in (0, -1, "1h", True, float("nan"), 1e12):
        assert RequestControls.from_params({"retain_s": bad, "ttl_s": bad}) == RequestControls()


def test_kv_transfer_params_not_an_object_are_ignored_by_the_scheduler(
        caplog: pytest.LogCaptureFixture) -> None:
    """vLLM's offline API hands `extra_args["kv_transfer_params"]` over as given: a list, a
    string or a number raised AttributeError on the scheduler's thread (the engine down)."""
    engine = Engine()
    for i, params in enumerate(([("skip_load", True)], "skip_load", 5)):
        req = request(f"r{i}", 200, params=params)  # type: ignore[arg-type]
        with caplog.at_level("DEBUG", logger="kvtier"):
            engine.admit(req, list(range(7)))
        assert f"ignoring kv_transfer_params={params!r}" in caplog.text
        engine.sched.request_finished(req)


def test_bad_params_of_api_users_are_logged_bounded_once_per_field(
        caplog: pytest.LogCaptureFixture) -> None:
    """kv_transfer_params come from API users (an OpenAI request's extra body): a bad value
    was logged in full, at warning, on every request, so a client could flood the engine's
    log with text of its own (newlines, escapes, megabytes). Now its repr, bounded, at
    warning once per field, then at debug, each counted (ignored_request_params)."""
    engine = Engine()
    flood = "x" * 100_000 + "\nINFO forged line\x1b[31m"
    for i in range(20):
        req = request(f"r{i}", 200, params={"skip_load": flood, "ttl_s": [flood] * 1000})
        with caplog.at_level("DEBUG", logger="kvtier"):
            engine.admit(req, list(range(7)))
        engine.sched.request_finished(req)
    ours = [r for r in caplog.records if "kv_transfer_params" in r.getMessage()]
    assert len(ours) == 40
    assert [r.levelname for r in ours].count("WARNING") == 2  # skip_load's, ttl_s's
    assert {r.getMessage().split("=")[0] for r in ours if r.levelname == "WARNING"} == {
        "kvtier: ignoring kv_transfer_params.skip_load",
        "kvtier: ignoring kv_transfer_params.ttl_s"}
    for record in ours:
        text = record.getMessage()
        assert len(text) < 400 and "\n" not in text and "\x1b" not in text
    counters = engine.sched.take_stats().data["counters"]
    assert counters["ignored_request_params"] == {"": 40}


def test_stores_carry_the_salt_pin_and_ttl_and_held_chunks_are_retained() -> None:
    engine = Engine()
    req = request("a", 200, salt="tenant-1", params={"retain_s": 60, "ttl_s": 120})
    engine.admit(req, list(range(7)))
    meta = engine.step(new={"a": (list(range(7)), 0, 200)})
    assert [(t.tenant, t.retain_s, t.ttl_s) for t in meta.stores] == [("tenant-1", 60, 120)] * 3
    stored = engine.store_all(meta)
    pinned = chunk_meta(meta.stores[0])
    # The tiers get the tenant's id (a hash), never its salt.
    assert pinned is not None and pinned.tenant == tenant_id("tenant-1") != "tenant-1"
    assert pinned.expires_at is not None and pinned.retain_until is not None
    assert pinned.expires_at - pinned.retain_until == pytest.approx(60, abs=1)
    engine.sched.request_finished(req)
    # The same prompt again, all of it in vLLM's own prefix cache (nothing for kvtier to
    # load or store): its chunks are retained (pins extended) anyway.
    again = request("b", 200, salt="tenant-1", params={"retain_s": 600})
    assert engine.admit(again, list(range(7)), local_tokens=192) == 0
    meta = engine.step(new={"b": (list(range(7)), 192, 8)})
    assert meta.stores == []
    assert [(t.key, t.retain_s) for t in meta.retains] == [(k, 600) for k in stored]
    # Each names its parent: a pin's end puts the chunk back under it ("prefix" policy).
    assert [t.parent for t in meta.retains] == [None, *stored[:-1]]
    # A request without retain_s / ttl_s retains nothing; its meta asks nothing.
    plain = request("c", 200, first=7000)
    engine.admit(plain, list(range(20, 27)))
    meta = engine.step(new={"c": (list(range(20, 27)), 0, 200)})
    assert meta.retains == [] and chunk_meta(meta.stores[0]) == DEFAULT_META


def test_a_tenants_label_is_the_same_from_its_salt_or_its_id() -> None:
    assert tenant_label("tenant-1") == tenant_label(tenant_id("tenant-1")) == \
        "t-" + (tenant_id("tenant-1") or "")[:8]


def test_prefix_pins_reach_only_the_chunks_within_their_prefix() -> None:
    # What a cache_control marker asks (cachecontrol.py): the first 130 tokens for 600 s.
    engine = Engine()
    req = request("a", 200, params={"retain_prefixes": [{"tokens": 130, "retain_s": 600}]})
    engine.admit(req, list(range(7)))
    meta = engine.step(new={"a": (list(range(7)), 0, 200)})
    assert [t.retain_s for t in meta.stores] == [600, 600, None]  # chunks end at 64, 128, 192
    stored = engine.store_all(meta)
    engine.sched.request_finished(req)
    # The same prompt again from vLLM's own cache, its marker now after 70 tokens: only the
    # first chunk's pin is extended.
    again = request("b", 200, params={"retain_prefixes": [{"tokens": 70, "retain_s": 900}]})
    assert engine.admit(again, list(range(7)), local_tokens=192) == 0
    meta = engine.step(new={"b": (list(range(7)), 192, 8)})
    assert [(t.key, t.retain_s) for t in meta.retains] == [(stored[0], 900)]
