"""The emulated network of `kvtier bench interference --tier redis`
(kvtier.testing.netem): a TCP proxy on 127.0.0.1 that delivers every byte intact and in
order, no earlier than its one-way delay, and no faster than its bandwidth cap, shared by the
connections through it.

Real sockets on 127.0.0.1; timings are asserted as lower bounds only (the machine is shared)."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator

import pytest
import redis

from kvtier.errors import ConfigError
from kvtier.testing.netem import Endpoint, delayed_proxy

MIB = 1024**2


@pytest.fixture
def echo_port() -> Iterator[int]:
    """An echo server on 127.0.0.1: each connection gets back what it sends, then EOF."""
    listener = socket.create_server(("127.0.0.1", 0))

    def echo(conn: socket.socket) -> None:
        with conn:
            while data := conn.recv(MIB):
                conn.sendall(data)

    def accept() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:  # the listener was closed: the test is over
                return
            threading.Thread(target=echo, args=(conn,), daemon=True).start()

    acceptor = threading.Thread(target=accept, daemon=True)
    acceptor.start()
    yield int(listener.getsockname()[1])
    listener.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept (close alone does not)
    listener.close()
    acceptor.join(5)


def _echo_through(proxy: Endpoint, payload: bytes) -> bytes:
    """Send `payload` through the proxy to the echo server (from a thread, so neither side's
    buffers fill up), read it all back, half-close, and check the proxy passes the EOF on."""
    with socket.create_connection((proxy.host, proxy.port)) as conn:
        sender = threading.Thread(target=conn.sendall, args=(payload,))
        sender.start()
        received = bytearray()
        while len(received) < len(payload):
            data = conn.recv(MIB)
            assert data, "the proxy closed the connection early"
            received += data
        sender.join()
        conn.shutdown(socket.SHUT_WR)
        assert conn.recv(1) == b""  # the echo server's EOF, relayed
    return bytes(received)


def test_8_mib_come_back_intact_and_in_order(echo_port: int) -> None:
    payload = os.urandom(8 * MIB)
    with delayed_proxy("127.0.0.1", echo_port, delay_ms=1.0, bandwidth_gbps=None) as proxy:
        assert _echo_through(proxy, payload) == payload
        assert _echo_through(proxy, b"second connection") == b"second connection"


def test_a_round_trip_pays_the_one_way_delay_twice(echo_port: int) -> None:
    with delayed_proxy("127.0.0.1", echo_port, delay_ms=20.0, bandwidth_gbps=None) as proxy, \
            socket.create_connection((proxy.host, proxy.port)) as conn:
        for _ in range(3):
            started = time.perf_counter()
            conn.sendall(b"x")
            assert conn.recv(1) == b"x"
            assert time.perf_counter() - started >= 0.040


@pytest.mark.redis
def test_a_redis_ping_through_the_proxy_pays_the_delay_both_ways(redis_url: str) -> None:
    port = int(redis_url.rsplit(":", 1)[1].split("/")[0])
    with delayed_proxy("127.0.0.1", port, delay_ms=20.0, bandwidth_gbps=1.0) as proxy:
        client = redis.Redis(host=proxy.host, port=proxy.port)
        client.set("netem", b"v" * MIB)
        started = time.perf_counter()
        assert client.get("netem") == b"v" * MIB
        assert time.perf_counter() - started >= 0.040 + MIB * 8 / 1e9
        client.close()


def test_the_cap_bounds_the_rate(echo_port: int) -> None:
    payload = os.urandom(MIB)
    with delayed_proxy("127.0.0.1", echo_port, delay_ms=0.0, bandwidth_gbps=0.1) as proxy:
        started = time.perf_counter()
        assert _echo_through(proxy, payload) == payload
        assert time.perf_counter() - started >= MIB * 8 / 0.1e9  # 84 ms


@pytest.mark.timing
def test_the_link_changes_while_the_proxy_runs(echo_port: int) -> None:
    payload = os.urandom(MIB)
    with delayed_proxy("127.0.0.1", echo_port, delay_ms=0.0, bandwidth_gbps=None) as proxy:
        started = time.perf_counter()
        assert _echo_through(proxy, payload) == payload
        fast_s = time.perf_counter() - started
        proxy.set_link(0.0, 0.1)  # the link degrades: 84 ms for the MiB
        slow_s = _echo_time_once(proxy, payload, lambda s: s >= MIB * 8 / 0.1e9)
        assert slow_s >= MIB * 8 / 0.1e9 > fast_s
        proxy.set_link(0.0, None)  # and recovers
        _echo_time_once(proxy, payload, lambda s: s < MIB * 8 / 0.1e9)


def _echo_time_once(proxy: Endpoint, payload: bytes, holds: Callable[[float], bool],
                    timeout_s: float = 10.0) -> float:
    """The time of an echo through the proxy once `holds` it (the proxy's child applies a
    new link when it reads it): echoes until then, failing at `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        started = time.perf_counter()
        assert _echo_through(proxy, payload) == payload
        echo_s = time.perf_counter() - started
        if holds(echo_s):
            return echo_s
        assert time.monotonic() < deadline, f"the link never changed (last echo {echo_s:.3f} s)"
        with pytest.raises(ConfigError):
            proxy.set_link(-1.0, None)


def test_connections_share_the_cap(echo_port: int) -> None:
    # Two connections moving 1 MiB each at once: 2 MiB through one 0.1 Gbit/s link.
    payloads = [os.urandom(MIB), os.urandom(MIB)]
    with delayed_proxy("127.0.0.1", echo_port, delay_ms=0.0, bandwidth_gbps=0.1) as proxy:
        results: list[bytes] = []
        threads = [threading.Thread(target=lambda p=p: results.append(_echo_through(proxy, p)))
                   for p in payloads]
        started = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert time.perf_counter() - started >= 2 * MIB * 8 / 0.1e9  # 168 ms
    assert sorted(results) == sorted(payloads)


def test_a_refused_target_closes_the_client_connection() -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    with delayed_proxy("127.0.0.1", port, delay_ms=0.0, bandwidth_gbps=None) as proxy, \
            socket.create_connection((proxy.host, proxy.port)) as conn:
        conn.settimeout(10)
        assert conn.recv(1) == b""


def test_the_proxy_stops_on_exit_and_cuts_what_is_open(echo_port: int) -> None:
    with delayed_proxy("127.0.0.1", echo_port, delay_ms=0.0, bandwidth_gbps=None) as proxy:
        conn = socket.create_connection((proxy.host, proxy.port))
        conn.settimeout(10)
        conn.sendall(b"x")
        assert conn.recv(1) == b"x"
    with conn, contextlib.suppress(ConnectionResetError):
        assert conn.recv(1) == b""
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection((proxy.host, proxy.port), timeout=10)


@pytest.mark.parametrize(("port", "delay_ms", "gbps", "field"), [
    (0, 1.0, 1.0, "target_port"), (70000, 1.0, 1.0, "target_port"),
    (6379, -1.0, 1.0, "delay_ms"), (6379, float("nan"), 1.0, "delay_ms"),
    (6379, 1.0, 0.0, "bandwidth_gbps"), (6379, 1.0, -5.0, "bandwidth_gbps"),
    (6379, 1.0, float("inf"), "bandwidth_gbps")])
def test_bad_arguments_name_the_field(port: int, delay_ms: float, gbps: float,
                                      field: str) -> None:
    with pytest.raises(ConfigError) as caught, delayed_proxy("127.0.0.1", port, delay_ms, gbps):
        pass
    assert caught.value.field == field
