"""Fixtures shared by the core's tests; the helpers themselves live in tests/tierkit.py."""

from __future__ import annotations

import gc
import os
import re
import shutil
import subprocess
from collections.abc import Generator, Iterator
from pathlib import Path
from typing import Any

import pytest
import tierkit
from redis_server import REDIS_SERVER, SKIP_REASON, RedisClusterNodes, RedisServer
from s3_server import MOTO_SKIP, TEST_KEYS, MotoServer, S3Endpoint, moto_available, real_endpoint
from tierkit import tiny_layout

from kvtier.core.layout import KVLayout
from kvtier.testing.engines import own_rpc_folder

# Engines started by the tests (in-process LLM and servers) get the core binding they would
# have without a KV connector: vLLM's CPU backend otherwise reserves one more core for any
# connector, which on a 2-core machine slows every step several-fold (`kvtier serve` sets it too).
os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")
# vLLM compiles a few helpers with inductor even in an eager engine (prompt and sample
# logprobs' ranks, top-k/top-p, some custom ops): on a bare machine a helper's first use in a
# process compiled for 20-50 s of a test (a prompt-logprobs test: 2.8 s with the compile
# cache warm, 20.6 s cold alone, 53 s in CI's engine lane). kvtier never runs inside them:
# the tests' engines and servers run them as plain PyTorch. KVTIER_TEST_COMPILE=1 keeps them.
if os.environ.get("KVTIER_TEST_COMPILE") != "1":
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")


@pytest.fixture
def layout() -> KVLayout:
    """A 4 KiB-chunk layout (see tierkit.tiny_layout)."""
    return tiny_layout()


# -- KVTIER_TEST_STRICT=1 (scripts/test.sh, so CI): a test skipped for want of something on the
# machine (redis-server, prometheus, a tmpfs mount, mknod, a C compiler, root...) fails
# instead, with its reason: CI must run them all (scripts/setup.sh installs what they need).
# These skips stay skips: what CI legitimately lacks, or no environment skip at all.
STRICT = os.environ.get("KVTIER_TEST_STRICT") == "1"
OPTIONAL_SKIPS = re.compile("|".join([
    r"CUDA|GPU",  # tests/gpu: CI has no GPU
    r"KVTIER_TEST_S3|real bucket",  # the variants for (or not for) a real S3 endpoint
    r"bounds capacity by a periodic listing|is not InPlace",  # a tier the case is not for
]))


def optional_skip(path: str, reason: str) -> bool:
    """Whether a skip of the test (or module) at `path` for `reason` is allowed under
    KVTIER_TEST_STRICT."""
    if OPTIONAL_SKIPS.search(reason) or path.startswith("tests/gpu/"):
        return True
    # vLLM releases' sources (tests/vllm_api) are downloaded; KVTIER_OFFLINE=1 says they
    # cannot be, and those tests skip (they fail when a download fails without it).
    return path.startswith("tests/vllm_api/") and os.environ.get("KVTIER_OFFLINE") == "1"


def _strict(report: pytest.TestReport | pytest.CollectReport) -> None:
    """Turn an environment skip in `report` into a failure (KVTIER_TEST_STRICT=1)."""
    if not (STRICT and report.skipped) or hasattr(report, "wasxfail"):
        return
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    reason = reason.removeprefix("Skipped: ")
    if optional_skip(report.nodeid.replace(os.sep, "/"), reason):
        return
    report.outcome = "failed"
    report.longrepr = (f"KVTIER_TEST_STRICT=1: skipped for want of something on this machine, "
                       f"which CI must provide (scripts/setup.sh): {reason}")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]
                              ) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    _strict(report)
    return report


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector: pytest.Collector
                               ) -> Generator[None, pytest.CollectReport, pytest.CollectReport]:
    report = yield
    _strict(report)
    return report


NODE_TESTS = Path(__file__).parent / "node"


@pytest.hookimpl(tryfirst=True)  # before `-m` selects by the markers added here
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests parametrized with kind="redis" (the tier contract suite) need redis-server;
    tests/node's are marked `node`; modules with a slow test first."""
    for item in items:
        if NODE_TESTS in item.path.parents:
            item.add_marker(pytest.mark.node)
        callspec = getattr(item, "callspec", None)
        if callspec is not None and callspec.params.get("kind") == "redis":
            item.add_marker(pytest.mark.redis)
        if callspec is not None and callspec.params.get("kind") == "s3":
            item.add_marker(pytest.mark.s3)
    # Modules holding a slow test run first, each module's tests together and in their order:
    # scripts/test.sh hands the engine phase's modules to its two workers in this order, one
    # to whichever is free (--no-loadscope-reorder; xdist's own order, most tests first, left
    # the one-test server modules of 1-2 minutes last, the other worker idle meanwhile).
    slow_modules = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow_modules)


def pytest_collection_finish(session: pytest.Session) -> None:
    """The heap built by collecting the suite (~760,000 objects: vLLM, torch, every test
    module) frozen, as vLLM freezes its own once started (`freeze_gc_heap`): each full
    collection then scans what the tests made, not 0.4-0.6 s of it on 2 cores (one run of the
    timing lane had 24 such collections inside 9 of its 46 tests, at times inside a 0.1 s
    budget's window: test_slow_first_hits reran in 3 of 4 CI runs)."""
    gc.collect()
    gc.freeze()


def pytest_configure(config: pytest.Config) -> None:
    """vLLM's socket files in a folder of this run's, removed at its exit (`own_rpc_folder`):
    an engine process killed by a test leaves its files behind (thousands in /tmp after a day
    of runs); named before any engine starts, as vLLM's processes may cache it."""
    own_rpc_folder()


def pytest_unconfigure(config: pytest.Config) -> None:
    """The heap unfrozen for the interpreter's last collection (frozen objects outlive it:
    triton's bindings then print hundreds of "leaked" functions)."""
    gc.unfreeze()


@pytest.fixture(autouse=True)
def _frozen_heap_for_timing(request: pytest.FixtureRequest) -> None:
    """A test that asserts a wall-clock bound starts with the heap collected and frozen (an
    in-process engine's shutdown unfreezes it: `EngineCore.shutdown`); left frozen, the next
    one's collection scans only what this one left."""
    if request.node.get_closest_marker("timing") is not None:
        gc.collect()
        gc.freeze()


@pytest.fixture
def read_only_dir(tmp_path: Path) -> Iterator[Path]:
    """An existing directory, holding one file, that this process cannot write into: a
    read-only tmpfs when the tests run as root (root writes through any mode bits), a 0555
    directory otherwise."""
    directory = tmp_path / "ro"
    directory.mkdir()
    if os.getuid() != 0:
        (directory / "chunk").write_bytes(b"x")
        directory.chmod(0o555)
        yield directory
        directory.chmod(0o755)
        return
    mount = shutil.which("mount")
    if mount is None or subprocess.run([mount, "-t", "tmpfs", "-o", "size=1m", "tmpfs",
                                        str(directory)], check=False,
                                       capture_output=True).returncode:
        pytest.skip("running as root without the right to mount a read-only tmpfs")
    try:
        (directory / "chunk").write_bytes(b"x")
        subprocess.run([mount, "-o", "remount,ro", str(directory)], check=True)
        yield directory
    finally:
        subprocess.run(["umount", str(directory)], check=True)


@pytest.fixture(scope="session")
def redis_session(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """One redis-server for the whole session (tests share it through `redis_url`)."""
    if REDIS_SERVER is None:
        pytest.skip(SKIP_REASON)
    server = RedisServer(tmp_path_factory.mktemp("redis-session")).start()
    yield server
    server.stop()


@pytest.fixture
def redis_url(redis_session: RedisServer) -> Iterator[str]:
    """The URL of an empty redis-server on 127.0.0.1 (the session's, flushed)."""
    redis_session.client().flushall()
    yield redis_session.url


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A redis-server of this test's own (to kill, slow down or restart), killed after it."""
    if REDIS_SERVER is None:
        pytest.skip(SKIP_REASON)
    server = RedisServer(tmp_path / "redis").start()
    yield server
    server.stop()


@pytest.fixture
def redis_cluster(tmp_path: Path) -> Iterator[RedisClusterNodes]:
    """A 3-node Redis Cluster on 127.0.0.1, killed after the test."""
    if REDIS_SERVER is None:
        pytest.skip(SKIP_REASON)
    cluster = RedisClusterNodes(tmp_path / "cluster")
    try:
        yield cluster.start()
    finally:
        cluster.stop()


@pytest.fixture(autouse=True)
def _redis_for_kind_redis(request: pytest.FixtureRequest) -> Iterator[None]:
    """Give tierkit the server address when a test is parametrized with kind="redis"."""
    callspec = getattr(request.node, "callspec", None)
    if callspec is None or callspec.params.get("kind") != "redis":
        yield
        return
    tierkit.REDIS_URL = request.getfixturevalue("redis_url")
    yield
    tierkit.REDIS_URL = None


@pytest.fixture(scope="session")
def s3_session(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Endpoint]:
    """The S3 endpoint of the session: KVTIER_TEST_S3_* when set (tests/s3_server.py), else
    moto's server on 127.0.0.1 (an emulator) with test credentials in the environment."""
    real = real_endpoint()
    if real is not None:
        yield real
        return
    if not moto_available():
        pytest.skip(MOTO_SKIP)
    saved = {name: os.environ.get(name) for name in TEST_KEYS}
    os.environ.update(TEST_KEYS)
    server = MotoServer(tmp_path_factory.mktemp("moto-session")).start()
    try:
        yield server.endpoint()
    finally:
        server.stop()
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@pytest.fixture
def s3_server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[MotoServer]:
    """A moto server of this test's own (to kill or restart), killed after it; skipped when
    the tests run against a real endpoint (it cannot be broken on purpose)."""
    if real_endpoint() is not None:
        pytest.skip("a fault drill: needs the emulator, not KVTIER_TEST_S3_ENDPOINT")
    if not moto_available():
        pytest.skip(MOTO_SKIP)
    for name, value in TEST_KEYS.items():
        monkeypatch.setenv(name, value)
    server = MotoServer(tmp_path / "moto").start()
    yield server
    server.stop()


@pytest.fixture(autouse=True)
def _s3_for_kind_s3(request: pytest.FixtureRequest) -> Iterator[None]:
    """Give tierkit the endpoint when a test is parametrized with kind="s3"."""
    callspec = getattr(request.node, "callspec", None)
    if callspec is None or callspec.params.get("kind") != "s3":
        yield
        return
    tierkit.S3_ENDPOINT = request.getfixturevalue("s3_session")
    yield
    tierkit.S3_ENDPOINT = None


@pytest.fixture
def tight(redis_server: RedisServer) -> Iterator[Any]:
    """An admin client (redis.Redis) of a server that refuses writes when full (noeviction):
    the redis tier's orphan tests (tests/orphankit.py)."""
    client = redis_server.client()
    client.config_set("maxmemory-policy", "noeviction")
    yield client
    client.config_set("maxmemory", 0)


@pytest.fixture
def vault(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Kind "vault" registered (one registry line, as a new tier kind is added: tests/
    vaultkit.py), and a store config (StoreConfig) with a memory tier above a vault tier."""
    from kvtier.tiers.registry import TIER_CLASSES
    from kvtier.tiers.storeconfig import StoreConfig

    monkeypatch.setitem(TIER_CLASSES, "vault", "vaultkit:VaultTier")
    return StoreConfig.parse({"tiers": [{"kind": "memory", "capacity": "4MiB"},
                                        {"kind": "vault", "name": "far", "capacity": "8MiB"}]})


@pytest.fixture
def captured(capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture) -> Any:
    """What a run prints and logs, as one text (secretkit.Captured)."""
    from secretkit import Captured

    return Captured(capsys, caplog)


@pytest.fixture
def secured(tmp_path: Path) -> Iterator[Any]:
    """A redis-server that requires secretkit.SECRET, and a 0600 file holding it."""
    from secretkit import SECRET

    server = RedisServer(tmp_path / "redis", None, "--requirepass", SECRET).start()
    password_file = tmp_path / "redis-password"
    password_file.write_text(SECRET + "\n")
    password_file.chmod(0o600)
    yield server, password_file
    server.stop()
