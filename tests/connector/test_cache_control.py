"""cache_control markers: found, checked and stripped from a request body, turned into
kv_transfer_params by the ASGI middleware (around a fake vLLM app that answers /tokenize and
records what it was sent), and read back by the connector as per-chunk pins. Pure Python; the
real server is tests/tools/test_cache_control_e2e.py."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from kvtier.errors import RequestFieldError
from kvtier.integrations.vllm.cachecontrol import (
    CHAT,
    COMPLETIONS,
    MESSAGES,
    CacheControlMiddleware,
    parse_ttl,
    take_markers,
)
from kvtier.integrations.vllm.config import PrefixPin, RequestControls

EPHEMERAL = {"type": "ephemeral"}


def test_ttls_anthropic_and_dynamo_forms_and_seconds() -> None:
    assert [parse_ttl(v, "ttl") for v in ("5m", "1h", "30s", "2h", 2, 0.5)] == \
        [300, 3600, 30, 7200, 2, 0.5]
    for bad in ("5 m", "0m", "1d", "", 0, -1, True, None, 1e12, "5M"):
        with pytest.raises(RequestFieldError, match=r"messages\[0\]\.ttl"):
            parse_ttl(bad, "messages[0].ttl")


def conversation() -> dict[str, Any]:
    return {"model": "m", "tools": [{"type": "function", "function": {"name": "f"}}],
            "messages": [
                {"role": "system", "content": [
                    {"type": "text", "text": "rules", "cache_control": {**EPHEMERAL,
                                                                        "ttl": "1h"}},
                    {"type": "text", "text": "more"}]},
                {"role": "user", "content": "question", "cache_control": EPHEMERAL},
                {"role": "assistant", "content": "answer"},
                {"role": "user", "content": [{"type": "text", "text": "again",
                                              "cache_control": EPHEMERAL}]}]}


def test_chat_markers_are_stripped_and_located() -> None:
    body = conversation()
    markers = take_markers(body, CHAT)
    assert [(m.field, m.ttl_s, m.upto) for m in markers] == [
        ("messages[0].content[0].cache_control", 3600, (0, 0)),
        ("messages[1].cache_control", 300, (1, None)),
        ("messages[3].content[0].cache_control", 300, None)]  # the prompt's end: all of it
    assert "cache_control" not in json.dumps(body)
    assert body["messages"][0]["content"][1] == {"type": "text", "text": "more"}


def test_top_level_nvext_completions_and_anthropic_markers_cover_the_whole_prompt() -> None:
    body = {"prompt": "x", "nvext": {"cache_control": {**EPHEMERAL, "ttl": "30s"}},
            "cache_control": EPHEMERAL}
    assert [(m.field, m.ttl_s, m.upto) for m in take_markers(body, COMPLETIONS)] == [
        ("cache_control", 300, None), ("nvext.cache_control", 30, None)]
    assert body == {"prompt": "x"}
    anthropic = {"system": [{"type": "text", "text": "s", "cache_control": EPHEMERAL}],
                 "messages": [{"role": "user", "content": [
                     {"type": "text", "text": "q", "cache_control": EPHEMERAL}]},
                     {"role": "user", "content": "r"}]}
    assert [m.upto for m in take_markers(anthropic, MESSAGES)] == [None, None]


def test_malformed_markers_name_their_field() -> None:
    cases = [({"type": "persistent"}, "messages[0].cache_control.type"),
             ({"type": "ephemeral", "ttl": "forever"}, "messages[0].cache_control.ttl"),
             ("ephemeral", "messages[0].cache_control")]
    for marker, field in cases:
        body = {"messages": [{"role": "user", "content": "q", "cache_control": marker}]}
        with pytest.raises(RequestFieldError) as raised:
            take_markers(body, CHAT)
        assert raised.value.field == field
    five = {"messages": [{"role": "user", "content": "q", "cache_control": EPHEMERAL}] * 5}
    with pytest.raises(RequestFieldError, match="at most 4"):
        take_markers(json.loads(json.dumps(five)), CHAT)


class FakeServer:
    """The app inside the middleware: /tokenize counts 10 tokens per message; every other
    request's body is recorded and answered 200."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.tokenized: list[dict[str, Any]] = []

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        message = await receive()
        body = json.loads(message["body"])
        length = dict(scope["headers"])[b"content-length"]
        assert int(length) == len(message["body"])
        if scope["path"] == "/tokenize":
            self.tokenized.append(body)
            reply = {"count": 10 * len(body["messages"])}
        else:
            self.bodies.append(body)
            reply = {}
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": json.dumps(reply).encode()})


def serve(app: Any, path: str, body: Any, method: str = "POST") -> tuple[int, Any]:
    """One request through `app`; the status and the decoded reply."""
    raw = json.dumps(body).encode()
    scope = {"type": "http", "method": method, "path": path, "root_path": "",
             "headers": [(b"content-type", b"application/json"),
                         (b"content-length", str(len(raw)).encode())]}
    replies: list[Any] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": raw, "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        replies.append(message)

    asyncio.run(app(scope, receive, send))
    return replies[0]["status"], json.loads(replies[1]["body"])


def test_the_middleware_pins_each_marked_prefix_and_keeps_the_clients_params() -> None:
    inner = FakeServer()
    body = conversation()
    body["kv_transfer_params"] = {"ttl_s": 60, "retain_s": 10}
    assert serve(CacheControlMiddleware(inner), CHAT, body) == (200, {})
    [sent] = inner.bodies
    assert "cache_control" not in json.dumps(sent)
    # /tokenize saw the messages up to each marker, without the generation prompt.
    assert [len(q["messages"]) for q in inner.tokenized] == [1, 2]
    assert inner.tokenized[0]["messages"][0]["content"] == [{"type": "text", "text": "rules"}]
    assert inner.tokenized[0]["add_generation_prompt"] is False
    assert inner.tokenized[0]["tools"] == body["tools"]
    assert sent["kv_transfer_params"] == {
        "ttl_s": 60, "retain_s": 300,  # the last marker covers the whole prompt
        "retain_prefixes": [{"tokens": 10, "retain_s": 3600}, {"tokens": 20, "retain_s": 300}]}


def test_requests_without_markers_pass_untouched() -> None:
    inner = FakeServer()
    app = CacheControlMiddleware(inner)
    body = {"prompt": "the words cache_control in a prompt", "kv_transfer_params": None}
    assert serve(app, COMPLETIONS, body) == (200, {})
    assert inner.bodies == [body] and inner.tokenized == []
    serve(app, "/v1/embeddings", {"input": "x", "cache_control": "anything"})
    assert inner.bodies[-1] == {"input": "x", "cache_control": "anything"}


def test_a_malformed_marker_is_a_400_in_the_apis_own_shape() -> None:
    inner = FakeServer()
    app = CacheControlMiddleware(inner)
    status, reply = serve(app, CHAT, {"messages": [
        {"role": "user", "content": "q", "cache_control": {"type": "ephemeral", "ttl": "9y"}}]})
    assert status == 400 and reply["error"]["param"] == "messages[0].cache_control.ttl"
    assert "messages[0].cache_control.ttl='9y'" in reply["error"]["message"]
    status, reply = serve(app, MESSAGES, {"messages": [], "cache_control": {"type": "x"}})
    assert status == 400 and reply["type"] == "error"
    assert "cache_control.type" in reply["error"]["message"]
    assert inner.bodies == []


def test_the_connector_pins_chunks_within_each_prefix() -> None:
    controls = RequestControls.from_params(
        {"retain_prefixes": [{"tokens": 200, "retain_s": 3600}, {"tokens": 500, "retain_s": 60}]})
    assert controls.retain_prefixes == (PrefixPin(200, 3600), PrefixPin(500, 60))
    # 64-token chunks: those ending within 200 tokens get an hour, then a minute, then none.
    assert [controls.retain_s_for(end) for end in (64, 192, 256, 448, 512)] == \
        [3600, 3600, 60, 60, None]
    assert RequestControls(retain_s=120).retain_s_for(10 ** 6) == 120
    for bad in ({"tokens": 0, "retain_s": 5}, {"tokens": 64}, [64, 5], "all"):
        value = bad if isinstance(bad, str) else [bad]
        assert RequestControls.from_params({"retain_prefixes": value}) == RequestControls()


def test_a_marker_in_a_malformed_conversation_pins_the_whole_prompt() -> None:
    # No prefix to count (vLLM refuses such a request itself): no /tokenize, no crash.
    for messages in (None, [], ["not a message"], {"role": "user"}):
        body = {"tools": [{"type": "function", "cache_control": EPHEMERAL}],
                "messages": messages}
        assert [m.upto for m in take_markers(body, CHAT)] == [None]
