"""The streaming client against a small fake OpenAI server (aiohttp, 127.0.0.1, in-process).

The fake streams one token per event, `delay_s` apart, and answers with token ids derived
from the prompt, so the tests can check what the client measured and what it sent back.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
from aiohttp import web

from kvtier.tools.bench.serving.client import ClientConfig, api_base
from kvtier.tools.bench.serving.report import write_outputs
from kvtier.tools.bench.serving.runner import bench_endpoint
from kvtier.tools.bench.serving.workloads import long_doc, multi_round, prefix_repetition


@dataclass
class FakeServer:
    delay_s: float = 0.01  # before each token
    stall_prompt_len: int | None = None  # prompts of this length never get an answer
    fail_status: int | None = None
    prompts: list[list[int]] = field(default_factory=list)
    asked_ids: list[bool] = field(default_factory=list)  # return_token_ids, per request
    in_flight: int = 0
    max_in_flight: int = 0
    url: str = ""
    queries: int = 0

    def answer(self, prompt: list[int], n: int) -> list[int]:
        return [(len(prompt) + k) % 400 + 3 for k in range(n)]

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if self.fail_status:
            return web.Response(status=self.fail_status, text="nope")
        prompt = body["prompt"]
        self.prompts.append(prompt)
        self.asked_ids.append(bool(body.get("return_token_ids")))
        self.queries += len(prompt)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            if len(prompt) == self.stall_prompt_len:
                await asyncio.sleep(1.0)  # past the client timeout, short for teardown
            for k, tok in enumerate(self.answer(prompt, body["max_tokens"])):
                await asyncio.sleep(self.delay_s)
                choice = {"index": 0, "text": f" w{tok}", "token_ids": [tok]}
                if k == 0 and body.get("return_token_ids"):
                    choice["prompt_token_ids"] = prompt  # as vLLM does
                event = {"choices": [choice]}
                await resp.write(f"data: {json.dumps(event)}\n\n".encode())
            usage = {"choices": [], "usage": {"completion_tokens": body["max_tokens"]}}
            await resp.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())
            return resp
        finally:
            self.in_flight -= 1

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "fake", "max_model_len": 4096}]})

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(text=(
            "# TYPE vllm:prefix_cache_queries counter\n"
            f"vllm:prefix_cache_queries_total{{engine=\"0\"}} {self.queries}\n"
            "# TYPE vllm:prefix_cache_hits counter\n"
            f"vllm:prefix_cache_hits_total{{engine=\"0\"}} {self.queries // 2}\n"))


@pytest.fixture
def fake() -> Iterator[FakeServer]:
    server = FakeServer()
    app = web.Application()
    app.router.add_post("/v1/completions", server.completions)
    app.router.add_get("/v1/models", server.models)
    app.router.add_get("/metrics", server.metrics)
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(app)
    loop.run_until_complete(runner.setup())
    site = web.TCPSite(runner, "127.0.0.1", 0)
    loop.run_until_complete(site.start())
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    server.url = f"http://127.0.0.1:{port}"
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


def cfg(fake: FakeServer, **kw) -> ClientConfig:
    return ClientConfig(url=fake.url + "/v1", model="fake", **{"warmup_requests": 0, **kw})


def test_multi_round_sends_the_servers_own_answer_back_in_the_history(fake):
    w = multi_round(users=2, turns=3, first_len=20, user_len=5, output_len=3)
    run = bench_endpoint(w, cfg(fake, concurrency=2))
    assert all(r.ok for r in run.results) and len(run.results) == 6
    assert run.run.answers_from_server
    turns = {(t.session, t.turn): t for t in w.turns}
    for user in (0, 1):
        first = list(turns[(user, 0)].tokens)
        second = first + fake.answer(first, 3) + list(turns[(user, 1)].tokens)
        assert second in fake.prompts
        third = second + fake.answer(second, 3) + list(turns[(user, 2)].tokens)
        assert third in fake.prompts
    assert [r.prompt_tokens for r in run.results] == [20, 20, 28, 28, 36, 36]


def test_a_long_prompt_echoed_in_one_event_is_read(fake):
    # 20,000 ids echoed back make one event line of ~100 KiB, past aiohttp's line limit.
    w = multi_round(users=1, turns=2, first_len=20_000, user_len=5, output_len=2)
    run = bench_endpoint(w, cfg(fake))
    assert all(r.ok for r in run.results) and run.run.answers_from_server


def test_only_chained_workloads_ask_for_token_ids(fake):
    bench_endpoint(long_doc(docs=1, questions=2, doc_len=10), cfg(fake))
    bench_endpoint(multi_round(users=1, turns=1), cfg(fake))
    assert fake.asked_ids == [False, False, True]


def test_ttft_and_inter_token_gaps_are_measured_per_request(fake):
    fake.delay_s = 0.03
    run = bench_endpoint(long_doc(docs=1, doc_len=10, questions=2, output_len=4),
                         cfg(fake, concurrency=1))
    for r in run.results:
        assert r.ok and r.output_tokens == 4
        assert r.ttft_s is not None and r.ttft_s >= 0.025
        assert len(r.itl_s) == 3 and all(gap >= 0.02 for gap in r.itl_s)
        assert r.latency_s >= r.ttft_s + sum(r.itl_s) - 1e-3
    assert run.summary.completed == 2


def test_concurrency_is_bounded(fake):
    run = bench_endpoint(prefix_repetition(num_requests=12, prefix_len=8, output_len=2),
                         cfg(fake, concurrency=3))
    assert run.summary.completed == 12
    assert fake.max_in_flight <= 3


def test_max_requests_and_duration_bound_the_run(fake):
    w = prefix_repetition(num_requests=50, prefix_len=8, output_len=2)
    assert len(bench_endpoint(w, cfg(fake, max_requests=5)).results) == 5
    fake.delay_s = 0.05  # 0.1 s a request, one at a time: about 3 fit in 0.25 s
    run = bench_endpoint(w, cfg(fake, concurrency=1, duration_s=0.25))
    assert 1 <= len(run.results) <= 5


def test_a_stalled_request_times_out_as_data_and_the_run_ends(fake):
    w = prefix_repetition(num_prefixes=1, prefix_len=8, suffix_len=2, num_requests=2,
                          output_len=2)
    fake.stall_prompt_len = 10  # every prompt is 10 tokens: all stall
    run = bench_endpoint(w, cfg(fake, concurrency=2, request_timeout_s=0.3))
    assert [r.error for r in run.results] == ["timeout after 0.3 s"] * 2
    assert run.summary.completed == 0 and run.summary.ttft.p50 is None


def test_http_errors_are_results_not_exceptions(fake):
    fake.fail_status = 503
    run = bench_endpoint(long_doc(docs=1, questions=1, doc_len=10), cfg(fake))
    assert run.results[0].error is not None and run.results[0].error.startswith("HTTP 503")


def test_counters_are_diffed_and_every_output_file_is_written(fake, tmp_path):
    w = prefix_repetition(num_requests=4, prefix_len=8, suffix_len=2, output_len=2)
    a = bench_endpoint(w, cfg(fake), label="A")
    b = bench_endpoint(w, cfg(fake), label="B")
    assert a.metrics is not None and a.metrics["vllm:prefix_cache_queries_total"] == 40
    assert a.hit_rates["prefix_cache"] == pytest.approx(0.5)
    paths = write_outputs([a, b], tmp_path / "out")
    doc = json.loads(paths["json"].read_text())
    assert [r["label"] for r in doc["runs"]] == ["A", "B"]
    assert "TTFT p50" in doc["ratios_b_over_a"]
    assert len(paths["csv"].read_text().splitlines()) == 1 + 8
    assert paths["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_warmup_requests_go_first_and_are_not_counted(fake):
    w = long_doc(docs=1, questions=1, doc_len=40)
    run = bench_endpoint(w, cfg(fake, warmup_requests=2))
    assert len(fake.prompts) == 3 and len(run.results) == 1
    assert fake.prompts[0] == list(reversed(w.turns[0].tokens[:32]))  # no shared prefix block
    assert run.metrics is not None
    # Only the workload's 72 tokens (document 40 + question 32): the warm-up came before.
    assert run.metrics["vllm:prefix_cache_queries_total"] == len(w.turns[0].tokens) == 72


def test_api_base_accepts_the_v1_suffix():
    assert api_base("http://h:1/v1/") == "http://h:1" == api_base("http://h:1")
