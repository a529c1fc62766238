"""The retention settings a tier may take (per-tenant quota, default TTL, pin bound), and
the `RetentionBook` built from them (`kvtier.core.retention`).

A tier's config model subclasses `RetentionTierSettings` to accept them (the memory tier
does); every setting is off by default except the pin bound, which only matters once a
request asks for a pin (`kv_transfer_params.retain_s`).

Primitives: `TenantQuotaSettings`, `RetentionTierSettings`, `build_book`, `book_problems`.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sized

from pydantic import Field, model_validator

from kvtier.config import FrozenModel, PositiveByteSize
from kvtier.core.keys import ChunkKey
from kvtier.core.retention import RetentionBook, TenantQuota
from kvtier.tiers.storeconfig import TierSettings


class TenantQuotaSettings(FrozenModel):
    """What one tenant (one cache salt; requests without a salt are the "default" tenant)
    may hold of the tier: exactly one of `share` and `cap`."""

    share: float | None = Field(None, gt=0, le=1)  # at most this share of the capacity
    # At most this many bytes, e.g. "2GiB"; more than 0, as a share is: a cap of 0 left every
    # tenant nothing, and the tier stored nothing, silently.
    cap: PositiveByteSize | None = None

    @model_validator(mode="after")
    def _one_limit(self) -> TenantQuotaSettings:
        if (self.share is None) == (self.cap is None):
            raise ValueError("exactly one of share (0-1] or cap (bytes, e.g. \"2GiB\")")
        return self

    def quota(self) -> TenantQuota:
        return TenantQuota(share=self.share, cap_bytes=self.cap)


class RetentionTierSettings(TierSettings):
    """Settings of a tier that keeps per-chunk tenant, pin and expiry (`MetaKeeper`)."""

    # Per-tenant limit, e.g. {"share": 0.5} or {"cap": "2GiB"}; a tenant at its limit
    # evicts its own least recently used chunks first. None: no quota.
    tenant_quota: TenantQuotaSettings | None = None
    # Chunks expire this long after they are stored unless their request set `ttl_s`
    # (a miss from then on; the space is reclaimed). None: never.
    ttl_s: float | None = Field(None, gt=0)
    # Pinned bytes (`kv_transfer_params.retain_s`) never exceed this share of the capacity:
    # a pin beyond it is refused (counted) and its chunk stored unpinned. 0: no pins.
    max_pinned_share: float = Field(0.5, ge=0, le=1)


def build_book(config: RetentionTierSettings, capacity_bytes: int,
               clock: Callable[[], float]) -> RetentionBook:
    """The `RetentionBook` of a tier of `capacity_bytes` with `config`'s settings."""
    quota = config.tenant_quota.quota() if config.tenant_quota is not None else None
    return RetentionBook(capacity_bytes, quota=quota, max_pinned_share=config.max_pinned_share,
                         ttl_s=config.ttl_s, clock=clock)


def book_problems(held: Collection[ChunkKey], policy: Sized, book: RetentionBook) -> list[str]:
    """`Checkable` lines of a tier that holds `held`: every held chunk is either in the
    eviction `policy` or pinned in the `book`, and the book names held chunks only. The
    caller holds the tier's lock."""
    problems = []
    pinned = sum(book.is_pinned(key) for key in held)
    if len(policy) + pinned != len(held):
        problems.append(f"{len(held)} chunks held, {len(policy)} evictable and {pinned} "
                        "pinned")
    strays = sum(key not in held for key, _meta in book.metas())
    if strays:
        problems.append(f"{strays} chunks in the tenants' books that the tier does not hold")
    return problems
