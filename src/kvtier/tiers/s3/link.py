"""The s3 tier's link measured with a probe object: its `kvtier.core.tier.LinkProbe`
(issue 45: an endpoint across a WAN, or behind a slow link, can be slower than a recompute,
and the load-or-recompute rule needs to know before the first load is timed).

A probe object of PROBE_BYTES (random bytes) is PUT at `<key_prefix>/<digest>/link-probe-<32
hex>` (a name no chunk listing counts: `inventory.parse_chunk_name`), then:
  - the round trip: the best of ROUND_TRIPS HEADs of it;
  - the bandwidth: the best of BANDWIDTH_ROUNDS rounds of STREAMS GETs of it at once (a load
    reads several chunks at once, and one S3 stream carries far less than several), less
    the round trip;
and it is DELETEd (a process killed in between leaves that one object; a `ttl_days`
lifecycle rule on the prefix expires it). Credentials without s3:DeleteObject (docs/s3.md
asks for it only with a capacity) have the delete refused: the measure still counts, and the
tier's later measures PUT over the object left (`ProbeObject`), so a tier leaves one, not a
fresh 1 MiB object a minute (tests/tiers/test_link_probes.py). Each call goes through the
tier's circuit breaker; each timing checks the deadline first (`links.best_of`). Its cost: 1
PUT, 3 HEADs, 8 GETs of 1 MiB, 1 DELETE.

Primitives: `measure_endpoint`, `ProbeObject`, `PROBE_BYTES`, `probe_name`.
"""

from __future__ import annotations

import functools
import logging
import os
import time
import uuid
from collections.abc import Callable
from typing import Any

from kvtier.core.tier import LinkSpeed
from kvtier.tiers.links import best_of, check_deadline, in_parallel
from kvtier.tiers.s3.client import S3Errors, error_code, is_refused
from kvtier.tiers.s3.inventory import S3Names

log = logging.getLogger("kvtier.tiers.s3.tier")

PROBE_BYTES = 1 << 20  # 1 MiB cross a 100 Mbit/s link in 84 ms
ROUND_TRIPS = 3
BANDWIDTH_ROUNDS = 2
STREAMS = 4  # GETs at once in a bandwidth round
Run = Callable[[Callable[[Any], Any]], Any]  # S3Tier._run: a call through the breaker


def probe_name(names: S3Names) -> str:
    """A fresh probe object's name in the namespace of `names`."""
    return f"{names.namespace_prefix()}link-probe-{uuid.uuid4().hex}"


class ProbeObject:
    """A tier's probe object: a fresh name each measure, until a delete is refused; then the
    object left, measured (and overwritten) by each later measure. Its measures run one at a
    time (`links.BoundedMeasure`)."""

    def __init__(self, names: S3Names) -> None:
        self.names = names
        self.kept: str | None = None  # the object a refused delete left

    def name(self) -> str:
        return self.kept or probe_name(self.names)

    def delete(self, run: Run, bucket: str, name: str) -> None:
        """DELETE `name`; a refusal keeps it for the next measure (logged once).

        Raises: as `run`, but a refusal (403)."""
        try:
            run(lambda c: c.delete_object(Bucket=bucket, Key=name))
        except S3Errors().answered as exc:
            if not is_refused(exc):
                raise
            if self.kept is None:
                log.info("s3 tier: the delete of link probe object %s was refused (%s): the "
                         "next measures write over it", name, error_code(exc))
            self.kept = name


def measure_endpoint(run: Run, bucket: str, names: S3Names, deadline: float,
                     size_bytes: int = PROBE_BYTES, probe: ProbeObject | None = None
                     ) -> LinkSpeed:
    """The link to the endpoint (see the module docstring), with `probe`'s object (None: a
    fresh one). Blocking: the caller bounds it (`kvtier.tiers.links.BoundedMeasure`).

    Raises:
        TierUnavailable: the endpoint is down or did not answer (`run`'s).
        botocore ClientError: it answered with an error (403, 503, ...).
        LinkTimeout: `deadline` (monotonic) passed between two calls.
    """
    probe = probe or ProbeObject(names)
    name = probe.name()
    body = os.urandom(size_bytes)
    run(lambda c: c.put_object(Bucket=bucket, Key=name, Body=body))
    try:
        round_trip_s = best_of(ROUND_TRIPS, lambda: _timed(
            [lambda: run(lambda c: c.head_object(Bucket=bucket, Key=name))], deadline),
            deadline)
        get = functools.partial(_get, run, bucket, name, size_bytes)
        round_s = best_of(BANDWIDTH_ROUNDS, lambda: _timed([get] * STREAMS, deadline),
                          deadline)
    finally:
        probe.delete(run, bucket, name)
    return LinkSpeed(round_trip_s, STREAMS * size_bytes / max(round_s - round_trip_s, 1e-6))


def _get(run: Run, bucket: str, name: str, size_bytes: int) -> None:
    """GET the probe object, its body read to the end. Raises OSError on a short body (not
    inside `run`: the breaker would take it for the endpoint down)."""
    got = run(lambda c: len(c.get_object(Bucket=bucket, Key=name)["Body"].read()))
    if got != size_bytes:
        raise OSError(f"the probe object came back with {got} of {size_bytes} bytes")


def _timed(calls: list[Callable[[], Any]], deadline: float) -> float:
    """Seconds the `calls` take, run at once, once the deadline is checked."""
    check_deadline(deadline)
    start = time.perf_counter()
    if len(calls) == 1:
        calls[0]()
    else:
        in_parallel(calls)
    return time.perf_counter() - start
