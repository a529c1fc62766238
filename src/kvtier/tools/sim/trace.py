"""Request traces for `kvtier simulate --trace`: each request's prompt as a chain of block keys.

A trace is JSON Lines, one request a line, in arrival order. Two formats are read:

- **Mooncake** (the FAST'25 traces, `../shared/traces/README.md`):
  `{"timestamp": ms, "input_length": tokens, "hash_ids": [h0, h1, ...]}`, one hash a block
  of `block_tokens` (512 there) tokens, the last one possibly partial.
- **Generic**: `{"tokens": [id, ...]}` (token ids, cut into blocks of `block_tokens`), or
  `{"block_hashes": [h0, ...], "input_length": tokens}` (prefix-block hashes, as Mooncake's;
  `input_length` defaults to a whole number of blocks). `timestamp` (ms) is optional.

A line may record its block size, `"block_tokens": 16` (`write_workload_trace` does): a
trace read without a block size is read in the size its lines record (512, Mooncake's, where
none does); a trace whose lines disagree with it, or with the size it is read with, is
refused. Mooncake's lines record none. A line's hashes are its prompt's blocks, the last one
possibly partial but never empty: n hashes of `block_tokens` hold more than (n - 1) x
`block_tokens` tokens and at most n x `block_tokens`. A trace read in the wrong block size
breaks that on its first long prompt: it is refused there, with the sizes the line fits
(a trace of 16-token blocks read as 512 would otherwise replay as blocks of 512, silently).

Only a prompt's full blocks are ever stored (kvtier stores whole chunks). Each block gets a
*chained* key, like kvtier's `ChunkKey`: an int interned from (parent key, block content),
so two requests share a key only where they share the whole prefix up to it, whatever the
trace's hashes promise. A request carries its keys and, for each, its parent's key (-1 for
the first block): what a prefix-aware policy is told on insert.

`write_workload_trace` writes `kvtier simulate`'s synthetic traffic (`--workload`) in the
generic format, so that any workload's policies can be compared as a trace's are.

Primitives: `TraceRequest`, `Trace`, `read_trace(path, block_tokens, limit)`, `ROOT`,
`DEFAULT_BLOCK_TOKENS`, `write_workload_trace`.
"""

from __future__ import annotations

import json
from collections.abc import Hashable, Iterable
from dataclasses import dataclass
from pathlib import Path

from kvtier.errors import ConfigError
from kvtier.tools.sim.workload import WorkloadConfig, generate

ROOT = -1  # the parent of a prompt's first block
DEFAULT_BLOCK_TOKENS = 512  # Mooncake's hash granularity: a trace that records no block size


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a trace: its full blocks' chained keys, their parents, its size."""

    keys: tuple[int, ...]  # chained keys of the prompt's full blocks, first block first
    parents: tuple[int, ...]  # parents[i] is keys[i - 1]; ROOT for the first block
    input_tokens: int  # the prompt's tokens, the partial last block included
    arrival_s: float  # seconds from the trace's start (0 where the trace has no timestamps)


@dataclass(frozen=True, slots=True)
class Trace:
    """A whole trace, read once and replayed under every policy and capacity."""

    path: str  # where it was read from (for reports)
    block_tokens: int  # tokens a block (a chunk) holds
    requests: tuple[TraceRequest, ...]
    distinct_blocks: int  # distinct chained keys: what an unbounded cache ends up holding

    @property
    def input_tokens(self) -> int:
        """Prompt tokens of all requests: the denominator of the token hit ratio."""
        return sum(r.input_tokens for r in self.requests)

    @property
    def block_accesses(self) -> int:
        """Full blocks of all requests."""
        return sum(len(r.keys) for r in self.requests)


def read_trace(path: str | Path, block_tokens: int | None = None,
               limit: int | None = None) -> Trace:
    """Read a trace file (either format, told apart line by line).

    Args:
        block_tokens: tokens a block holds: the hash granularity of a Mooncake trace (512),
            the chunk size to cut `tokens` into for a generic one. None: the size the trace's
            lines record, else `DEFAULT_BLOCK_TOKENS`.
        limit: read at most this many requests (None: all).
    Raises:
        ConfigError: an unreadable file, a line that is not a JSON object of either format,
            a line whose hashes do not fit its input length in blocks of the size read (or
            that records another size), a non-positive `block_tokens`, an empty trace.
    """
    if block_tokens is not None and block_tokens < 1:
        raise ConfigError("block_tokens", block_tokens, "an integer >= 1")
    size = _BlockSize(block_tokens)
    interned: dict[tuple[int, Hashable], int] = {}
    requests: list[TraceRequest] = []
    try:
        with open(path, encoding="utf-8") as lines:
            for number, line in enumerate(lines, 1):
                if limit is not None and len(requests) >= limit:
                    break
                if line.strip():
                    requests.append(_request(line, number, size, interned))
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError("trace", str(path), f"a readable JSON Lines file ({exc})") from None
    if not requests:
        raise ConfigError("trace", str(path), "a file with at least one request")
    return Trace(str(path), size.tokens or DEFAULT_BLOCK_TOKENS, tuple(requests), len(interned))


class _BlockSize:
    """A trace's block size while it is read: the caller's, or the first line's that records
    one, or the default; every line after must agree with it."""

    def __init__(self, given: int | None) -> None:
        self.tokens = given  # None until a caller or a line fixes it
        self.given = given is not None

    def of(self, row: dict[str, object], where: str) -> int:
        """The block size to read `row` in, fixing it on the first line.

        Raises:
            ConfigError: the line records a size that is not a positive integer, or another
                size than the one the trace is read in.
        """
        recorded = row.get("block_tokens")
        if recorded is None:
            if self.tokens is None:
                self.tokens = DEFAULT_BLOCK_TOKENS
            return self.tokens
        if type(recorded) is not int or recorded < 1:
            raise ConfigError(f"{where}.block_tokens", recorded, "tokens a block holds, >= 1")
        if self.tokens is not None and recorded != self.tokens:
            why = (f"{self.tokens}, the block size it is read in: the trace records "
                   f"{recorded} (--trace-block-tokens {recorded})"
                   if self.given else f"{self.tokens}, the block size of the lines before it "
                   "(one block size a trace)")
            raise ConfigError(f"{where}.block_tokens", recorded, why)
        self.tokens = recorded
        return recorded


def _request(line: str, number: int, size: _BlockSize,
             interned: dict[tuple[int, Hashable], int]) -> TraceRequest:
    """One line as a TraceRequest; its blocks' keys interned in `interned`.

    Raises:
        ConfigError: not a JSON object of either format; hashes that do not fit the input
            length in blocks of the trace's size; another block size recorded.
    """
    where = f"trace line {number}"
    try:
        row = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ConfigError(where, line[:80], f"a JSON object ({exc.msg})") from None
    if not isinstance(row, dict):
        raise ConfigError(where, line[:80], "a JSON object")
    block_tokens = size.of(row, where)
    blocks: list[Hashable]
    if "tokens" in row:
        tokens = _int_list(row["tokens"], where + ".tokens")
        input_tokens = len(tokens)
        blocks = [tuple(tokens[i:i + block_tokens])
                  for i in range(0, input_tokens - block_tokens + 1, block_tokens)]
    else:
        field = "hash_ids" if "hash_ids" in row else "block_hashes"
        if field not in row:
            raise ConfigError(where, line[:80], "an object with hash_ids, block_hashes or tokens")
        hashes = _int_list(row[field], f"{where}.{field}")
        input_tokens = row.get("input_length", len(hashes) * block_tokens)
        if type(input_tokens) is not int or input_tokens < 0:
            raise ConfigError(f"{where}.input_length", input_tokens, "tokens, an integer >= 0")
        _check_blocks(len(hashes), input_tokens, block_tokens, where)
        blocks = list(hashes[:input_tokens // block_tokens])
    timestamp = row.get("timestamp", 0)
    if not isinstance(timestamp, int | float):
        raise ConfigError(f"{where}.timestamp", timestamp, "milliseconds, a number")
    keys, parents = _chain(blocks, interned)
    return TraceRequest(keys, parents, input_tokens, timestamp / 1e3)


def _check_blocks(hashes: int, input_tokens: int, block_tokens: int, where: str) -> None:
    """`hashes` blocks of `block_tokens`, the last possibly partial but never empty, must
    hold `input_tokens`: more than (hashes - 1) blocks' tokens and at most hashes blocks'.

    Raises:
        ConfigError: they do not; it names the block sizes the line would fit.
    """
    low, high = max(hashes - 1, 0) * block_tokens, hashes * block_tokens
    if low < input_tokens <= high or input_tokens == hashes == 0:
        return
    if not hashes or not input_tokens:
        raise ConfigError(f"{where}.input_length", input_tokens,
                          "0 tokens with no hashes, more with some (a block is never empty)")
    # the sizes b with (hashes - 1) x b < input_tokens <= hashes x b
    smallest = -(-input_tokens // hashes)
    largest = (input_tokens - 1) // (hashes - 1) if hashes > 1 else None
    if largest is not None and largest < smallest:
        fits = "no block size fits the line"
    elif largest == smallest:
        fits = (f"the line fits blocks of {smallest} tokens: was the trace written in blocks "
                f"of {smallest}? (--trace-block-tokens {smallest})")
    else:
        sizes = f"{smallest:,} or more" if largest is None else f"{smallest:,}-{largest:,}"
        fits = (f"the line fits blocks of {sizes} tokens: was the trace written in another "
                "block size? (--trace-block-tokens N)")
    raise ConfigError(f"{where}.input_length", input_tokens,
                      f"{hashes} block{'s' * (hashes != 1)} of {block_tokens} tokens (the last "
                      f"one possibly partial, never empty) hold {low + 1:,}-{high:,}; {fits}")


def _chain(blocks: Iterable[Hashable],
           interned: dict[tuple[int, Hashable], int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Chained keys of a prompt's blocks: a key names the whole prefix up to its block."""
    keys: list[int] = []
    parents: list[int] = []
    parent = ROOT
    for block in blocks:
        key = interned.setdefault((parent, block), len(interned))
        keys.append(key)
        parents.append(parent)
        parent = key
    return tuple(keys), tuple(parents)


def _int_list(value: object, field: str) -> list[int]:
    """`value` as a list of ints.

    Raises:
        ConfigError: anything else.
    """
    if not isinstance(value, list) or not all(type(v) is int for v in value):
        raise ConfigError(field, str(value)[:80], "a list of integers")
    return value


def write_workload_trace(config: WorkloadConfig, requests: int, block_tokens: int, seed: int,
                         path: str | Path) -> int:
    """Write `requests` requests of synthetic traffic (`kvtier.tools.sim.workload`) to `path`
    as a generic trace: each prompt's blocks of `block_tokens` as chained hashes (a partial
    last one as 0: never stored), its length and arrival, and the block size (so that
    `read_trace` reads it back in that size unasked). Returns the requests written.

    Raises:
        ConfigError: requests < 0 or block_tokens < 1.
        OSError: `path` cannot be written.
    """
    written = 0
    with open(path, "w", encoding="utf-8") as out:
        for request in generate(config, requests, block_tokens, seed):
            full = request.prompt_tokens // block_tokens
            # the partial last block: a placeholder hash (only full blocks are ever stored)
            blocks = request.hashes[:full] + [0] * (request.prompt_tokens % block_tokens > 0)
            out.write(json.dumps({"timestamp": round(request.arrival_s * 1e3),
                                  "input_length": request.prompt_tokens,
                                  "block_tokens": block_tokens,
                                  "block_hashes": blocks}) + "\n")
            written += 1
    return written
