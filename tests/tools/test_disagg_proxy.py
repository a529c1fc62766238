"""The disaggregated-prefill proxy in front of two stand-in instances (small aiohttp apps
that answer like vLLM's OpenAI server and record what they were sent): what the prefill
instance is asked, what the decode instance is asked, what comes back, and what happens
when the prefill instance fails. Real vLLM instances: tests/engine/test_disagg_prefill.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from aiohttp import web

from kvtier.tools.ops.disagg_proxy import ProxyConfig, prefill_body, running_proxy
from kvtier.tools.ops.server import free_port


class Instance:
    """A stand-in vLLM OpenAI server on a thread; `bodies` are the requests it got."""

    def __init__(self, name: str, status: int = 200) -> None:
        self.name, self.status = name, status
        self.bodies: list[dict[str, Any]] = []
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        if self.status != 200:
            return web.json_response({"error": {"message": "no"}}, status=self.status)
        if not body.get("stream"):
            return web.json_response({"choices": [{"text": f"{self.name}:{body['max_tokens']}"}]})
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for i in range(3):
            await response.write(f"data: {json.dumps({'choices': [{'text': str(i)}]})}\n\n"
                                 .encode())
        await response.write(b"data: [DONE]\n\n")
        return response

    @contextlib.contextmanager
    def running(self) -> Iterator[Instance]:
        app = web.Application()
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/health", healthy)
        loop = asyncio.new_event_loop()
        runner = web.AppRunner(app)
        loop.run_until_complete(runner.setup())
        loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", self.port).start())
        thread = threading.Thread(target=loop.run_forever, daemon=True)
        thread.start()
        try:
            yield self
        finally:
            loop.call_soon_threadsafe(loop.stop)
            thread.join()
            loop.run_until_complete(runner.cleanup())
            loop.close()


async def healthy(_request: web.Request) -> web.Response:
    return web.Response(text="ok")


@contextlib.contextmanager
def deployment(prefill_status: int = 200, prefill_up: bool = True
               ) -> Iterator[tuple[str, Instance, Instance]]:
    prefill, decode = Instance("prefill", prefill_status), Instance("decode")
    with contextlib.ExitStack() as stack:
        if prefill_up:
            stack.enter_context(prefill.running())
        stack.enter_context(decode.running())
        url = stack.enter_context(running_proxy(ProxyConfig(
            prefill.url, decode.url, port=free_port(), request_timeout_s=10)))
        yield url, prefill, decode


def post(url: str, body: dict[str, Any]) -> tuple[int, bytes]:
    request = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


BODY = {"model": "m", "prompt": [1, 2, 3], "max_tokens": 16, "min_tokens": 4,
        "cache_salt": "tenant-a", "temperature": 0.0}


def test_prefill_gets_one_token_unstreamed_and_decode_the_request_as_sent() -> None:
    with deployment() as (url, prefill, decode):
        status, answer = post(url, BODY)
    assert status == 200 and json.loads(answer)["choices"][0]["text"] == "decode:16"
    assert prefill.bodies == [{**prefill_body(BODY)}]
    assert prefill.bodies[0] == {"model": "m", "prompt": [1, 2, 3], "max_tokens": 1,
                                 "cache_salt": "tenant-a", "temperature": 0.0,
                                 "stream": False, "n": 1}
    assert decode.bodies == [BODY]


def test_a_streamed_answer_comes_back_as_the_decode_instance_streams_it() -> None:
    with deployment() as (url, prefill, decode):
        status, answer = post(url, {**BODY, "stream": True,
                                    "stream_options": {"include_usage": True}})
    assert status == 200
    assert answer.decode().count("data: ") == 4 and answer.endswith(b"data: [DONE]\n\n")
    assert prefill.bodies[0]["stream"] is False and "stream_options" not in prefill.bodies[0]
    assert decode.bodies[0]["stream"] is True


def test_a_bad_request_is_answered_by_the_prefill_instance() -> None:
    with deployment(prefill_status=400) as (url, _prefill, decode):
        status, _ = post(url, BODY)
    assert status == 400 and decode.bodies == []


@pytest.mark.parametrize("failure", ["500", "down"])
def test_a_failed_prefill_leaves_the_prompt_to_the_decode_instance(failure: str) -> None:
    with deployment(prefill_status=500, prefill_up=failure != "down") as (url, _p, decode):
        status, answer = post(url, BODY)
    assert status == 200 and json.loads(answer)["choices"][0]["text"] == "decode:16"
    assert decode.bodies == [BODY]


# -- failures: the client is told, nothing hangs past the timeout, each is counted -------------

class Stalling(Instance):
    """A decode stand-in whose answer begins, then stalls until the proxy hangs up (past its
    timeout; 30 s at most): a stream after its first event, a JSON body after its first
    bytes."""

    def __init__(self) -> None:
        super().__init__("stalling")

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        stream = bool(body.get("stream"))
        response = web.StreamResponse(headers={
            "Content-Type": "text/event-stream" if stream else "application/json"})
        if not stream:
            response.content_length = 1000
        await response.prepare(request)
        await response.write(b'data: {"choices": [{"text": "0"}]}\n\n' if stream
                             else b'{"choices": [')
        deadline = asyncio.get_running_loop().time() + 30
        while (request.transport is not None and not request.transport.is_closing()
               and asyncio.get_running_loop().time() < deadline):
            await asyncio.sleep(0.05)
        return response


class NotAnObject(Instance):
    """A prefill stand-in that answers 200 with JSON that is not an object."""

    async def completions(self, request: web.Request) -> web.StreamResponse:
        self.bodies.append(await request.json())
        return web.json_response(["not", "an", "object"])


def get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def counters(url: str) -> dict[str, float]:
    status, text = get(url + "/metrics")
    assert status == 200
    return {line.split()[0]: float(line.split()[1]) for line in text.decode().splitlines()
            if line.startswith("kvtier_proxy_")}


def test_a_decode_instance_down_is_a_502_with_a_json_error_and_counted() -> None:
    prefill = Instance("prefill")
    with prefill.running(), running_proxy(ProxyConfig(
            prefill.url, f"http://127.0.0.1:{free_port()}", port=free_port(),
            request_timeout_s=10)) as url:
        status, answer = post(url, BODY)
        assert status == 502 and "decode instance" in json.loads(answer)["error"]["message"]
        status, answer = get(url + "/v1/models")  # was a 500 and a traceback
        assert status == 502 and "decode instance" in json.loads(answer)["error"]["message"]
        seen = counters(url)
    assert seen["kvtier_proxy_requests_total"] == 1
    assert seen["kvtier_proxy_decode_failed_total"] == 1
    assert seen["kvtier_proxy_prefill_failed_total"] == 0


def test_a_prefill_answer_that_is_not_an_object_leaves_the_prompt_to_decode() -> None:
    prefill, decode = NotAnObject("prefill"), Instance("decode")
    with prefill.running(), decode.running(), running_proxy(ProxyConfig(
            prefill.url, decode.url, port=free_port(), request_timeout_s=10)) as url:
        status, answer = post(url, BODY)  # was a 500: 'list' object has no attribute 'get'
        seen = counters(url)
    assert status == 200 and json.loads(answer)["choices"][0]["text"] == "decode:16"
    assert seen["kvtier_proxy_prefill_failed_total"] == 1


def test_a_stream_cut_off_past_the_timeout_ends_with_an_error_event_not_done() -> None:
    prefill, decode = Instance("prefill"), Stalling()
    with prefill.running(), decode.running(), running_proxy(ProxyConfig(
            prefill.url, decode.url, port=free_port(), request_timeout_s=1)) as url:
        status, answer = post(url, {**BODY, "stream": True})
        seen = counters(url)
    events = [json.loads(line[len("data: "):]) for line in answer.decode().splitlines()
              if line.startswith("data: ")]
    assert status == 200 and events[0] == {"choices": [{"text": "0"}]}
    assert events[-1]["error"]["message"] == "decode instance: no answer within 1 s"
    assert b"[DONE]" not in answer
    assert seen["kvtier_proxy_decode_cut_total"] == 1


def test_an_unstreamed_answer_cut_off_is_never_taken_for_a_whole_one() -> None:
    prefill, decode = Instance("prefill"), Stalling()
    with prefill.running(), decode.running(), running_proxy(ProxyConfig(
            prefill.url, decode.url, port=free_port(), request_timeout_s=1)) as url:
        with pytest.raises((http.client.IncompleteRead, ConnectionError)):
            post(url, BODY)
        seen = counters(url)
    assert seen["kvtier_proxy_decode_cut_total"] == 1


def test_a_port_in_use_is_one_line_and_status_2(capsys: pytest.CaptureFixture[str]) -> None:
    from kvtier.tools.cli.main import main

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code = main(["proxy", "--prefill", "http://127.0.0.1:1", "--decode",
                     "http://127.0.0.1:2", "--port", str(port)])
    err = capsys.readouterr().err
    assert code == 2 and "--port" in err and str(port) in err and len(err.splitlines()) == 1


class Trickling(Instance):
    """A decode stand-in that streams an event every 20 ms until its client (the proxy)
    hangs up (30 s at most)."""

    async def completions(self, request: web.Request) -> web.StreamResponse:
        self.bodies.append(await request.json())
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        deadline = asyncio.get_running_loop().time() + 30
        with contextlib.suppress(ConnectionError):
            while asyncio.get_running_loop().time() < deadline:
                await response.write(b'data: {"choices": [{"text": "x"}]}\n\n')
                await asyncio.sleep(0.02)
        return response


def test_a_client_hanging_up_midstream_is_not_counted_as_a_decode_failure() -> None:
    prefill, decode = Instance("prefill"), Trickling("decode")
    with prefill.running(), decode.running(), running_proxy(ProxyConfig(
            prefill.url, decode.url, port=free_port(), request_timeout_s=20)) as url:
        request = urllib.request.Request(
            url + "/v1/completions", json.dumps({**BODY, "stream": True}).encode(),
            headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=10) as response:
            assert response.read1(64).startswith(b"data: ")
        deadline = time.monotonic() + 10
        while counters(url)["kvtier_proxy_client_gone_total"] == 0:
            assert time.monotonic() < deadline, counters(url)
            time.sleep(0.05)
        seen = counters(url)
    assert seen["kvtier_proxy_decode_cut_total"] == 0


# -- a hanging prefill costs --prefill-timeout, not --request-timeout; decode 5xx counted ----

class Hanging(Instance):
    """A prefill stand-in that never answers (until the proxy hangs up; 30 s at most)."""

    async def completions(self, request: web.Request) -> web.StreamResponse:
        self.bodies.append(await request.json())
        deadline = asyncio.get_running_loop().time() + 30
        while (request.transport is not None and not request.transport.is_closing()
               and asyncio.get_running_loop().time() < deadline):
            await asyncio.sleep(0.05)
        return web.json_response({"choices": [{"text": "too late"}]})


def test_a_hanging_prefill_falls_back_to_decode_after_the_prefill_timeout() -> None:
    """The request timeout (60 s here) is far above the client's 10 s: before, the prefill's
    wait took the whole request timeout and the client gave up first."""
    prefill, decode = Hanging("prefill"), Instance("decode")
    with prefill.running(), decode.running(), running_proxy(ProxyConfig(
            prefill.url, decode.url, port=free_port(), request_timeout_s=60,
            prefill_timeout_s=0.5)) as url:
        status, answer = post(url, BODY)
        seen = counters(url)
    assert status == 200 and json.loads(answer)["choices"][0]["text"] == "decode:16"
    assert len(prefill.bodies) == 1 and decode.bodies == [BODY]
    assert seen["kvtier_proxy_prefill_timed_out_total"] == 1
    assert seen["kvtier_proxy_prefill_failed_total"] == 1


def test_a_decode_5xx_is_passed_back_and_counted() -> None:
    prefill, decode = Instance("prefill"), Instance("decode", status=503)
    with prefill.running(), decode.running(), running_proxy(ProxyConfig(
            prefill.url, decode.url, port=free_port(), request_timeout_s=10)) as url:
        status, answer = post(url, BODY)
        assert post(url, BODY)[0] == 503
        seen = counters(url)
    assert status == 503 and json.loads(answer)["error"]["message"] == "no"
    assert seen["kvtier_proxy_decode_error_status_total"] == 2
    assert seen["kvtier_proxy_decode_failed_total"] == 0


@pytest.mark.parametrize(("flags", "message"), [
    (["--prefill-timeout", "0"], "argument --prefill-timeout"),
    (["--prefill-timeout", "nan"], "argument --prefill-timeout"),
    (["--prefill-timeout", "700"], "--prefill-timeout=700.0: at most --request-timeout (600 s)"),
    (["--request-timeout", "30", "--prefill-timeout", "31"], "at most --request-timeout (30 s)"),
])
def test_a_bad_prefill_timeout_is_refused_naming_it(
        flags: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    from kvtier.tools.cli.main import main

    argv = ["proxy", "--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2",
            "--port", str(free_port()), *flags]
    try:
        code = main(argv)
    except SystemExit as refused:
        code = int(refused.code or 0)
    assert code == 2 and message in capsys.readouterr().err
