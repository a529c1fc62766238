"""A slice of a request trace, scaled down to prompts a 2-core CPU engine prefills in minutes.

`kvtier bench trace` (tracebench.py) sends these prompts to vLLM; the simulator replays the
very same prompts (`TraceSlice.as_trace`), so the two see one workload.

- **Which requests**: whole conversations, sampled by the hash of their first
  `group_blocks` blocks (2 for Mooncake's trace, whose first block, the system prompt, every
  request shares), keeping a fraction `sample` of them with all their requests over the whole
  trace. Sampling by key keeps the reuse distances of what is kept, so the slice's hit ratio
  at capacity `sample x C` is that of the whole trace at `C` (SHARDS, Waldspurger et al.,
  FAST'15); a run of consecutive requests would only see the trace's cold start. At most
  `limit` requests are kept, in arrival order.
- **Tokens**: each trace block (512 tokens, a chained key: `kvtier.tools.sim.trace`) becomes
  `block_tokens` token ids drawn from a generator seeded by that key, so equal prefixes give
  equal tokens and different ones share no block; a prompt keeps at most `max_blocks` full
  blocks (a prefix of a prefix is a prefix: the structure holds). A partial last block
  becomes a proportional tail (fewer than `block_tokens` tokens, never a whole block) of the
  request's own tokens; a prompt has at least one token.
- **Capacity**: `scaled_blocks(capacity_tokens)`: a capacity of the whole trace, in its
  tokens, as blocks of the slice (times `sample`, over the trace's block size).

Primitives: `SliceSpec`, `SlicedRequest`, `TraceSlice`, `slice_trace`, `block_token_ids`.
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass
from pathlib import Path

from kvtier.errors import ConfigError
from kvtier.tools.sim.trace import Trace, read_trace

TOKEN_LOW, TOKEN_HIGH = 3, 500  # ids drawn (serving.workloads.TokenRange's default range)
# Requests with no full block form a group each, named by a key no block has (keys are >= 0).
ROOTLESS = -2


@dataclass(frozen=True, slots=True)
class SliceSpec:
    """How to cut and scale a trace. Validated by `validate`."""

    sample: float = 0.03  # fraction of conversations kept (0 < sample <= 1)
    seed: int = 0  # which conversations: the sampling hash's seed, and the token ids'
    limit: int | None = None  # keep at most this many requests (None: all sampled)
    trace_block_tokens: int = 512  # tokens of a trace block (Mooncake's hash granularity)
    block_tokens: int = 32  # tokens a trace block becomes (kvtier's chunk, vLLM's block)
    max_blocks: int = 32  # full blocks a prompt keeps at most
    group_blocks: int = 2  # a conversation: requests sharing their first group_blocks blocks

    def validate(self) -> None:
        """Raises ConfigError naming the first bad field."""
        if not 0 < self.sample <= 1:
            raise ConfigError("sample", self.sample, "a fraction in (0, 1]")
        if self.limit is not None and self.limit < 1:
            raise ConfigError("limit", self.limit, "an integer >= 1")
        for name in ("trace_block_tokens", "block_tokens", "max_blocks", "group_blocks"):
            if getattr(self, name) < 1:
                raise ConfigError(name, getattr(self, name), "an integer >= 1")
        if self.block_tokens > self.trace_block_tokens:
            raise ConfigError("block_tokens", self.block_tokens,
                              f"<= the trace's block ({self.trace_block_tokens} tokens)")

    @property
    def scale(self) -> float:
        """Slice tokens per trace token, within a block."""
        return self.block_tokens / self.trace_block_tokens

    def max_prompt_tokens(self) -> int:
        """The longest prompt a slice of this spec can hold."""
        return self.max_blocks * self.block_tokens + self.block_tokens - 1


@dataclass(frozen=True, slots=True)
class SlicedRequest:
    """One request of the slice."""

    index: int  # its line in the trace (0-based, among the requests read)
    prompt: tuple[int, ...]  # token ids sent to the engine
    trace_tokens: int  # its prompt tokens in the trace
    arrival_s: float  # its arrival in the trace


@dataclass(frozen=True, slots=True)
class TraceSlice:
    """The requests kept, scaled, and what they were cut from."""

    spec: SliceSpec
    trace: str  # the trace's path
    trace_requests: int  # requests of the whole trace
    requests: tuple[SlicedRequest, ...]

    @property
    def prompt_tokens(self) -> int:
        return sum(len(r.prompt) for r in self.requests)

    def scaled_blocks(self, capacity_tokens: int) -> int:
        """A capacity of the whole trace, in its tokens, as blocks of this slice."""
        return round(capacity_tokens * self.spec.sample / self.spec.trace_block_tokens)

    def write_jsonl(self, path: Path) -> None:
        """The slice as a generic trace (`{"tokens": [...], "timestamp": ms}` a line)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w", encoding="utf-8") as out:
            for r in self.requests:
                out.write(json.dumps({"tokens": list(r.prompt),
                                      "timestamp": round(r.arrival_s * 1e3)}) + "\n")

    def as_trace(self, path: Path) -> Trace:
        """The slice written to `path` and read back as the simulator reads any trace, in
        blocks of `block_tokens`: the simulator replays exactly the prompts sent."""
        self.write_jsonl(path)
        return read_trace(path, self.spec.block_tokens)


def block_token_ids(key: int, count: int, seed: int) -> tuple[int, ...]:
    """`count` token ids for the trace block of chained key `key`: the same for the same key."""
    rng = random.Random(f"block:{seed}:{key}")
    return tuple(rng.randrange(TOKEN_LOW, TOKEN_HIGH) for _ in range(count))


def _kept(group: tuple[int, ...], spec: SliceSpec) -> bool:
    digest = hashlib.blake2b(repr((spec.seed, group)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") < spec.sample * 2**64


def slice_trace(path: str | Path, spec: SliceSpec) -> TraceSlice:
    """Read the trace at `path` (either format of `kvtier.tools.sim.trace`) and cut `spec`'s
    slice of it.

    Raises:
        ConfigError: a bad spec, an unreadable trace, or a slice with no request.
    """
    spec.validate()
    trace = read_trace(path, spec.trace_block_tokens)
    kept: list[SlicedRequest] = []
    for index, request in enumerate(trace.requests):
        group = request.keys[:spec.group_blocks] or (ROOTLESS - index,)
        if not _kept(group, spec):
            continue
        full = min(len(request.keys), spec.max_blocks)
        tokens: list[int] = []
        for key in request.keys[:full]:
            tokens.extend(block_token_ids(key, spec.block_tokens, spec.seed))
        partial = request.input_tokens - len(request.keys) * spec.trace_block_tokens
        tail = partial * spec.block_tokens // spec.trace_block_tokens \
            if full == len(request.keys) else 0
        if not tokens:
            tail = max(tail, 1)
        rng = random.Random(f"tail:{spec.seed}:{index}")
        tokens.extend(rng.randrange(TOKEN_LOW, TOKEN_HIGH) for _ in range(tail))
        kept.append(SlicedRequest(index, tuple(tokens), request.input_tokens,
                                  request.arrival_s))
        if spec.limit is not None and len(kept) >= spec.limit:
            break
    if not kept:
        raise ConfigError("sample", spec.sample, f"a fraction that keeps a request of {path}")
    return TraceSlice(spec, str(path), len(trace.requests), tuple(kept))
