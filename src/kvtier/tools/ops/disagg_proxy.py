"""kvtier's disaggregated-prefill proxy: one OpenAI-compatible front over a prefill instance
and a decode instance that share a kvtier tier (a `shared` directory or Redis).

Each `/v1/completions` (or `/v1/chat/completions`) request goes

1. to the prefill instance (`kv_role: kv_producer`) with `max_tokens` 1, not streamed: it
   computes the prompt's KV and kvtier stores it; a producer's step waits until its chunks
   reached every tier, so they are in the shared tier when this response returns;
2. then, unchanged, to the decode instance (`kv_role: kv_consumer`), whose kvtier finds the
   prompt's whole chunks in the shared tier, loads them and decodes. Its answer, streamed or
   not, is passed back byte for byte with its status.

Both instances get the same body apart from the prefill's length fields, so `cache_salt`
reaches both: kvtier's keys include the salt, and a prompt prefilled under one salt is never
served to a request under another. The prefill's `kv_transfer_params`, when it returns any
(a MultiConnector composing kvtier with NixlConnector), go to the decode request.

A prefill that fails for a bad request (4xx) is the answer (the decode instance would
refuse it too); one that fails otherwise (5xx, refused connection, timeout, a reply that is
not a JSON object) is logged and the request goes to the decode instance alone, which
computes the prompt itself: a prefill instance down costs time to first token, never a
request. A prefill has its own, shorter limit (`prefill_timeout_s`, 60 s): one that hangs
costs that, not the whole `request_timeout_s`, before the decode instance takes over. A
decode instance's 5xx answer is passed back as it is, and counted. A decode instance that
cannot be reached or does not answer in time is a 502 with a JSON error; one that fails
after its answer began (a stream cut off, a stream past the timeout) ends the stream with an
SSE error event (`data: {"error": ...}`) and no `[DONE]`, or cuts an unstreamed answer's
connection, so that a client never takes half an answer for a whole one. Each of these is
counted on the proxy's `/metrics` (`ProxyStats`).

Primitives: `ProxyConfig`, `ProxyStats`, `prefill_body(body)`, `build_app(config)`,
`run_proxy(config)` (blocking, the `kvtier proxy` command), `running_proxy(config)` (in a
thread: tests, benches).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
from collections.abc import AsyncIterator, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web

logger = logging.getLogger(__name__)

# The request paths forwarded through prefill then decode.
GENERATE_PATHS = ("/v1/completions", "/v1/chat/completions")
# Fields the prefill request drops: its length is 1 token, and it is never streamed.
_PREFILL_DROPS = ("max_completion_tokens", "min_tokens", "stream_options")
# Request headers passed on to both instances (an API key; vLLM's request id).
_FORWARDED_HEADERS = ("Authorization", "X-Request-Id")


@dataclass(frozen=True, slots=True)
class ProxyConfig:
    """Where the proxy listens and which instances it fronts."""

    prefill_url: str  # the kv_producer instance's base URL, e.g. http://10.0.0.1:8100
    decode_url: str  # the kv_consumer instance's base URL
    host: str = "127.0.0.1"  # listen address
    port: int = 8000  # listen port
    request_timeout_s: float = 600.0  # one upstream request's limit, streaming included
    # A prefill's limit (request_timeout_s if that is lower); past it the decode instance
    # computes the prompt itself.
    prefill_timeout_s: float = 60.0


@dataclass(slots=True)
class ProxyStats:
    """What the proxy has done, as counters (`/metrics`, Prometheus text). Updated on the
    proxy's event loop only, so no lock."""

    requests: int = 0  # generate requests taken (a body that is not a JSON object excluded)
    prefill_refused: int = 0  # answered by the prefill instance's 4xx
    prefill_failed: int = 0  # prefill failed otherwise: the decode instance computed it
    prefill_timed_out: int = 0  # of prefill_failed: no answer within prefill_timeout_s
    decode_failed: int = 0  # decode unreachable or no answer in time: a 502
    decode_error_status: int = 0  # decode answered 5xx: passed back as it is
    decode_cut: int = 0  # decode failed after its answer began: the answer was cut off
    client_gone: int = 0  # the client hung up before the answer's end (not a failure)

    def exposition(self) -> str:
        """The counters in Prometheus' text format."""
        lines = []
        for name, value, about in (
                ("requests", self.requests, "generate requests taken"),
                ("prefill_refused", self.prefill_refused,
                 "requests the prefill instance refused (4xx), its answer passed back"),
                ("prefill_failed", self.prefill_failed,
                 "prefills that failed (5xx, down, timeout): the decode instance computed"),
                ("prefill_timed_out", self.prefill_timed_out,
                 "prefills past the prefill timeout (also in prefill_failed)"),
                ("decode_failed", self.decode_failed,
                 "requests answered 502: the decode instance down or past the timeout"),
                ("decode_error_status", self.decode_error_status,
                 "decode answers with a 5xx status, passed back to the client"),
                ("decode_cut", self.decode_cut,
                 "answers cut off: the decode instance failed after its answer began"),
                ("client_gone", self.client_gone,
                 "answers the client hung up on before their end")):
            metric = f"kvtier_proxy_{name}_total"
            lines += [f"# HELP {metric} {about}", f"# TYPE {metric} counter",
                      f"{metric} {value}"]
        return "\n".join(lines) + "\n"


_APP_CONFIG = web.AppKey("config", ProxyConfig)
_APP_HTTP = web.AppKey("http", aiohttp.ClientSession)
_APP_STATS = web.AppKey("stats", ProxyStats)


def prefill_body(body: Mapping[str, Any]) -> dict[str, Any]:
    """The prefill instance's request for `body`: the same prompt and fields (cache_salt
    included), one token, not streamed, one choice."""
    out = {k: v for k, v in body.items() if k not in _PREFILL_DROPS}
    out.update(max_tokens=1, stream=False, n=1)
    return out


def build_app(config: ProxyConfig) -> web.Application:
    """The proxy's aiohttp application (its client session opens with the app)."""
    app = web.Application()
    app[_APP_CONFIG] = config
    app[_APP_STATS] = ProxyStats()
    app.cleanup_ctx.append(_client_session)
    for path in GENERATE_PATHS:
        app.router.add_post(path, _generate)
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/health", _health)
    app.router.add_get("/metrics", _metrics)
    return app


async def _client_session(app: web.Application) -> AsyncIterator[None]:
    timeout = aiohttp.ClientTimeout(total=app[_APP_CONFIG].request_timeout_s)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        app[_APP_HTTP] = http
        yield


async def _generate(request: web.Request) -> web.StreamResponse:
    config, http = request.app[_APP_CONFIG], request.app[_APP_HTTP]
    stats = request.app[_APP_STATS]
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        return web.json_response({"error": {"message": "the body is not JSON"}}, status=400)
    if not isinstance(body, dict):
        return web.json_response({"error": {"message": "the body is not an object"}},
                                 status=400)
    stats.requests += 1
    headers = {h: request.headers[h] for h in _FORWARDED_HEADERS if h in request.headers}
    prefill_limit_s = min(config.prefill_timeout_s, config.request_timeout_s)
    try:
        async with http.post(config.prefill_url + request.path, json=prefill_body(body),
                             headers=headers,
                             timeout=aiohttp.ClientTimeout(total=prefill_limit_s)) as prefill:
            answer = await prefill.read()
            if 400 <= prefill.status < 500:
                stats.prefill_refused += 1
                return web.Response(body=answer, status=prefill.status,
                                    content_type=prefill.content_type)
            if prefill.status != 200:
                raise aiohttp.ClientResponseError(prefill.request_info, (),
                                                  status=prefill.status)
            reply = json.loads(answer)
            if not isinstance(reply, dict):
                raise ValueError(f"its answer is JSON {type(reply).__name__}, not an object")
            params = reply.get("kv_transfer_params")
            if params:
                body = {**body, "kv_transfer_params": params}
    except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
        stats.prefill_failed += 1
        if isinstance(exc, TimeoutError):
            stats.prefill_timed_out += 1
        logger.warning("kvtier proxy: prefill at %s failed (%s); the decode instance "
                       "computes the prompt itself", config.prefill_url,
                       _describe(exc, prefill_limit_s))
    return await _relay(request, http, config.decode_url + request.path, body, headers)


async def _relay(request: web.Request, http: aiohttp.ClientSession, url: str,
                 body: Mapping[str, Any], headers: Mapping[str, str]) -> web.StreamResponse:
    """POST `body` to `url` and pass its response back as it arrives."""
    stats = request.app[_APP_STATS]
    response: web.StreamResponse | None = None
    try:
        async with http.post(url, json=body, headers=headers) as upstream:
            if upstream.status >= 500:
                stats.decode_error_status += 1
                logger.warning("kvtier proxy: the decode instance answered %d; passed back",
                               upstream.status)
            response = web.StreamResponse(status=upstream.status, headers={
                "Content-Type": upstream.headers.get("Content-Type", "application/json")})
            await response.prepare(request)
            async for data in upstream.content.iter_any():
                await response.write(data)
            await response.write_eof()
            return response
    except (TimeoutError, aiohttp.ClientError) as exc:
        limit_s = request.app[_APP_CONFIG].request_timeout_s
        message = f"decode instance: {_describe(exc, limit_s)}"
        if response is None:  # nothing sent yet: a plain 502
            stats.decode_failed += 1
            logger.warning("kvtier proxy: %s", message)
            return web.json_response({"error": {"message": message}}, status=502)
        if request.transport is None or request.transport.is_closing():
            stats.client_gone += 1  # the write to the client failed, not the decode
            logger.debug("kvtier proxy: the client hung up before the answer's end")
            return response
        stats.decode_cut += 1
        logger.warning("kvtier proxy: %s, after its answer began: answer cut off", message)
        return await _cut_off(request, response, message)


async def _cut_off(request: web.Request, response: web.StreamResponse,
                   message: str) -> web.StreamResponse:
    """End an answer whose upstream failed midway so that the client sees it failed: a
    stream gets an error event (as vLLM sends one) and no `[DONE]`; another body cannot be
    marked, so its connection is closed before the body's end."""
    if response.content_type == "text/event-stream":
        event = json.dumps({"error": {"message": message, "type": "BadGateway",
                                      "code": 502}})
        with contextlib.suppress(ConnectionError, RuntimeError):
            await response.write(f"data: {event}\n\n".encode())
            await response.write_eof()
        return response
    if request.transport is not None:
        request.transport.close()
    return response


async def _models(request: web.Request) -> web.Response:
    config, http = request.app[_APP_CONFIG], request.app[_APP_HTTP]
    try:
        async with http.get(config.decode_url + "/v1/models") as upstream:
            return web.Response(body=await upstream.read(), status=upstream.status,
                                content_type=upstream.content_type)
    except (TimeoutError, aiohttp.ClientError) as exc:
        why = _describe(exc, config.request_timeout_s)
        return web.json_response({"error": {"message": f"decode instance: {why}"}},
                                 status=502)


def _describe(exc: BaseException, limit_s: float) -> str:
    """An upstream failure in one line (a timeout's own message is empty): `limit_s` is the
    timeout that applied."""
    if isinstance(exc, TimeoutError):
        return f"no answer within {limit_s:g} s"
    return str(exc) or type(exc).__name__


async def _metrics(request: web.Request) -> web.Response:
    return web.Response(text=request.app[_APP_STATS].exposition(),
                        content_type="text/plain", charset="utf-8")


async def _health(request: web.Request) -> web.Response:
    """200 when both instances answer their /health with 200, else 503 naming them."""
    config, http = request.app[_APP_CONFIG], request.app[_APP_HTTP]
    down = []
    for name, url in (("prefill", config.prefill_url), ("decode", config.decode_url)):
        try:
            async with http.get(url + "/health", timeout=aiohttp.ClientTimeout(total=5)) as r:
                if r.status != 200:
                    down.append(name)
        except (TimeoutError, aiohttp.ClientError):
            down.append(name)
    return web.json_response({"down": down}, status=503 if down else 200)


def run_proxy(config: ProxyConfig) -> None:
    """Serve until interrupted (the `kvtier proxy` command). Main thread."""
    logger.info("kvtier proxy on http://%s:%d: prefill %s, decode %s", config.host,
                config.port, config.prefill_url, config.decode_url)
    web.run_app(build_app(config), host=config.host, port=config.port, print=None)


@contextlib.contextmanager
def running_proxy(config: ProxyConfig) -> Iterator[str]:
    """Serve on a thread of its own; yields the proxy's URL, stops it on exit.

    Raises:
        OSError: the port could not be bound.
    """
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(build_app(config), access_log=None)  # a bench's tables stay clean
    loop.run_until_complete(runner.setup())
    site = web.TCPSite(runner, config.host, config.port)
    loop.run_until_complete(site.start())
    thread = threading.Thread(target=loop.run_forever, name="kvtier-proxy", daemon=True)
    thread.start()
    try:
        yield f"http://{config.host}:{config.port}"
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
        loop.run_until_complete(runner.cleanup())
        loop.close()
