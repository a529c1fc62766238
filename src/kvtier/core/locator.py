"""Which leading chunks of a prompt are held, answered for a process that does not own the
tiers (vLLM's scheduler), without blocking it on slow I/O.

Two sources, in order:
  1. an index of keys the data-owning processes reported as stored (an LRU set; covers the
     process-private memory tier), and
  2. probes of tiers other processes can see (disk, shared directory, remote stores): how
     chunks written before a restart, or by another engine, are found. Probes cheap enough
     for the caller's thread (a local stat) run inline; slower ones (NFS, network) run on a
     thread, and the caller is told RETRY ("not ready, ask again") until they finish, or
     for `timeout_s` at most: a probe that has not answered by then (a dead NFS server, a
     Redis that never replies) leaves the rest of the prefix a miss, and no slow probe is
     started until it returns (the scheduler goes on with the index and the local probes).
A stale answer costs a failed load (reported to the engine and recomputed), never wrong KV.
Where the inline probe answers for every chunk stored and evictions are not reported (node
mode: the node's RAM, which every engine's stores evict from), it is asked first and the index
only while it cannot answer (`index_first` False: a node down, whose slab the engine still
reads in place), so that a chunk the node evicted is a miss, not a failed load. There the
alternatives of `first_held` (a chunk's tails) that the inline probe does not find are asked of
the slow probes as well (RETRY meanwhile): the index cannot say what the node holds below RAM.

The probes are the tiers' (`kvtier.core.tier.Probe`, built by a tier class that is a
`ProbeSource`).

Primitives: `ChunkIndex`, `ChunkLocator`, `Located` + `LookupStatus` (modelled on vLLM's kv_offload
`LookupResult`: MISS / HIT / RETRY; kvtier has no HIT_PENDING, a chunk is held or not).
"""

from __future__ import annotations

import logging
import math
import time
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from enum import Enum, auto
from typing import Any, Literal

from kvtier.core.keys import ChunkKey
from kvtier.core.threads import IOPool
from kvtier.core.tier import BatchLookup, Probe
from kvtier.errors import TierUnavailable

log = logging.getLogger(__name__)
FIRST_BATCH = 8  # keys in a batch probe's first ask (then 16, 32, ...)


class LookupStatus(Enum):
    """How a `ChunkLocator.locate` call ended."""

    MISS = auto()  # not even the first chunk is held
    HIT = auto()  # the first `num_chunks` chunks are held
    RETRY = auto()  # a slow probe is still running: ask again on a later call


@dataclass(frozen=True, slots=True)
class Located:
    """The answer of `ChunkLocator.locate`."""

    status: LookupStatus
    # Leading chunks held (HIT); RETRY: those known held so far (what the index and the inline
    # probes found), the slow probe asking about the rest; MISS: 0.
    num_chunks: int = 0

    @staticmethod
    def prefix(num_chunks: int) -> Located:
        """HIT of `num_chunks` leading chunks, or MISS when that is 0."""
        return Located(LookupStatus.HIT, num_chunks) if num_chunks else MISS


MISS = Located(LookupStatus.MISS)


class ChunkIndex:
    """Keys believed held, as an LRU set of at most `max_keys` (memory stays bounded), each
    with the name of the tier a probe found it in (None: reported stored by its owner)."""

    def __init__(self, max_keys: int) -> None:
        self._keys: OrderedDict[ChunkKey, str | None] = OrderedDict()
        self._max_keys = max(1, max_keys)

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def __len__(self) -> int:
        return len(self._keys)

    def add(self, key: ChunkKey, found_in: str | None = None) -> None:
        self._keys[key] = found_in
        self._keys.move_to_end(key)
        while len(self._keys) > self._max_keys:
            self._keys.popitem(last=False)

    def found_in(self, key: ChunkKey) -> str | None:
        """The tier a probe found `key` in; None when unknown or reported stored."""
        return self._keys.get(key)

    def discard(self, key: ChunkKey) -> None:
        self._keys.pop(key, None)

    def prefix_length(self, keys: Sequence[ChunkKey]) -> int:
        """Number of leading `keys` held."""
        for i, key in enumerate(keys):
            if key not in self._keys:
                return i
            self._keys.move_to_end(key)
        return len(keys)


def _probed_prefix(probes: Sequence[tuple[str, Probe]],
                   keys: Sequence[ChunkKey]) -> list[str]:
    """The leading `keys` that some probe finds: for each, the first (fastest) tier whose
    probe finds it. A probe that offers `BatchLookup` (a remote store: a pipelined round
    trip, parallel HEADs) is asked in batches that double from FIRST_BATCH keys, so that a
    long prefix costs a few round trips, not one per chunk, and a short one little more."""
    found: list[str] = []
    answers: dict[int, tuple[int, list[bool]]] = {}  # probe -> (first key asked, answers)
    for i in range(len(keys)):
        tier = next((name for j, (name, probe) in enumerate(probes)
                     if _holds(probe, j, answers, keys, i)), None)
        if tier is None:
            break
        found.append(tier)
    return found


def _first_found(probes: Sequence[tuple[str, Probe]], keys: Sequence[ChunkKey]
                 ) -> tuple[int, str] | None:
    """The first of `keys` (alternatives) that a probe finds, and that probe's tier: each
    probe, fastest first, asked once for all of them (`BatchLookup`: one round trip)."""
    for name, probe in probes:
        held = (probe.contains_many(list(keys)) if isinstance(probe, BatchLookup)
                else [probe.contains(key) for key in keys])
        first = next((i for i, h in enumerate(held) if h), None)
        if first is not None:
            return first, name
    return None


def _holds(probe: Probe, j: int, answers: dict[int, tuple[int, list[bool]]],
           keys: Sequence[ChunkKey], i: int) -> bool:
    """Whether probe `j` finds `keys[i]`, from its batch answers (asking the next batch when
    they end before i) or by asking it alone."""
    if not isinstance(probe, BatchLookup):
        return probe.contains(keys[i])
    first, held = answers.get(j, (i, []))
    if i >= first + len(held):
        first, held = i, probe.contains_many(keys[i:i + max(FIRST_BATCH, 2 * len(held))])
        answers[j] = first, held
    return held[i - first]


class ChunkLocator:
    """Index + probes. Called from one thread (the scheduler's); probes run on its own."""

    def __init__(self, probes: Mapping[str, Probe], max_keys: int,
                 timeout_s: float = 2.0, index_first: bool = True) -> None:
        """Args:
            probes: the probes of the tiers this process can see (see `Probe`), by tier
                name, fastest tier first. An inline probe that cannot answer now raises
                TierUnavailable (then: the index alone).
            max_keys: the index's bound.
            timeout_s: how long a lookup may wait for the slow probes (then: a miss).
            index_first: the index answers before the inline probes; False: they do, and
                past what they find, the index's keys a slow probe found; the whole index
                only while they cannot answer (see above).
        """
        self.index = ChunkIndex(max_keys)
        self._index_first = index_first
        self._inline = [(name, p) for name, p in probes.items() if p.blocking_ok]
        self._slow_probes = [(name, p) for name, p in probes.items() if not p.blocking_ok]
        self._all = list(probes.items())
        self._slow_names = {name for name, _ in self._slow_probes}
        self._slow = bool(self._slow_names)
        self._pool = (IOPool(2, "kvtier-probe") if self._slow
                      else None)
        self._timeout_s = timeout_s
        # request id -> (prefix held before the probe, the probe, when it started)
        self._pending: dict[str, tuple[int, Future[list[str]], float]] = {}
        # request id -> (the first key its last finished probe did not find, when): the answer
        # of its next lookup too within timeout_s (one that a RETRY of its tails' probe made,
        # a step later), which then asks no second probe of the same keys.
        self._missed: dict[str, tuple[ChunkKey, float]] = {}
        # request id -> (alternatives asked, the slow probes' answer, when they started, when
        # their miss was first taken or None): `first_held` where the index cannot say what
        # the tiers hold (node mode). A miss stays the answer of its next lookups within
        # timeout_s: a lookup that RETRYs while its chunks' probe runs takes it and drops it.
        self._firsts: dict[str, tuple[tuple[ChunkKey, ...], Future[tuple[int, str] | None],
                                      float, float | None]] = {}
        self._stuck: Future[Any] | None = None  # a probe that outlived timeout_s
        self.timeouts = 0  # lookups that gave up waiting for a probe

    @property
    def index_first(self) -> bool:
        """Whether the index says what the tiers hold (False: node mode, where the node evicts
        chunks without reporting them, and the index answers only while the node cannot)."""
        return self._index_first

    def record_stored(self, keys: Iterable[ChunkKey]) -> None:
        for key in keys:
            self.index.add(key)

    def record_missing(self, keys: Iterable[ChunkKey]) -> None:
        for key in keys:
            self.index.discard(key)

    def locate(self, request_id: str, keys: Sequence[ChunkKey]) -> Located:
        """How many leading `keys` are held: HIT (or MISS), or RETRY while a slow probe for
        this request runs (ask again on a later call). Scheduler thread only."""
        held = self._held_now(keys)
        missed, when = self._missed.pop(request_id, (None, -math.inf))
        if held == len(keys) or not self._slow or (
                keys[held] == missed and time.monotonic() - when < self._timeout_s):
            self._pending.pop(request_id, None)
            return Located.prefix(held)
        pending = self._pending.get(request_id)
        if pending is None:
            if self._probes_stuck():
                return Located.prefix(held)
            assert self._pool is not None
            future = self._pool.submit(_probed_prefix, self._all, list(keys[held:]))
            self._pending[request_id] = (held, future, time.monotonic())
            return Located(LookupStatus.RETRY, held)
        start, future, started = pending
        landed = self._landed(future, started)
        if not landed:
            if landed is None:
                del self._pending[request_id]
                return Located.prefix(held)
            return Located(LookupStatus.RETRY, held)
        del self._pending[request_id]
        found = future.result() if future.exception() is None else []
        held = max(held, self._extend(start, keys, found))
        if held < len(keys):
            self._missed[request_id] = (keys[held], time.monotonic())
        return Located.prefix(held)

    def _landed(self, future: Future[Any], started: float) -> bool | None:
        """Whether a slow probe started at `started` has answered: False while it may still,
        None once it took over `timeout_s` (a miss; it is the stuck probe from now on)."""
        if future.done():
            return True
        if time.monotonic() - started < self._timeout_s:
            return False
        self.timeouts += 1
        self._stuck = future
        log.warning("kvtier: a slow tier's lookup took over %.3g s; the rest of the "
                    "prefix is a miss, and slow tiers are not asked until it answers",
                    self._timeout_s)
        return None

    def _held_now(self, keys: Sequence[ChunkKey]) -> int:
        """Leading `keys` held by what answers at once: the index and the inline probes."""
        if self._index_first:
            held = self.index.prefix_length(keys)
            return self._extend(held, keys, self._inline_prefix(keys[held:]))
        try:  # what they find is indexed too: for when they cannot tell (a node down)
            held = self._extend(0, keys, _probed_prefix(self._inline, keys))
        except TierUnavailable:
            return self.index.prefix_length(keys)  # what was stored or found, meanwhile
        for key in keys[held:]:  # then what a slow probe found
            if self.index.found_in(key) not in self._slow_names:
                break
            held += 1
        return held

    def _inline_prefix(self, keys: Sequence[ChunkKey]) -> list[str]:
        try:
            return _probed_prefix(self._inline, keys)
        except TierUnavailable:
            return []

    def first_held(self, keys: Sequence[ChunkKey], request_id: str | None = None
                   ) -> int | Literal[LookupStatus.RETRY] | None:
        """The index of the first of `keys` held (alternatives, e.g. a chunk's tails, longest
        first), or None: the index, then each inline probe asked once for all of them
        (`BatchLookup`: one round trip). Where the index says what the tiers hold
        (`index_first`, in process), slow probes are not asked (a miss costs no RETRY): a
        chunk only they hold is found once an engine reports it stored. Where it does not
        (node mode: the node's tiers below RAM are its slow probe, and the index only answers
        while the node cannot), what a slow probe found is held, and else the slow probes are
        asked, off this thread, for `request_id` (None: not asked): RETRY until they answer,
        as `locate`'s; their miss answers the request's lookups of the same keys for
        `timeout_s` (a lookup that RETRYs on its chunks' probe meanwhile takes it and drops
        it). Scheduler thread."""
        indexed = next((i for i, key in enumerate(keys) if key in self.index), None)
        if self._index_first and indexed is not None:
            return indexed
        for name, probe in self._inline:
            try:
                found = _first_found([(name, probe)], keys)
            except TierUnavailable:
                if not self._index_first:
                    return indexed  # what was stored, while the probe cannot tell
                continue
            if found is not None:
                self.index.add(keys[found[0]], name)
                return found[0]
        if self._index_first or not self._slow or request_id is None:
            return None
        found_below = next((i for i, key in enumerate(keys)
                            if self.index.found_in(key) in self._slow_names), None)
        if found_below is not None:
            return found_below
        return self._first_held_slowly(request_id, keys)

    def _first_held_slowly(self, request_id: str, keys: Sequence[ChunkKey]
                           ) -> int | Literal[LookupStatus.RETRY] | None:
        """`first_held` of the slow probes, asked on the probe thread for `request_id`."""
        asked, now = tuple(keys), time.monotonic()
        pending = self._firsts.pop(request_id, None)
        if pending is not None and (pending[0] != asked or (  # the lookup moved on, or
                pending[3] is not None and now - pending[3] >= self._timeout_s)):  # old miss
            pending[1].cancel()
            pending = None
        if pending is None:
            if self._probes_stuck():
                return None
            assert self._pool is not None
            future = self._pool.submit(_first_found, self._slow_probes, asked)
            self._firsts[request_id] = (asked, future, now, None)
            return LookupStatus.RETRY
        _, future, started, missed = pending
        landed = self._landed(future, started)
        if landed is False:
            self._firsts[request_id] = pending
            return LookupStatus.RETRY
        found = future.result() if landed and future.exception() is None else None
        if found is None:
            if landed:  # the answer of the next lookups too, within timeout_s
                self._firsts[request_id] = (asked, future, started,
                                            now if missed is None else missed)
            return None
        self.index.add(keys[found[0]], found[1])
        return found[0]

    def _probes_stuck(self) -> bool:
        """Whether a probe that outlived timeout_s is still running."""
        if self._stuck is not None and self._stuck.done():
            log.warning("kvtier: the stuck lookup answered; slow tiers are asked again")
            self._stuck = None
        return self._stuck is not None

    def found_in(self, key: ChunkKey) -> str | None:
        """The tier a probe found `key` in; None when unknown or reported stored."""
        return self.index.found_in(key)

    def _extend(self, start: int, keys: Sequence[ChunkKey], found: list[str]) -> int:
        """Remember the keys after `start` that probes `found` (their tiers) as held, so the
        next lookup is an index hit."""
        for key, tier in zip(keys[start:], found):
            self.index.add(key, tier)
        return start + len(found)

    def forget(self, request_id: str) -> None:
        """Drop a finished request's pending probes."""
        self._missed.pop(request_id, None)
        pending = self._pending.pop(request_id, None)
        if pending is not None:
            pending[1].cancel()
        first = self._firsts.pop(request_id, None)
        if first is not None:
            first[1].cancel()

    def close(self) -> None:
        """Stop asking, and close every probe (their connections and threads end). A probe
        still running is waited for up to `timeout_s` (none is known stuck), so that none is
        closed under a call that would reopen what it closed; its answer is dropped.
        Scheduler thread."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            if self._stuck is None or self._stuck.done():
                self._pool.join(self._timeout_s)
        for _name, probe in self._all:
            probe.close()
