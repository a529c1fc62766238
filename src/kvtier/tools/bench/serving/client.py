"""Drive a workload against an OpenAI-compatible `/v1/completions` endpoint, streaming.

Every request streams (`stream=True`), so time to first token and the gaps between tokens are
measured per request. Requests go out in the workload's order with at most `concurrency` in
flight; a chained turn (multi-round) waits for the previous turn of its session, whose answer
becomes part of its prompt. Dispatch stops after `max_requests` or `duration_s`; every request
has its own timeout, so a run ends by `duration_s + request_timeout_s` at the latest.
Failures come back as `RequestResult(error=...)`, never as exceptions.

vLLM extras, on by default and off with `vllm_extras=False` for servers that reject unknown
fields: `ignore_eos` (exact output lengths, so runs are comparable) and, for chained workloads
only, `return_token_ids` (the real answer tokens go into the next turn's history; without
them `Turn.filler_answer` stands in).

Primitives: `ClientConfig`, `WorkloadRun`, `run_workload` (async), `warm_up` (async),
`fetch_model`, `api_base`.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from kvtier.errors import ConfigError
from kvtier.tools.bench.serving.stats import RequestResult
from kvtier.tools.bench.serving.workloads import Turn, Workload, next_prompt


@dataclass(frozen=True, slots=True)
class ClientConfig:
    """How to send a workload."""

    url: str  # server base URL, e.g. http://127.0.0.1:8000 (a trailing /v1 is accepted)
    model: str  # the served model name (see `fetch_model`)
    concurrency: int = 4  # requests in flight at most
    max_requests: int | None = None  # send at most this many (None: the whole workload)
    duration_s: float | None = None  # stop sending after this long (None: no limit)
    request_timeout_s: float = 300.0  # one request's limit, streaming included
    vllm_extras: bool = True  # send ignore_eos and return_token_ids (vLLM's extensions)
    # Short requests sent (and not counted) before the run: the first requests after a
    # server starts pay one-off costs (lazy initialisation) that would skew a comparison.
    warmup_requests: int = 1
    # Sent as every request's `kv_transfer_params` (vLLM's extension, handed to the KV
    # connector), with vllm_extras: {"skip_load": True} makes kvtier recompute the prompt.
    kv_transfer_params: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.concurrency < 1:
            raise ConfigError("concurrency", self.concurrency, "an integer >= 1")
        if self.max_requests is not None and self.max_requests < 1:
            raise ConfigError("max_requests", self.max_requests, "an integer >= 1")
        if self.duration_s is not None and self.duration_s <= 0:
            raise ConfigError("duration_s", self.duration_s, "a positive number of seconds")
        if self.warmup_requests < 0:
            raise ConfigError("warmup_requests", self.warmup_requests, "an integer >= 0")
        if self.request_timeout_s <= 0:
            raise ConfigError("request_timeout_s", self.request_timeout_s, "positive seconds")


@dataclass(frozen=True, slots=True)
class WorkloadRun:
    """The requests of one run, in dispatch order, and its wall time."""

    results: tuple[RequestResult, ...]
    duration_s: float  # from the first send to the last completion
    answers_from_server: bool  # every chained history used the server's own answer tokens


def api_base(url: str) -> str:
    """"http://h:p/v1/" -> "http://h:p" (the server root, where /metrics also lives)."""
    return url.rstrip("/").removesuffix("/v1")


async def fetch_model(url: str, timeout_s: float = 10.0) -> tuple[str, int | None]:
    """The first model the server lists and its max_model_len (None when not reported).

    Raises:
        aiohttp.ClientError, TimeoutError: the server does not answer.
        ConfigError: the server lists no model.
    """
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(timeout=timeout) as session, \
            session.get(api_base(url) + "/v1/models") as resp:
        resp.raise_for_status()
        data = (await resp.json()).get("data") or []
    if not data:
        raise ConfigError("model", None, f"a model served at {url} (it lists none)")
    return str(data[0]["id"]), data[0].get("max_model_len")


async def run_workload(workload: Workload, cfg: ClientConfig,
                       on_done: Callable[[RequestResult], None] | None = None) -> WorkloadRun:
    """Send `workload` as `cfg` says and return every request's result.

    `on_done` is called on the event loop's thread after each request (progress bars).
    """
    turns = workload.limit(cfg.max_requests).turns
    sem = asyncio.Semaphore(cfg.concurrency)
    # session -> (prompt, answer) of its latest finished turn, and when that turn is done.
    history: dict[int, tuple[tuple[int, ...], tuple[int, ...]]] = {}
    finished: dict[tuple[int, int], asyncio.Event] = {}
    results: list[RequestResult | None] = [None] * len(turns)
    from_server = [True]
    connector = aiohttp.TCPConnector(limit=cfg.concurrency)
    t0 = time.perf_counter()
    end = [t0]
    async with aiohttp.ClientSession(connector=connector) as http:

        async def one(i: int, turn: Turn, prompt: tuple[int, ...]) -> None:
            try:
                result, answer = await _send(http, cfg, turn, prompt, t0, workload.chained)
                if workload.chained and answer is None:
                    from_server[0] = False
                history[turn.session] = (prompt, answer or turn.filler_answer)
                results[i] = result
                end[0] = time.perf_counter()
                if on_done is not None:
                    on_done(result)
            finally:
                finished[(turn.session, turn.turn)].set()
                sem.release()

        tasks = []
        for i, turn in enumerate(turns):
            if cfg.duration_s is not None and time.perf_counter() - t0 >= cfg.duration_s:
                break
            await sem.acquire()
            prompt = turn.tokens
            if workload.chained and (turn.session, turn.turn - 1) in finished:
                await finished[(turn.session, turn.turn - 1)].wait()
                prev_prompt, prev_answer = history[turn.session]
                prompt = next_prompt(turn, prev_prompt, prev_answer)
            finished[(turn.session, turn.turn)] = asyncio.Event()
            tasks.append(asyncio.create_task(one(i, turn, prompt)))
        await asyncio.gather(*tasks)
    done = tuple(r for r in results if r is not None)
    return WorkloadRun(done, max(end[0] - t0, 1e-9), from_server[0])


async def warm_up(workload: Workload, cfg: ClientConfig) -> list[RequestResult]:
    """Send `cfg.warmup_requests` short requests that share no prefix block with the workload
    (the first turn's first 32 tokens, reversed); their results are for logging only."""
    tokens = tuple(reversed(workload.turns[0].tokens[:32]))
    results = []
    async with aiohttp.ClientSession() as http:
        for k in range(cfg.warmup_requests):
            turn = Turn(session=-1, turn=k, tokens=tokens, max_tokens=2)
            result, _ = await _send(http, cfg, turn, tokens, time.perf_counter(), False)
            results.append(result)
    return results


async def _send(http: aiohttp.ClientSession, cfg: ClientConfig, turn: Turn,
                prompt: tuple[int, ...], t0: float,
                chained: bool) -> tuple[RequestResult, tuple[int, ...] | None]:
    """Stream one completion; returns its result and the answer's token ids (None if the
    server sent none). Never raises for server or network failures."""
    body: dict[str, Any] = {
        "model": cfg.model, "prompt": list(prompt), "max_tokens": turn.max_tokens,
        "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True},
    }
    if cfg.vllm_extras:
        body["ignore_eos"] = True
        if chained:  # only chained turns need the answer's ids (they also echo the prompt)
            body["return_token_ids"] = True
        if cfg.kv_transfer_params is not None:
            body["kv_transfer_params"] = cfg.kv_transfer_params
    stream = _Stream(time.perf_counter())
    error: str | None = None
    try:
        timeout = aiohttp.ClientTimeout(total=cfg.request_timeout_s)
        async with http.post(api_base(cfg.url) + "/v1/completions", json=body,
                             timeout=timeout) as resp:
            if resp.status != 200:
                error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
            else:
                # Not `async for line in resp.content`: aiohttp refuses lines over 64 KiB,
                # and vLLM's first event echoes the whole prompt when token ids are asked for.
                pending = b""
                async for chunk in resp.content.iter_any():
                    now = time.perf_counter()
                    *lines, pending = (pending + chunk).split(b"\n")
                    for line in lines:
                        stream.feed(line, now)
                stream.feed(pending, time.perf_counter())
                error = stream.error
    except TimeoutError:
        error = f"timeout after {cfg.request_timeout_s:g} s"
    except aiohttp.ClientError as exc:
        error = f"{type(exc).__name__}: {exc}"
    now = time.perf_counter()
    if error is None and stream.first_s is None:
        error = "no token received"
    result = RequestResult(
        session=turn.session, turn=turn.turn, prompt_tokens=len(prompt),
        output_tokens=stream.usage_tokens if stream.usage_tokens is not None else stream.tokens,
        start_s=stream.sent_s - t0,
        ttft_s=None if stream.first_s is None else stream.first_s - stream.sent_s,
        latency_s=now - stream.sent_s, itl_s=tuple(stream.gaps), error=error)
    answer = tuple(stream.token_ids) if stream.has_ids and error is None else None
    return result, answer


@dataclass(slots=True)
class _Stream:
    """Accumulates one server-sent-events completion stream."""

    sent_s: float
    first_s: float | None = None
    last_s: float | None = None
    tokens: int = 0
    usage_tokens: int | None = None
    token_ids: list[int] = field(default_factory=list)
    has_ids: bool = True
    gaps: list[float] = field(default_factory=list)
    error: str | None = None

    def feed(self, raw: bytes, now: float) -> None:
        line = raw.decode("utf-8", "replace").strip()
        if not line.startswith("data:"):
            return
        payload = line[5:].strip()
        if payload == "[DONE]":
            return
        try:
            event = json.loads(payload)
        except ValueError:
            self.error = f"bad stream event: {payload[:200]}"
            return
        if "error" in event:
            self.error = f"server error: {str(event['error'])[:300]}"
            return
        if event.get("usage"):
            self.usage_tokens = event["usage"].get("completion_tokens")
        for choice in event.get("choices") or []:
            ids = choice.get("token_ids")
            n = len(ids) if ids is not None else (1 if choice.get("text") else 0)
            if ids is None:
                self.has_ids = False
            else:
                self.token_ids.extend(ids)
            if n == 0:
                continue
            if self.first_s is None:
                self.first_s = now
            elif self.last_s is not None:
                self.gaps.extend([(now - self.last_s) / n] * n)
            self.last_s = now
            self.tokens += n
