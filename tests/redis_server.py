"""Real redis-server processes for tests: one server, or a 3-node Redis Cluster, on 127.0.0.1
on free ports, with their files in a temp dir and persistence off. Always killed by the
fixtures that start them (tests/conftest.py). (Not named conftest.py: imported by name.)

Primitives: `REDIS_SERVER`, `RedisServer`, `TlsRedisServer`, `RedisClusterNodes`, `free_port`.
"""

from __future__ import annotations

import shutil
import socket
import ssl
import subprocess
import time
from pathlib import Path

import redis

from kvtier.testing import ports

REDIS_SERVER = shutil.which("redis-server")
REDIS_CLI = shutil.which("redis-cli")
SKIP_REASON = "redis-server is not installed (scripts/setup.sh installs it with apt)"
START_TIMEOUT_S = 10.0
CLUSTER_BUS_OFFSET = 10_000  # a Cluster node also listens at its port + 10000


def free_port(cluster_bus: bool = False) -> int:
    """A free port on 127.0.0.1 (kvtier.testing.ports); with `cluster_bus`, one whose +10000
    (the Cluster bus port) is free too."""
    return ports.free_port(also=(CLUSTER_BUS_OFFSET,) if cluster_bus else ())


class RedisServer:
    """One redis-server on 127.0.0.1:`port`; `stop` kills it, `start` brings it back on the
    same port (empty: persistence is off)."""

    def __init__(self, directory: Path, port: int | None = None, *args: str) -> None:
        self.directory = directory
        self.port = port or free_port()
        self.args = args
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> RedisServer:
        assert REDIS_SERVER, SKIP_REASON
        self.directory.mkdir(parents=True, exist_ok=True)
        # The child keeps its own copy of the log's descriptor; ours closes once it started.
        with open(self.directory / f"redis-{self.port}.log", "ab") as log:
            self.proc = subprocess.Popen(
                [REDIS_SERVER, "--bind", "127.0.0.1", *self._listen_args(), "--save", "",
                 "--appendonly", "no", "--dir", str(self.directory), "--enable-debug-command",
                 "local", *self.args],
                stdout=log, stderr=subprocess.STDOUT)
        try:
            self._wait_ready()
        except BaseException:
            # A fixture whose set-up raises is not torn down: the server would outlive the run.
            self.stop()
            raise
        return self

    def _listen_args(self) -> list[str]:
        return ["--port", str(self.port)]

    def _ping(self) -> bytes:
        """The server's reply to PING; raises OSError while it is not listening."""
        with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
            s.sendall(b"PING\r\n")
            return s.recv(64)

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited: see {self.directory}")
            try:
                if self._ping().startswith((b"+PONG", b"-NOAUTH")):
                    return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"redis-server on port {self.port} did not start")
            time.sleep(0.02)

    def stop(self) -> None:
        """SIGKILL, as a crash would: no shutdown work, sockets reset."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.proc = None

    def client(self, **kwargs: object) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, **{"socket_timeout": 5, **kwargs})


class TlsRedisServer(RedisServer):
    """One redis-server speaking only TLS on 127.0.0.1:`port` (no plain port), with the given
    certificate, key and CA (PEM files); clients need no certificate of their own."""

    def __init__(self, directory: Path, cert: Path, key: Path, ca: Path) -> None:
        super().__init__(directory, None, "--tls-cert-file", str(cert), "--tls-key-file",
                         str(key), "--tls-ca-cert-file", str(ca), "--tls-auth-clients", "no")
        self.ca = ca
        self.url = f"rediss://127.0.0.1:{self.port}/0"

    def _listen_args(self) -> list[str]:
        return ["--port", "0", "--tls-port", str(self.port)]

    def _ping(self) -> bytes:
        context = ssl.create_default_context(cafile=str(self.ca))
        with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as raw, \
                context.wrap_socket(raw, server_hostname="127.0.0.1") as s:
            s.sendall(b"PING\r\n")
            return s.recv(64)

    def log_text(self) -> str:
        return (self.directory / f"redis-{self.port}.log").read_text(errors="replace")


class RedisClusterNodes:
    """Three redis-server nodes joined into a Redis Cluster (no replicas), each allowed to
    serve its slots while another is down (`cluster-require-full-coverage no`)."""

    def __init__(self, directory: Path, count: int = 3) -> None:
        self.nodes = [RedisServer(directory / f"node{i}", free_port(True),
                                  "--cluster-enabled", "yes",
                                  "--cluster-config-file", "nodes.conf",
                                  "--cluster-require-full-coverage", "no",
                                  "--cluster-node-timeout", "1000")
                      for i in range(count)]
        self.addresses = [f"127.0.0.1:{node.port}" for node in self.nodes]

    def start(self) -> RedisClusterNodes:
        for node in self.nodes:
            node.start()
        assert REDIS_CLI
        subprocess.run([REDIS_CLI, "--cluster", "create", *self.addresses,
                        "--cluster-replicas", "0", "--cluster-yes"],
                       check=True, capture_output=True, timeout=30)
        deadline = time.monotonic() + START_TIMEOUT_S
        while not all(b"cluster_state:ok" in n.client().execute_command("CLUSTER", "INFO")
                      for n in self.nodes):
            if time.monotonic() > deadline:
                raise RuntimeError("the cluster did not reach cluster_state:ok")
            time.sleep(0.05)
        return self

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()
