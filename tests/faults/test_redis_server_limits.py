"""A redis-server whose own limits cut the redis tier's values, against real redis-server
processes on 127.0.0.1: `proto-max-bulk-len` below `part_bytes` (the server closes the
connection on a put of a larger part), or a hard `client-output-buffer-limit` for normal
clients below a chunk's read (the server closes it on each read).

Found in an operator drill: each such put or read failed as a broken connection, so the tier
marked the server down, logged "unavailable (ConnectionError: ... Broken pipe)", came back on
the next probe and went down again at the next large value: a tier flapping with a message
that pointed at the network. Now the tier reads both limits as its store warms it up and
warns, naming the setting to change. (A server that refuses CONFIG is not checked.)
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from orphankit import redis_config
from redis_server import RedisServer
from tierkit import tiny_layout

from kvtier.tiers import build_tier

pytestmark = pytest.mark.redis
LAYOUT = tiny_layout(tokens_per_chunk=16384)  # 4 MiB chunks
PART_BYTES = 2 * 1024 * 1024


@pytest.mark.parametrize(("args", "named"), [
    ((), None),
    (("--proto-max-bulk-len", "1mb"), "proto-max-bulk-len"),
    (("--client-output-buffer-limit", "normal 1mb 512kb 60"), "client-output-buffer-limit"),
])
def test_server_limits_that_cut_the_tiers_values_are_a_warning_at_start(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, args: tuple[str, ...],
        named: str | None) -> None:
    server = RedisServer(tmp_path / "redis", None, *args).start()
    try:
        tier = build_tier(redis_config(server.url, part_bytes=PART_BYTES), LAYOUT)
        with caplog.at_level(logging.WARNING, logger="kvtier.tiers.redis.tier"):
            tier.warm(1)  # what the store does as it opens
        warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        if named is None:
            assert warnings == []
        else:
            assert len(warnings) == 1 and named in warnings[0], warnings
        tier.close()
    finally:
        server.stop()
