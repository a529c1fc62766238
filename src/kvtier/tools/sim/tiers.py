"""kvtier's offload tiers as the simulator sees them: capacity, bandwidth, eviction.

A tier holds block hashes (the KV itself is never materialised). Blocks are written through
to the first tier as the GPU computes them (vLLM's OffloadingConnector stores completed
blocks as they are produced); a tier that overflows demotes its victim to the next tier, and
the last tier drops it. A lookup walks a prompt's hashes past the GPU hits and finds each
block in the first tier that has it, stopping at the first block no tier holds; the engine
takes all of the hit or, under the load-or-recompute rule, its prefix that loads faster
than it recomputes (engine.py); blocks taken from below the first tier are promoted into
it. Loads queue on each tier's read channel, so
concurrent loads (and engines sharing a tier) contend for its bandwidth.

Eviction order comes from `kvtier.core.policies` (LRU, ARC), the same policies the real
tiers use.

Primitives:
    TierSpec, TIER_PRESETS, parse_tier("cpu=64GiB[:arc]")
    SimTier       -- one tier's residency, policy, read channel and counters
    TierStack     -- the ordered tiers of one engine (shared tiers appear in several stacks):
                     store, find / take (lookup: both), load_costs, schedule_load
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from kvtier.core.policies import POLICIES, EvictionPolicy, make_policy
from kvtier.core.tier import Locality
from kvtier.errors import ConfigError
from kvtier.tiers.registry import tier_class
from kvtier.tools.ops.hardware import DRAM_GBPS, NVME_GBPS
from kvtier.units import parse_size


@dataclass(frozen=True, slots=True)
class TierSpec:
    """One offload tier."""

    name: str  # "cpu", "nvme", "shared", "redis" (display and report key)
    capacity_bytes: int  # bytes of KV it holds
    read_gbps: float  # effective read bandwidth of the medium, GB/s (the link caps it too)
    latency_s: float  # fixed cost of one load from it (lookup, I/O submission, RTT)
    policy: str = "lru"  # eviction policy, one of kvtier.core.policies.POLICIES (presets: the
    # kind's default, as its config has it: `prefix` for memory)
    shared: bool = False  # one instance shared by every engine of the fleet (a REMOTE kind)

    def __post_init__(self) -> None:
        if self.capacity_bytes < 0:
            raise ConfigError(f"tier.{self.name}.capacity", self.capacity_bytes, "bytes >= 0")
        if self.read_gbps <= 0:
            raise ConfigError(f"tier.{self.name}.read_gbps", self.read_gbps, "GB/s > 0")
        if self.latency_s < 0:
            raise ConfigError(f"tier.{self.name}.latency_s", self.latency_s, "seconds >= 0")
        if self.policy not in POLICIES:
            raise ConfigError(f"tier.{self.name}.policy", self.policy, f"one of {POLICIES}")


def _preset(name: str, kind: str, read_gbps: float, latency_s: float) -> TierSpec:
    """The simulated tier `name` of kvtier tier `kind`: its default eviction policy, shared
    by the fleet when the kind's class is REMOTE (`kvtier.core.tier.Tier.locality`)."""
    cls = tier_class(kind)
    return TierSpec(name, 0, read_gbps, latency_s,
                    policy=cls.config_model.model_fields["eviction"].default,
                    shared=cls.locality is Locality.REMOTE)


# Each preset is a kvtier tier kind on typical hardware: bandwidths from
# kvtier.tools.ops.hardware; latencies are typical per-request costs.
TIER_PRESETS: dict[str, TierSpec] = {
    "cpu": _preset("cpu", "memory", DRAM_GBPS, 50e-6),
    "nvme": _preset("nvme", "disk", NVME_GBPS[4], 200e-6),
    "shared": _preset("shared", "shared", 2.0, 2e-3),  # NFS/Lustre-class mount
    "redis": _preset("redis", "redis", 1.2, 1e-3),  # one server over 10-25 GbE
    # an S3-compatible bucket: ~8 GETs in flight of ~100 MB/s each, ~20 ms to first byte
    # (S3 Standard; on-premise MinIO/Ceph RGW are nearer 2-5 ms)
    "s3": _preset("s3", "s3", 0.8, 20e-3),
}


def parse_tier(text: str) -> TierSpec:
    """Parse "NAME=SIZE[:POLICY]", e.g. "cpu=64GiB" or "nvme=2TiB:arc" (no POLICY: the
    kind's default).

    Raises:
        ConfigError: unknown tier name, bad size or unknown policy.
    """
    name, _, rest = text.partition("=")
    name = name.strip().lower()
    if name not in TIER_PRESETS or not rest:
        raise ConfigError("tier", text, f"NAME=SIZE[:POLICY], NAME one of {list(TIER_PRESETS)}")
    size, _, policy = rest.partition(":")
    return replace(TIER_PRESETS[name], capacity_bytes=parse_size(size, f"tier.{name}"),
                   policy=policy.strip().lower() or TIER_PRESETS[name].policy)


class SimTier:
    """Residency and counters of one tier. Single-threaded (the simulator's loop)."""

    __slots__ = (
        "busy_until_s",
        "capacity_blocks",
        "cut_blocks",
        "evicted_blocks",
        "hit_blocks",
        "loads",
        "parents",
        "policy",
        "resident",
        "spec",
        "stored_blocks",
    )

    def __init__(self, spec: TierSpec, block_bytes: float) -> None:
        self.spec = spec
        self.capacity_blocks = int(spec.capacity_bytes // block_bytes)
        self.resident: set[int] = set()
        # Each resident block's parent (the block before it in its prompt; None for a first
        # block): the prefix policy ranks by it, as the memory tier does by ChunkMeta.parent.
        self.parents: dict[int, int | None] = {}
        self.policy: EvictionPolicy[int] = make_policy(spec.policy, max(1, self.capacity_blocks))
        self.busy_until_s = 0.0  # when its read channel is free again
        self.hit_blocks = 0  # blocks served to the GPU (loaded)
        self.cut_blocks = 0  # blocks found but recomputed: loading them was slower
        self.stored_blocks = 0  # blocks written into it (stores, demotions, promotions)
        self.evicted_blocks = 0  # blocks it pushed out
        self.loads = 0  # load operations served

    def put(self, h: int, parent: int | None) -> tuple[int, int | None] | None:
        """Make `h`, extending `parent`, resident (touching it if it is); return the victim it
        displaced with the victim's parent, if any."""
        if h in self.resident:
            self.policy.touch(h)
            return None
        self.resident.add(h)
        self.parents[h] = parent
        self.policy.insert(h, parent)
        self.stored_blocks += 1
        if len(self.resident) <= self.capacity_blocks:
            return None
        victim = self.policy.evict()
        assert victim is not None, "policy lost track of resident blocks"
        self.resident.discard(victim)
        self.evicted_blocks += 1
        return victim, self.parents.pop(victim)


class TierStack:
    """The tiers below one engine's GPU, fastest first."""

    def __init__(self, tiers: list[SimTier], link_gbps: float, block_bytes: float) -> None:
        self.tiers = [t for t in tiers if t.capacity_blocks > 0]
        self.link_gbps = link_gbps
        self.block_bytes = block_bytes
        # Seconds per block from each tier: the slower of the medium and the GPU's links.
        self.block_s = [block_bytes / (min(t.spec.read_gbps, link_gbps) * 1e9)
                        for t in self.tiers]

    @property
    def enabled(self) -> bool:
        """Whether any tier can hold a block."""
        return bool(self.tiers)

    def store(self, h: int, parent: int | None) -> None:
        """Write `h` (extending `parent`, None for a prompt's first block) through to the
        first tier, cascading victims downward."""
        for tier in self.tiers:
            victim = tier.put(h, parent)
            if victim is None:
                return
            h, parent = victim

    def lookup(self, hashes: list[int], start: int, end: int) -> list[int]:
        """Count contiguous hits of hashes[start:end] per tier, promoting lower-tier hits
        (`find` then `take`, every hit taken).

        Returns:
            one count per tier (all zero when the first block is nowhere).
        """
        return self.take(hashes, start, self.find(hashes, start, end))

    def find(self, hashes: list[int], start: int, end: int) -> list[int]:
        """The tier (index, fastest first) of each contiguous hit of hashes[start:end], in
        prompt order, stopping at the first block no tier holds. Touches each hit."""
        found: list[int] = []
        tiers = self.tiers
        for i in range(start, end):
            h = hashes[i]
            for k, tier in enumerate(tiers):
                if h in tier.resident:
                    tier.policy.touch(h)
                    found.append(k)
                    break
            else:
                break
        return found

    def take(self, hashes: list[int], start: int, found: list[int]) -> list[int]:
        """Serve the hit blocks hashes[start:start + len(found)] from the tiers `found`
        names (a prefix of `find`'s answer): count them and promote lower-tier ones.

        Returns:
            one count per tier.
        """
        tiers = self.tiers
        counts = [0] * len(tiers)
        for k in found:
            counts[k] += 1
        for k, n in enumerate(counts):
            tiers[k].hit_blocks += n
        if len(tiers) > 1 and any(counts[1:]):
            for i in range(start + counts[0], start + sum(counts)):
                self.store(hashes[i], hashes[i - 1] if i else None)
        return counts

    def load_costs(self) -> tuple[list[float], list[float]]:
        """What a load costs on each tier: (its latency, seconds per block). A wait for the
        tier's channel is left out, as the connector times a load from its first read."""
        return [t.spec.latency_s for t in self.tiers], self.block_s

    def schedule_load(self, now_s: float, counts: list[int]) -> float:
        """Queue the loads for `counts` blocks per tier; return when the last one lands."""
        t = now_s
        for k, n in enumerate(counts):
            if n:
                tier = self.tiers[k]
                start = t if t > tier.busy_until_s else tier.busy_until_s
                t = start + tier.spec.latency_s + n * self.block_s[k]
                tier.busy_until_s = t
                tier.loads += 1
        return t
