"""Anthropic's `cache_control` markers on vLLM's OpenAI server, turned into kvtier pins.

Agent SDKs, Dynamo (`nvext.cache_control`) and SGLang mark what to keep with
`{"type": "ephemeral", "ttl": "5m"}` on a chat message or one of its content parts: the prompt
up to and including it is to stay cached for the TTL. vLLM ignores the marker; this ASGI
middleware (vLLM's `--middleware`, which `kvtier serve` adds) strips it from the request body
and merges into the request's `kv_transfer_params` what kvtier's connector reads
(config.RequestControls):

  - a marker before the prompt's end (a system prompt, an earlier turn):
    `retain_prefixes: [{"tokens": N, "retain_s": TTL}]`, N counted by the server's own
    `/tokenize` of the messages up to the marker (chat template applied): only the chunks
    that end within those N tokens are pinned;
  - a marker at the prompt's end (on the last message, the body's top level,
    `nvext.cache_control`, any marker of `/v1/completions` or Anthropic's `/v1/messages`):
    `retain_s: TTL`, the whole prompt.

A pin is extended by every later request carrying the same marker (core/retention.py
`RetentionBook.retain`), counts against the tier's `max_pinned_share`, and one refused there
is counted (`vllm:kvtier_tier_pins_refused_total`). A malformed marker is answered 400 naming
the field. docs/retention.md has the details.

Primitives:
  - `CacheControlMiddleware(app)`: the ASGI middleware; `MIDDLEWARE`: its --middleware path.
  - `Marker` (frozen), `take_markers(body, path)`: a request's markers, validated and
    stripped from `body`; `parse_ttl(value, field)`: "5m", "1h", "30s", or seconds.
  - `pin_params(markers, prefix_tokens)`: the kv_transfer_params entries for the markers.

Imports neither vLLM nor starlette: plain ASGI, so it is tested without a server.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

from kvtier.errors import RequestFieldError

logger = logging.getLogger(__name__)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]

# vLLM's `--middleware` argument that loads this middleware.
MIDDLEWARE = f"{__name__}.CacheControlMiddleware"
CHAT, COMPLETIONS, MESSAGES = "/v1/chat/completions", "/v1/completions", "/v1/messages"
# Anthropic's default TTL, and its limit on markers per request (more are a 400 there too;
# here each marker before the prompt's end costs one /tokenize).
DEFAULT_TTL_S = 300.0
MAX_MARKERS = 4
_TTL = re.compile(r"^([1-9][0-9]{0,6})([smh])$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600}
TTL_FORMS = ('"5m" (the default) or "1h" as Anthropic documents them, any "<N>s", "<N>m" or '
             '"<N>h" (Dynamo\'s forms), or a number of seconds > 0')


@dataclass(frozen=True, slots=True)
class Marker:
    """One `cache_control` marker of a request."""

    field: str  # its path in the request body, e.g. "messages[0].content[1].cache_control"
    ttl_s: float  # how long the prefix up to it is to be kept
    # The chat messages up to it: (message index, content parts of it kept or None for the
    # whole message); None: the marker covers the whole prompt.
    upto: tuple[int, int | None] | None


def parse_ttl(value: Any, field: str) -> float:
    """Seconds from a marker's `ttl` (see TTL_FORMS). Raises RequestFieldError naming `field`."""
    if isinstance(value, str) and (match := _TTL.match(value)):
        return float(int(match[1]) * _UNIT_S[match[2]])
    if isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < 1e9:
        return float(value)
    raise RequestFieldError(field, value, TTL_FORMS)


def _marker(node: Any, field: str, upto: tuple[int, int | None] | None,
            found: list[Marker]) -> None:
    """Validate and strip `node["cache_control"]`, if any, appending it to `found`."""
    if not isinstance(node, dict) or "cache_control" not in node:
        return
    field = f"{field}.cache_control" if field else "cache_control"
    control = node.pop("cache_control")
    if control is None:
        return
    if not isinstance(control, dict):
        raise RequestFieldError(field, control, 'an object {"type": "ephemeral", "ttl": "5m"}')
    if control.get("type") != "ephemeral":
        raise RequestFieldError(f"{field}.type", control.get("type"), '"ephemeral"')
    ttl_s = parse_ttl(control["ttl"], f"{field}.ttl") if "ttl" in control else DEFAULT_TTL_S
    found.append(Marker(field, ttl_s, upto))


def _parts(content: Any, field: str, message: int | None, found: list[Marker]) -> None:
    """The markers of a list of content parts (message `message`'s, or None: the whole
    prompt's)."""
    if isinstance(content, list):
        for j, part in enumerate(content):
            upto = None if message is None else (message, j)
            _marker(part, f"{field}[{j}]", upto, found)


def take_markers(body: dict[str, Any], path: str) -> list[Marker]:
    """The `cache_control` markers of a request to `path` (CHAT, COMPLETIONS or MESSAGES),
    removed from `body` (which is modified). A chat marker at the prompt's end (on the last
    message, or its last part) covers the whole prompt (`upto` None), as every marker of the
    other two paths does.

    Raises:
        RequestFieldError: a malformed marker, or more than MAX_MARKERS.
    """
    found: list[Marker] = []
    _marker(body, "", None, found)
    _marker(body.get("nvext"), "nvext", None, found)
    if body.get("nvext") == {}:
        del body["nvext"]
    chat = path == CHAT
    tools = body.get("tools")
    messages = body.get("messages")
    if isinstance(tools, list):
        for i, tool in enumerate(tools):
            # Tools come first in a rendered prompt: pinned with the first message.
            _marker(tool, f"tools[{i}]", (0, None) if chat else None, found)
    if path == MESSAGES:
        _parts(body.get("system"), "system", None, found)
    if isinstance(messages, list):
        for i, message in enumerate(messages):
            if not isinstance(message, dict):
                continue
            _marker(message, f"messages[{i}]", (i, None) if chat else None, found)
            _parts(message.get("content"), f"messages[{i}].content", i if chat else None,
                   found)
    # A prefix to count needs a well-formed conversation (else vLLM refuses the request).
    chat_messages = messages if isinstance(messages, list) and messages \
        and all(isinstance(m, dict) for m in messages) else None
    found = [m if m.upto is None or (chat_messages is not None
                                     and not _ends(m.upto, chat_messages)) else
             Marker(m.field, m.ttl_s, None) for m in found]
    if len(found) > MAX_MARKERS:
        raise RequestFieldError("cache_control", f"{len(found)} markers",
                                f"at most {MAX_MARKERS} per request (Anthropic's limit)")
    return found


def _ends(upto: tuple[int, int | None], messages: list[dict[str, Any]]) -> bool:
    """Whether the prefix `upto` is the whole conversation."""
    message, part = upto
    last = len(messages) - 1
    if message != last:
        return False
    content = messages[last].get("content")
    return part is None or not isinstance(content, list) or part == len(content) - 1


def prefix_messages(messages: list[Any], upto: tuple[int, int | None]) -> list[Any]:
    """The messages of a chat request up to a marker: those before its message, and its
    message whole or up to and including the marked content part."""
    message, part = upto
    head = list(messages[:message + 1])
    if part is not None:
        head[-1] = {**head[-1], "content": head[-1]["content"][:part + 1]}
    return head


def pin_params(markers: list[Marker], prefix_tokens: dict[Marker, int]) -> dict[str, Any]:
    """The kv_transfer_params entries for `markers`: `retain_s` (the longest TTL of those
    covering the whole prompt, or of a marker whose prefix length is unknown) and
    `retain_prefixes` (one per marker of `prefix_tokens`, its prefix length in tokens)."""
    params: dict[str, Any] = {}
    whole = [m.ttl_s for m in markers if m not in prefix_tokens]
    if whole:
        params["retain_s"] = max(whole)
    prefixes = [{"tokens": prefix_tokens[m], "retain_s": m.ttl_s} for m in markers
                if m in prefix_tokens]
    if prefixes:
        params["retain_prefixes"] = prefixes
    return params


def merge_params(body: dict[str, Any], params: dict[str, Any]) -> None:
    """Merge `params` into the body's kv_transfer_params: a longer retain_s wins, prefixes
    add up; the client's other keys are kept."""
    current = body.get("kv_transfer_params")
    if current is not None and not isinstance(current, dict):
        raise RequestFieldError("kv_transfer_params", current, "an object")
    merged = dict(current or {})
    if "retain_s" in params:
        given = merged.get("retain_s")
        keep = isinstance(given, (int, float)) and not isinstance(given, bool) \
            and given > params["retain_s"]
        merged["retain_s"] = given if keep else params["retain_s"]
    if "retain_prefixes" in params:
        given = merged.get("retain_prefixes")
        merged["retain_prefixes"] = (given if isinstance(given, list) else []) \
            + params["retain_prefixes"]
    body["kv_transfer_params"] = merged


class CacheControlMiddleware:
    """ASGI middleware: requests to CHAT, COMPLETIONS and MESSAGES whose body mentions
    `cache_control` get their markers turned into kv_transfer_params (module doc); a
    malformed marker is answered 400. Every other request passes through untouched.
    Runs on the server's event loop."""

    def __init__(self, app: App) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = str(scope.get("path", "")).removeprefix(str(scope.get("root_path", "")))
        if scope.get("type") != "http" or scope.get("method") != "POST" \
                or path not in (CHAT, COMPLETIONS, MESSAGES):
            await self.app(scope, receive, send)
            return
        raw = await _read_body(receive)
        body = None
        if b"cache_control" in raw:  # most requests are not parsed here at all
            try:
                body = json.loads(raw)
            except ValueError:
                body = None  # vLLM answers a body that is not JSON
        if isinstance(body, dict):
            try:
                raw = await self._rewrite(scope, body, path) or raw
            except RequestFieldError as exc:
                await _answer_400(send, exc, anthropic=path == MESSAGES)
                return
        await self.app(_with_length(scope, len(raw)), _replay(raw, receive), send)

    async def _rewrite(self, scope: Scope, body: dict[str, Any], path: str) -> bytes | None:
        """The request's new body (markers stripped, pins in kv_transfer_params), or None
        when it has no marker."""
        markers = take_markers(body, path)
        if not markers:
            return None
        prefix_tokens: dict[Marker, int] = {}
        for marker in markers:
            if marker.upto is not None:
                tokens = await self._count_prefix(scope, body, marker.upto)
                if tokens is not None:
                    prefix_tokens[marker] = tokens
        merge_params(body, pin_params(markers, prefix_tokens))
        return json.dumps(body).encode()

    async def _count_prefix(self, scope: Scope, body: dict[str, Any],
                            upto: tuple[int, int | None]) -> int | None:
        """The tokens of the chat prompt up to a marker, from the server's own /tokenize
        (called in-process, through the middlewares inside this one: API keys apply);
        None if it failed (then the whole prompt is pinned, and that is logged)."""
        query = {"messages": prefix_messages(body["messages"], upto),
                 "add_generation_prompt": False}
        for key in ("model", "tools", "chat_template", "chat_template_kwargs",
                    "mm_processor_kwargs"):
            if key in body:
                query[key] = body[key]
        raw = json.dumps(query).encode()
        sub = {**_with_length(scope, len(raw)), "path": "/tokenize", "raw_path": b"/tokenize",
               "query_string": b""}
        status, reply = await _call(self.app, sub, raw)
        try:
            count = json.loads(reply)["count"] if status == 200 else None
        except (ValueError, KeyError, TypeError):
            count = None
        if not isinstance(count, int) or count < 1:
            logger.warning("kvtier: cache_control: /tokenize of the prefix answered %s; "
                           "pinning the whole prompt", status)
            return None
        return count


async def _read_body(receive: Receive) -> bytes:
    chunks = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            break
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            break
    return b"".join(chunks)


def _replay(raw: bytes, receive: Receive) -> Receive:
    """A receive that gives `raw` as the whole body, then the client's later messages (its
    disconnect)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": raw, "more_body": False}
        return await receive()
    return replay


def _with_length(scope: Scope, length: int) -> Scope:
    headers = [(k, v) for k, v in scope.get("headers", []) if k.lower() != b"content-length"]
    return {**scope, "headers": [*headers, (b"content-length", str(length).encode())]}


async def _call(app: App, scope: Scope, raw: bytes) -> tuple[int, bytes]:
    """POST `raw` to `app` in-process; its status and body."""
    done = asyncio.Event()
    sent = False
    status, chunks = 500, []

    async def receive() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": raw, "more_body": False}
        await done.wait()  # no disconnect while the handler works (vLLM listens for one)
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = int(message["status"])
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))
    try:
        await app(scope, receive, send)
    finally:
        done.set()
    return status, b"".join(chunks)


async def _answer_400(send: Send, error: RequestFieldError, *, anthropic: bool) -> None:
    """A 400 in the API's own error shape (OpenAI's, or Anthropic's for /v1/messages)."""
    message = str(error)
    if anthropic:
        payload: dict[str, Any] = {"type": "error", "error": {
            "type": "invalid_request_error", "message": message}}
    else:
        payload = {"error": {"message": message, "type": "BadRequestError",
                             "param": error.field, "code": 400}}
    data = json.dumps(payload).encode()
    await send({"type": "http.response.start", "status": 400,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(data)).encode())]})
    await send({"type": "http.response.body", "body": data})
