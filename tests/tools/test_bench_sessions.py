"""The benchmarks' stand-ins for other services each run in a session of their own: the node
(`BenchNode`, as a node's own service would), the private redis-server and moto server
(`local_redis`, `local_s3`: another machine's) and the emulated network (`delayed_proxy`).
With Linux's autogroup a session is a CPU scheduling group: sharing the bench's, they were
starved by the vLLM server's group for up to 1.75 s (docs/performance.md, "The machine's
stalls, explained"). Real processes; their session read from /proc.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvtier.testing.netem import delayed_proxy
from kvtier.tools.bench.node import restartable_node
from kvtier.tools.bench.redis_baseline import local_redis
from kvtier.tools.bench.s3_baseline import local_s3

pytestmark = [pytest.mark.timeout(120), pytest.mark.redis, pytest.mark.s3]


def _children_running(module: str) -> set[int]:
    """Pids of this process's children whose command line names `module` (the session's
    fixtures may have their own: a test compares them before and after)."""
    pids = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()
            cmdline = (stat.parent / "cmdline").read_bytes()
        except OSError:  # exited meanwhile
            continue
        if int(fields[1]) == os.getpid() and module.encode() in cmdline:
            pids.add(int(stat.parent.name))
    return pids


def _started(module: str, before: set[int]) -> int:
    (pid,) = _children_running(module) - before
    return pid


def _leads_its_own_session(pid: int) -> bool:
    return os.getsid(pid) == pid != os.getsid(0)


def test_the_bench_node_runs_in_a_session_of_its_own(tmp_path: Path) -> None:
    before = _children_running("kvtier.node")
    with restartable_node(tmp_path / "node", "1MiB"):
        assert _leads_its_own_session(_started("kvtier.node", before))


def test_the_private_redis_and_the_emulated_network_run_in_sessions_of_their_own(
        tmp_path: Path) -> None:
    servers, proxies = _children_running("redis-server"), _children_running("kvtier.testing.netem")
    with local_redis(tmp_path) as url:
        port = int(url.rsplit(":", 1)[1].split("/")[0])
        assert _leads_its_own_session(_started("redis-server", servers))
        with delayed_proxy("127.0.0.1", port, 0.0, None):
            assert _leads_its_own_session(_started("kvtier.testing.netem", proxies))


def test_the_private_moto_server_runs_in_a_session_of_its_own(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVTIER_BENCH_S3_ENDPOINT", raising=False)  # the private one
    before = _children_running("moto.server")
    with local_s3():
        assert _leads_its_own_session(_started("moto.server", before))
