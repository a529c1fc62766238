"""The worker reports an estimate of each lower tier's restore cost at start-up, before any
load (issue 45): the disk's, the shared directory's and the s3 tier's too, measured by their
link probes (tests/tiers/test_link_probes.py), beside the redis tier's
(test_slow_first_hits.py). With real objects: a worker over a real store of a memory tier, a
disk and a shared directory in tmp_path, and the session's S3 endpoint (moto's server, or
KVTIER_TEST_S3_*).
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("vllm")

from s3_server import S3Endpoint
from test_slow_first_hits import BLOCKS_PER_CHUNK, CHUNKS, priors_reported
from test_worker_copy import BS, one_allocation_cpu_kv

from kvtier.core.tier import LinkSpeed
from kvtier.integrations.vllm.worker.connector_worker import (
    LINK_WINDOW,
    ConnectorWorker,
    PagedKV,
)
from kvtier.tiers import open_store
from kvtier.tiers.storeconfig import StoreConfig

pytestmark = [pytest.mark.s3]


def test_the_disk_shared_and_s3_tiers_estimates_are_reported_before_any_load(
        tmp_path: Path, s3_session: S3Endpoint) -> None:
    paged = PagedKV(one_allocation_cpu_kv(blocks=CHUNKS * BLOCKS_PER_CHUNK), BS)
    layout = paged.layout(BS * BLOCKS_PER_CHUNK)
    store = open_store(StoreConfig.parse({"tiers": [
        {"kind": "memory", "capacity": 2 * layout.bytes_per_chunk, "pin": "off"},
        {"kind": "disk", "path": str(tmp_path / "disk"), "capacity": "64MiB"},
        {"kind": "shared", "path": str(tmp_path / "shared"), "capacity": "64MiB"},
        {"kind": "s3", **s3_session.settings(), "capacity": 0}]}), layout)
    worker = ConnectorWorker(paged, layout, store, load_batch=4)
    try:
        priors = priors_reported(worker)
    finally:
        worker.close()
    # Each a chunk's round trip (over 4 reads at once) plus its bytes over the bandwidth:
    # local disk and loopback, well under a 64 KiB chunk's recompute (tens of ms).
    assert set(priors) == {"disk", "shared", "s3"}
    assert all(0 < seconds < 0.05 for seconds in priors.values()), priors


class _Link:
    """A store whose links measure as given, one measure after another (a slow measure
    injected: the machine busy while the engine starts)."""

    def __init__(self, *speeds: LinkSpeed) -> None:
        self._speeds = list(speeds)

    def measure_links(self) -> dict[str, LinkSpeed]:
        return {"disk": self._speeds.pop(0)}


def test_a_tiers_prior_is_the_best_of_its_last_measures(tmp_path: Path) -> None:
    """One measure taken while the machine is busy would cut the tier until the next one (a
    tier cut by its prior is not tried): the prior is the best of the last LINK_WINDOW."""
    paged = PagedKV(one_allocation_cpu_kv(blocks=CHUNKS * BLOCKS_PER_CHUNK), BS)
    layout = paged.layout(BS * BLOCKS_PER_CHUNK)
    store = open_store(StoreConfig.parse({"tiers": [
        {"kind": "memory", "capacity": 2 * layout.bytes_per_chunk, "pin": "off"}]}), layout)
    worker = ConnectorWorker(paged, layout, store, load_batch=4)
    slow, fast = LinkSpeed(0.5, 1e6), LinkSpeed(1e-4, 1e9)
    link = _Link(slow, fast, slow, slow, slow, slow)
    try:
        seen = []
        for _ in range(6):
            worker._measure_links(link, 4)
            seen.append(worker._priors_s["disk"])
    finally:
        worker.close()
    fast_s, slow_s = fast.read_s(layout.bytes_per_chunk, 4), slow.read_s(layout.bytes_per_chunk, 4)
    assert seen == pytest.approx([slow_s, fast_s, fast_s, fast_s, slow_s, slow_s])
    assert LINK_WINDOW == 3
