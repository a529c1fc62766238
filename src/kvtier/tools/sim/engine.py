"""One serving engine, step by step: continuous batching, chunked prefill, paged KV with a
prefix cache, preemption, and loads from kvtier's tiers.

The loop follows vLLM V1's scheduler in outline. Each step first lands finished tier loads,
then admits waiting requests first-come-first-served while the GPU pool has blocks for their
whole prompt (a GPU prefix-cache hit costs nothing; a tier hit is loaded asynchronously and
the request joins the batch when its load lands), then runs one batch: one token per
decoding request plus prefill chunks up to `max_batched_tokens`. When a decoding request needs
a block and none is free, the most recently admitted decoding request is preempted and later
re-prefilled (recompute mode), which the prefix cache and the tiers can make cheap.

Load or recompute (load_when, the connector's key of that name, offer.py): with "faster"
(the default) a tier hit is taken only as far as its load is expected to land before its
recompute would finish: of the hit's blocks b_1..b_n, the longest prefix b_1..b_k with
    sum(latency of each tier used) + sum(block seconds of tier(b_i), i <= k)
      <= prefill seconds of b_1..b_k
(`TierStack.load_costs`: the tier's own speed, the slower of medium and link;
`CostModel.prefill_s`: the request's own recompute, attention by position; neither counts
a queue, as the connector's measures do not); the rest is recomputed and counted per tier
as cut. The connector measures both sides; the simulator knows them, so it has no trial
loads. "always" loads every hit (a naive cache).

No work is done per token. Decode-only stretches are jumped over in one go: between two
events (a request finishing or crossing a block boundary, an arrival, a load landing) every
step has the same batch, and the context grows by one token per request per step, so the
time of k steps is a sum the cost model prices in closed form (secant of the roofline).

Primitives:
    EngineConfig  -- frozen scheduler and pool settings
    Engine        -- submit(request), run_until(t), in_flight(), drop_gpu_prefix_cache()
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass

from kvtier.errors import ConfigError
from kvtier.integrations.vllm.config import LOAD_WHEN
from kvtier.tools.sim.cost import CostModel
from kvtier.tools.sim.kvcache import GpuKVCache
from kvtier.tools.sim.report import EngineStats
from kvtier.tools.sim.tiers import TierStack
from kvtier.tools.sim.workload import Request

_INF = math.inf


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Scheduler and KV-pool settings of one engine (vLLM's names where they exist)."""

    block_tokens: int = 64  # tokens per KV block (prefix-cache and offload granularity)
    gpu_memory_utilization: float = 0.9  # share of HBM vLLM may use
    max_num_seqs: int = 256  # most requests running at once
    max_batched_tokens: int = 8192  # token budget of one step (chunked prefill)
    kv_blocks: int | None = None  # GPU pool size in blocks; None: from the cost model
    connector_overhead_s: float = 2e-4  # per-step scheduler cost of an offload connector
    load_when: str = "faster"  # a hit loaded as far as it beats recompute, or "always"

    def __post_init__(self) -> None:
        if self.block_tokens < 1:
            raise ConfigError("block_tokens", self.block_tokens, "an integer >= 1")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError("gpu_memory_utilization", self.gpu_memory_utilization,
                              "a fraction in (0, 1]")
        if self.max_num_seqs < 1:
            raise ConfigError("max_num_seqs", self.max_num_seqs, "an integer >= 1")
        if self.max_batched_tokens < 1:
            raise ConfigError("max_batched_tokens", self.max_batched_tokens, "an integer >= 1")
        if self.kv_blocks is not None and self.kv_blocks < 1:
            raise ConfigError("kv_blocks", self.kv_blocks, "an integer >= 1 or None")
        if self.connector_overhead_s < 0:
            raise ConfigError("connector_overhead_s", self.connector_overhead_s, "seconds >= 0")
        if self.load_when not in LOAD_WHEN:
            raise ConfigError("load_when", self.load_when, f"one of {LOAD_WHEN}")


class Engine:
    """One engine's state and loop. Single-threaded; driven by the fleet in time order."""

    def __init__(self, config: EngineConfig, cost: CostModel, tiers: TierStack) -> None:
        self.cfg, self.cost, self.tiers = config, cost, tiers
        self.bt = config.block_tokens
        blocks = config.kv_blocks
        if blocks is None:
            blocks = cost.kv_capacity_tokens(config.gpu_memory_utilization) // self.bt
        self.kv = GpuKVCache(blocks)
        self.stats = EngineStats()
        self.now = 0.0  # engine clock: end of the latest step
        self.G = 0  # steps run; a decoding request makes one token per step
        self.waiting: deque[Request] = deque()
        self.loading: list[tuple[float, int, Request]] = []  # (lands at, rid, request)
        self.prefilling: list[Request] = []
        self.decoding: dict[int, Request] = {}  # admission order: last is preempted first
        self.ctx_base = 0  # sum of (target - g0) over decoding: context = base + B * G
        self.events: list[tuple[int, int, Request, int]] = []  # (step, seq, req, version)
        self.seq = 0
        block_bytes_rank = cost.kv_bytes_per_token_rank * self.bt
        # Per step while offloading: the connector's scheduler work, plus the HBM reads of
        # the D2H copies of the blocks stored in the previous step.
        self.store_s_per_block = block_bytes_rank / cost.hbm_bytes_per_s
        self.offload_s = config.connector_overhead_s if tiers.enabled else 0.0
        self.store_debt_s = 0.0

    # -- public ---------------------------------------------------------------------------

    def submit(self, req: Request) -> None:
        """Queue an arrived request (its arrival_s may lie before `now`)."""
        self.stats.arrived += 1
        if -(-(req.prompt_tokens + req.output_tokens) // self.bt) > self.kv.total:
            self.stats.rejected += 1  # it could never fit, even alone
            return
        self.waiting.append(req)

    def in_flight(self) -> int:
        """Requests queued, loading, prefilling or decoding."""
        return len(self.waiting) + len(self.loading) + len(self.prefilling) + len(self.decoding)

    def drop_gpu_prefix_cache(self) -> None:
        """Forget unreferenced cached GPU blocks (validation: force the next hit to a tier)."""
        self.kv.drop_cached()

    def run_until(self, t_limit: float) -> None:
        """Run steps until the clock reaches `t_limit` (inf: until no work is left)."""
        while self.now < t_limit:
            self._land_loads()
            if self.waiting:
                self._admit()
            if self.prefilling:
                self._prefill_step()
            elif self.decoding:
                self._decode_stretch(t_limit)
            elif self.loading:
                self.now = max(self.now, min(self.loading[0][0], t_limit))
            elif t_limit == _INF:
                return
            else:
                self.now = t_limit

    # -- admission ------------------------------------------------------------------------

    def _admit(self) -> None:
        kv, cfg, bt, stats = self.kv, self.cfg, self.bt, self.stats
        while self.waiting:
            if len(self.decoding) + len(self.prefilling) + len(self.loading) >= cfg.max_num_seqs:
                return
            req = self.waiting[0]
            target = req.prompt_tokens + req.generated
            blocks = -(-target // bt)
            eligible = (target - 1) // bt  # the last token is always computed
            hits, reclaim = kv.match(req.hashes, eligible)
            if not kv.can_allocate(blocks - hits, reclaim):
                return  # head-of-line: wait for blocks to free up
            self.waiting.popleft()
            kv.acquire(req.hashes, hits, req.held)
            kv.allocate(blocks - hits)
            req.n_private = blocks - hits
            req.target = target
            stats.queried_blocks += eligible
            stats.gpu_hit_blocks += hits
            loaded, counts = 0, []
            if self.tiers.enabled and hits < eligible:
                counts = self._take_hit(req.hashes, hits, eligible)
                loaded = sum(counts)
            req.computed = (hits + loaded) * bt
            if loaded:
                req.load_blocks = loaded
                stats.loaded_blocks += loaded
                stats.loads += 1
                lands = self.tiers.schedule_load(self.now + self.cost.step_overhead_s, counts)
                heapq.heappush(self.loading, (lands, req.rid, req))
            else:
                self.prefilling.append(req)

    def _take_hit(self, hashes: list[int], start: int, end: int) -> list[int]:
        """Look up blocks start..end in the tiers and take what load_when allows; blocks
        per tier."""
        found = self.tiers.find(hashes, start, end)
        if found and self.cfg.load_when == "faster":
            keep = self._faster_prefix(found, start)
            for k in found[keep:]:
                self.tiers.tiers[k].cut_blocks += 1
            found = found[:keep]
        return self.tiers.take(hashes, start, found)

    def _faster_prefix(self, found: list[int], start: int) -> int:
        """The rule (module docstring): blocks of the hit `found` (tier per block, from
        block `start`) whose load is expected to land before their recompute."""
        fixed, per_block = self.tiers.load_costs()
        used = [False] * len(fixed)
        bt, load_s, offered = self.bt, 0.0, 0
        for i, k in enumerate(found):
            if not used[k]:
                used[k] = True
                load_s += fixed[k]
            load_s += per_block[k]
            if load_s <= self.cost.prefill_s(start * bt, (start + i + 1) * bt):
                offered = i + 1
        return offered

    def _land_loads(self) -> None:
        loading, kv = self.loading, self.kv
        while loading and loading[0][0] <= self.now:
            _, _, req = heapq.heappop(loading)
            start = len(req.held)
            for i in range(start, start + req.load_blocks):
                kv.register(req.hashes[i], req.held)
            req.n_private -= req.load_blocks
            req.load_blocks = 0
            self.prefilling.append(req)

    # -- steps ----------------------------------------------------------------------------

    def _extra_s(self) -> float:
        extra = self.offload_s + self.store_debt_s
        self.store_debt_s = 0.0
        return extra

    def _prefill_step(self) -> None:
        batch = len(self.decoding)
        ctx = self.ctx_base + batch * (self.G + 1)
        budget = self.cfg.max_batched_tokens - batch
        new_tokens, pairs, kv_read = batch, float(ctx), float(ctx)
        chunks: list[tuple[Request, int]] = []
        for req in self.prefilling:
            if budget <= 0:
                break
            done = req.computed
            c = req.target - done
            if c > budget:
                c = budget
            budget -= c
            new_tokens += c
            pairs += c * (2 * done + c + 1) / 2
            kv_read += done + c
            chunks.append((req, c))
        dt = self.cost.step_s(new_tokens, pairs, kv_read) + self._extra_s()
        self.now += dt
        self.G += 1
        self.stats.steps += 1
        self.stats.busy_s += dt
        finished = False
        for req, c in chunks:
            req.computed += c
            self.stats.prefill_tokens += c
            if req.generated:  # resumed after a preemption: this KV was computed before
                self.stats.recomputed_tokens += c
            if req.computed >= req.target:
                finished = True
                self._start_decoding(req)
        if finished:
            self.prefilling = [r for r in self.prefilling if r.computed < r.target]
        self._run_events()

    def _decode_stretch(self, t_limit: float) -> None:
        """Jump over k identical-batch decode steps, up to the next event or `t_limit`."""
        batch, cost = len(self.decoding), self.cost
        k_max = self.events[0][0] - self.G
        ctx0 = self.ctx_base + batch * (self.G + 1)
        f0 = cost.decode_step_s(batch, ctx0) + self.offload_s
        slope = 0.0
        if k_max > 1:
            f1 = cost.decode_step_s(batch, ctx0 + batch * (k_max - 1)) + self.offload_s
            slope = (f1 - f0) / (k_max - 1)
        stop = t_limit if not self.loading or self.loading[0][0] > t_limit else self.loading[0][0]
        k = k_max
        if stop < _INF:
            dt = stop - self.now - self.store_debt_s
            if slope > 1e-15:  # smallest k with k*f0 + slope*k(k-1)/2 >= dt
                b = f0 - slope / 2
                k_need = math.ceil((-b + math.sqrt(b * b + 2 * slope * max(dt, 0.0))) / slope)
            else:
                k_need = math.ceil(max(dt, 0.0) / f0)
            k = max(1, min(k_max, k_need))
        dt = k * f0 + slope * k * (k - 1) / 2 + self._extra_s()
        self.now += dt
        self.G += k
        self.stats.steps += k
        self.stats.busy_s += dt
        self._run_events()

    # -- request lifecycle ----------------------------------------------------------------

    def _store_new_blocks(self, req: Request, full_blocks: int) -> None:
        """Register the request's newly full blocks up to `full_blocks`; write them through."""
        held, kv, hashes = req.held, self.kv, req.hashes
        start = len(held)
        end = min(full_blocks, req.n_full_blocks)
        for i in range(start, end):
            kv.register(hashes[i], held)
        if end > start:
            req.n_private -= end - start
            if self.tiers.enabled:
                store = self.tiers.store
                for i in range(start, end):
                    store(hashes[i], hashes[i - 1] if i else None)
                self.store_debt_s += (end - start) * self.store_s_per_block

    def _start_decoding(self, req: Request) -> None:
        self._store_new_blocks(req, req.target // self.bt)
        req.generated += 1
        if req.first_token_s < 0:
            req.first_token_s = self.now
            self.stats.ttft_s.append(self.now - req.arrival_s)
        if req.generated >= req.output_tokens:
            self._finish(req)
            return
        req.g0 = self.G
        self.ctx_base += req.target - req.g0
        self.decoding[req.rid] = req
        self._push_event(req)

    def _push_event(self, req: Request) -> None:
        """Queue the request's next event: finishing, or filling its last block."""
        finish = req.g0 + req.output_tokens - req.generated
        blocks = len(req.held) + req.n_private
        boundary = req.g0 + blocks * self.bt - req.target
        self.seq += 1
        heapq.heappush(self.events, (min(finish, max(boundary, self.G)), self.seq, req,
                                     req.version))

    def _run_events(self) -> None:
        events, G = self.events, self.G
        while events and events[0][0] <= G:
            _, _, req, version = heapq.heappop(events)
            if version != req.version:
                continue  # preempted since
            if req.generated + G - req.g0 >= req.output_tokens:
                self._leave_decoding(req)
                self._finish(req)
            elif self._grow(req):
                self._push_event(req)

    def _grow(self, req: Request) -> bool:
        """Give a decoding request its next block; False when it was preempted instead."""
        kv = self.kv
        tokens = req.target + self.G - req.g0
        self._store_new_blocks(req, tokens // self.bt)
        while not kv.can_allocate(1):
            victim = self.decoding[next(reversed(self.decoding))]
            self._preempt(victim)
            if victim is req:
                return False
        kv.allocate(1)
        req.n_private += 1
        return True

    def _leave_decoding(self, req: Request) -> None:
        req.generated += self.G - req.g0
        self.ctx_base -= req.target - req.g0
        del self.decoding[req.rid]

    def _preempt(self, req: Request) -> None:
        self._leave_decoding(req)
        self.kv.release(req.held, req.n_private)
        req.n_private = 0
        req.version += 1
        self.stats.preemptions += 1
        self.waiting.appendleft(req)

    def _finish(self, req: Request) -> None:
        self.kv.release(req.held, req.n_private)
        req.n_private = 0
        req.hashes = []  # let the session's history go once its last request is done
        stats = self.stats
        stats.completed += 1
        stats.output_tokens += req.output_tokens
        stats.prompt_tokens += req.prompt_tokens
        stats.last_finish_s = self.now
