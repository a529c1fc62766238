"""Synthetic serving traffic: sessions, shared prompts, multi-turn history, document reuse.

A session picks a system prompt from a small pool and, with probability `doc_prob`, a document
from a Zipf-popular pool; then it runs `turns` requests. Each turn's prompt is the whole
history so far (system prompt, document, every earlier user message and reply) plus a new user
message, so its KV prefix is the previous turn's full sequence. Sessions start as a Poisson
process; later turns follow after an exponential think time (open loop: a turn does not wait
for the previous reply, which keeps the traffic independent of the engine being simulated).

Token content is never materialised. A prompt is a chain of block hashes: block i's hash
is `hash((hash of block i-1, what block i holds))`, where "what it holds" names segments
(system prompt k, document j, message r) and offsets, exactly like vLLM's chained block hashes.
Equal prefixes therefore give equal hashes across sessions, and nothing else does.

Primitives:
    WorkloadConfig, WORKLOAD_PRESETS, workload_preset(name, **overrides)
    Request                       -- one request (mutable: the engine tracks its progress)
    generate(config, n, block_tokens, seed) -- iterator of Requests in arrival order
"""

from __future__ import annotations

import bisect
import heapq
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass, fields, replace
from typing import Any

from kvtier.errors import ConfigError


@dataclass(frozen=True, slots=True)
class WorkloadConfig:
    """Traffic shape. Lengths are means of log-normal distributions (in tokens)."""

    rate_rps: float = 8.0  # requests per second, all sessions together
    system_prompts: int = 8  # size of the shared system-prompt pool (0: none)
    system_tokens: int = 1500  # length of each system prompt
    doc_prob: float = 0.0  # chance that a session is about a document
    docs: int = 1000  # size of the document pool
    doc_tokens: int = 6000  # mean document length
    doc_zipf: float = 1.1  # Zipf exponent of document popularity (0: uniform)
    turns_mean: float = 4.0  # mean turns per session (geometric, >= 1)
    user_tokens: int = 200  # mean new user message (or tool output) per turn
    output_tokens: int = 250  # mean reply length
    length_cv: float = 0.8  # coefficient of variation of the log-normal lengths
    think_s: float = 20.0  # mean time between a session's turns
    max_context: int = 32768  # a session ends before a turn would pass this

    def __post_init__(self) -> None:
        if not self.rate_rps > 0:  # first: -1 was told "a number >= 0", then 0 refused
            raise ConfigError("workload.rate_rps", self.rate_rps, "requests per second > 0")
        for f in fields(self):
            value = getattr(self, f.name)
            if value < 0 or (isinstance(value, float) and math.isnan(value)):
                raise ConfigError(f"workload.{f.name}", value, "a number >= 0")
        if self.turns_mean < 1:
            raise ConfigError("workload.turns_mean", self.turns_mean, "a mean >= 1")
        if self.doc_prob > 1:
            raise ConfigError("workload.doc_prob", self.doc_prob, "a probability in [0, 1]")
        if self.output_tokens < 1 or self.user_tokens < 1:
            raise ConfigError("workload.output_tokens/user_tokens",
                              (self.output_tokens, self.user_tokens), "means >= 1 token")
        for name in _TOKEN_FIELDS:
            if getattr(self, name) > MAX_TOKENS:
                raise ConfigError(f"workload.{name}", getattr(self, name),
                                  f"at most {MAX_TOKENS:,} tokens")
        if self.max_context < self.system_tokens + 2 * self.user_tokens:
            raise ConfigError("workload.max_context", self.max_context,
                              "room for the system prompt and a turn")


# The longest context a workload may ask for (10M tokens, the longest any model offers);
# more is a typo, and each block of it costs the simulator time and memory.
MAX_TOKENS = 10_000_000
_TOKEN_FIELDS = ("system_tokens", "doc_tokens", "user_tokens", "output_tokens", "max_context")
# Turns in a row that may end their session without a request before the workload is
# declared impossible.
_MAX_EMPTY_TURNS = 10_000

WORKLOAD_PRESETS: dict[str, WorkloadConfig] = {
    # Chat: a few shared system prompts, several turns, short messages.
    "chat": WorkloadConfig(),
    # RAG: every session is about a popular document; one or two questions each.
    "rag": WorkloadConfig(system_prompts=2, system_tokens=400, doc_prob=1.0, docs=2000,
                          doc_tokens=6000, turns_mean=1.5, user_tokens=80, output_tokens=200,
                          think_s=30.0),
    # Coding agent: long system prompt, many turns of tool output, fast turn-around.
    "agent": WorkloadConfig(rate_rps=4.0, system_prompts=3, system_tokens=6000, turns_mean=12.0,
                            user_tokens=1500, output_tokens=300, think_s=4.0,
                            max_context=65536),
    # No reuse at all: unique one-shot prompts (offload can only cost here).
    "unique": WorkloadConfig(system_prompts=0, system_tokens=0, turns_mean=1.0,
                             user_tokens=1000, output_tokens=200),
}


def workload_preset(name: str, **overrides: Any) -> WorkloadConfig:
    """Return a preset with `overrides` applied (None values are ignored).

    Raises:
        ConfigError: unknown preset or an invalid overridden value.
    """
    if name not in WORKLOAD_PRESETS:
        raise ConfigError("workload", name, f"one of {', '.join(WORKLOAD_PRESETS)}")
    given = {k: v for k, v in overrides.items() if v is not None}
    return replace(WORKLOAD_PRESETS[name], **given)


class Request:
    """One request. `hashes` is shared with its session and only ever appended to."""

    __slots__ = (
        "arrival_s",
        "computed",
        "first_token_s",
        "g0",
        "generated",
        "hashes",
        "held",
        "load_blocks",
        "n_full_blocks",
        "n_private",
        "output_tokens",
        "prompt_tokens",
        "rid",
        "session",
        "target",
        "version",
    )

    def __init__(self, rid: int, session: int, arrival_s: float, prompt_tokens: int,
                 output_tokens: int, hashes: list[int], n_full_blocks: int) -> None:
        self.rid = rid
        self.session = session
        self.arrival_s = arrival_s
        self.prompt_tokens = prompt_tokens  # tokens of the prompt
        self.output_tokens = output_tokens  # tokens it will generate
        self.hashes = hashes  # block hashes of prompt + output, shared with the session
        self.n_full_blocks = n_full_blocks  # full blocks in prompt + output
        self.generated = 0  # tokens generated so far (kept across preemption)
        self.first_token_s = -1.0  # time of the first token; -1 before it
        self.held: list[int] = []  # hashed GPU blocks this request references
        self.n_private = 0  # GPU blocks held that have no hash (yet)
        self.computed = 0  # tokens whose KV is on the GPU
        self.target = 0  # tokens to have KV for before decoding (prompt + generated)
        self.g0 = 0  # engine decode-step counter when decoding (re)started
        self.version = 0  # bumped on preemption, invalidating queued step events
        self.load_blocks = 0  # blocks being loaded from offload tiers for this admission


class _Chain:
    """Block hashes of a growing token sequence (a session's history)."""

    __slots__ = ("hashes", "tail", "tokens")

    def __init__(self) -> None:
        self.hashes: list[int] = []
        self.tokens = 0
        self.tail: list[tuple[int, int]] = []  # (segment, offset) pieces of the open block

    def copy(self) -> _Chain:
        out = _Chain()
        out.hashes, out.tokens, out.tail = list(self.hashes), self.tokens, list(self.tail)
        return out

    def extend(self, segment: int, length: int, block_tokens: int) -> None:
        """Append `length` tokens of `segment`, hashing every block this completes."""
        offset, fill = 0, self.tokens % block_tokens
        hashes, tail = self.hashes, self.tail
        while length - offset >= block_tokens - fill:
            tail.append((segment, offset))
            parent = hashes[-1] if hashes else 0
            hashes.append(hash((parent, tuple(tail))))
            offset += block_tokens - fill
            tail.clear()
            fill = 0
        if offset < length:
            tail.append((segment, offset))
        self.tokens += length


@dataclass(slots=True)
class _Session:
    sid: int
    chain: _Chain
    turns_left: int


def generate(config: WorkloadConfig, n_requests: int, block_tokens: int,
             seed: int = 0) -> Iterator[Request]:
    """Yield `n_requests` Requests in arrival order, deterministically for `seed`.

    Raises:
        ConfigError: n_requests < 0 or block_tokens < 1.
    """
    if n_requests < 0:
        raise ConfigError("requests", n_requests, "an integer >= 0")
    if block_tokens < 1:
        raise ConfigError("block_tokens", block_tokens, "an integer >= 1")
    gen = _Generator(config, block_tokens, seed)
    for rid in range(n_requests):
        yield gen.next_request(rid)


class _Generator:
    """State of `generate`: pending turns in a heap, shared prefixes memoised."""

    def __init__(self, config: WorkloadConfig, block_tokens: int, seed: int) -> None:
        self.cfg, self.bt = config, block_tokens
        self.rng = random.Random(seed)
        self.pending: list[tuple[float, int, _Session]] = []
        self.prefixes: dict[tuple[int, int], _Chain] = {}
        self.next_session_s = 0.0
        self.sessions = 0
        self.segments = 1 << 40  # ids of unique segments; pool ids stay below this
        sigma2 = math.log1p(config.length_cv ** 2)
        self.sigma = math.sqrt(sigma2)
        self.mu_shift = -sigma2 / 2
        session_rate = config.rate_rps / config.turns_mean
        self.session_gap_s = 1.0 / session_rate
        cum, total = [], 0.0
        for k in range(1, config.docs + 1):
            total += k ** -config.doc_zipf
            cum.append(total)
        self.doc_cum = cum

    def _length(self, mean: float) -> int:
        if mean <= 0:
            return 0
        return max(1, int(self.rng.lognormvariate(math.log(mean) + self.mu_shift, self.sigma)))

    def _unique(self) -> int:
        self.segments += 1
        return self.segments

    def _new_session(self, now: float) -> _Session:
        cfg, rng = self.cfg, self.rng
        sys_id = rng.randrange(cfg.system_prompts) if cfg.system_prompts else -1
        doc_id = -1
        if cfg.docs and rng.random() < cfg.doc_prob:
            doc_id = bisect.bisect_left(self.doc_cum, rng.random() * self.doc_cum[-1])
        key = (sys_id, doc_id)
        prefix = self.prefixes.get(key)
        if prefix is None:
            prefix = _Chain()
            if sys_id >= 0:
                prefix.extend(1 + sys_id, cfg.system_tokens, self.bt)
            if doc_id >= 0:
                doc_len = int(cfg.doc_tokens * (0.5 + ((doc_id * 7919) % 1000) / 1000))
                prefix.extend((1 << 20) + doc_id, doc_len, self.bt)
            self.prefixes[key] = prefix
        p = 1.0 / cfg.turns_mean  # geometric number of turns with the configured mean
        # log1p: log(1 - p) is 0.0 for p < 1e-16 (turns_mean 1e30 divided by zero)
        turns = 1 if p >= 1 else 1 + int(math.log(1.0 - rng.random()) / math.log1p(-p))
        self.sessions += 1
        return _Session(self.sessions, prefix.copy(), turns)

    def next_request(self, rid: int) -> Request:
        """Pop the earliest pending turn, or start a session if that comes first.

        Raises:
            ConfigError: when _MAX_EMPTY_TURNS turns in a row end their session before a
                request (the token means leave no room in max_context; raised, not looped
                on forever).
        """
        for _ in range(_MAX_EMPTY_TURNS):
            if not self.pending or self.next_session_s <= self.pending[0][0]:
                now = self.next_session_s
                self.next_session_s += self.rng.expovariate(1.0 / self.session_gap_s)
                session = self._new_session(now)
            else:
                now, _, session = heapq.heappop(self.pending)
            request = self._turn(rid, now, session)
            if request is not None:
                return request
        raise ConfigError("workload.max_context", self.cfg.max_context,
                          f"room for a turn: {_MAX_EMPTY_TURNS:,} sessions in a row ended "
                          "before one; raise max_context or lower the token means")

    def _turn(self, rid: int, now: float, s: _Session) -> Request | None:
        cfg, chain = self.cfg, s.chain
        user, out = self._length(cfg.user_tokens), self._length(cfg.output_tokens)
        if chain.tokens + user + out > cfg.max_context:
            return None  # the session has grown too long and ends here
        chain.extend(self._unique(), user, self.bt)
        prompt = chain.tokens
        chain.extend(self._unique(), out, self.bt)
        s.turns_left -= 1
        if s.turns_left > 0:
            think = self.rng.expovariate(1.0 / cfg.think_s) if cfg.think_s > 0 else 0.0
            heapq.heappush(self.pending, (now + think, s.sid, s))
        return Request(rid, s.sid, now, prompt, out, chain.hashes, len(chain.hashes))

