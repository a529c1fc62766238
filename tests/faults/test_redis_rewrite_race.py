"""A chunk read while other engines delete and write it again with other bytes, each engine
in a process of its own with another `part_bytes` (a rolling change of the setting), against
a real redis-server on 127.0.0.1.

What must hold: every hit is all of one write (never parts of two joined), anything else is a
miss, and no miss is called corrupt. A chunk one engine cut finer than the reader's fields
is read in two round trips (its parts past the reader's fields in the second); one written
again between the two was judged corrupt (its parts of the first write beside those of the
second failed the size checks): a warning each, and the reader deleted the new chunk. Now
the second round trip asks for the header again, and a header that changed is a plain miss.
(A chunk written again with the same bytes and another cut between the two round trips is
still judged corrupt: its header does not say how it was cut.)
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from orphankit import LAYOUT, payload, redis_tier
from tierkit import key

pytestmark = pytest.mark.redis
WRITES = 400  # per writer
TESTS = Path(__file__).resolve().parents[1]
# One engine: delete the chunk, store it with its own bytes (payload(`mark`)), again and again.
WRITER = """
import sys
sys.path.insert(0, sys.argv[1])
from orphankit import payload, redis_tier
from tierkit import key
tier = redis_tier(sys.argv[2], part_bytes=int(sys.argv[3]))
data = payload(int(sys.argv[4]))
print("ready", flush=True)
for _ in range(int(sys.argv[5])):
    tier.delete(key(1))
    assert tier.put(key(1), data).ok
"""


def test_a_chunk_written_again_while_read_is_all_of_one_write_or_a_plain_miss(
        redis_url: str) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    writers = [subprocess.Popen([sys.executable, "-c", WRITER, str(TESTS), redis_url,
                                 str(part_bytes), str(mark), str(WRITES)],
                                stdout=subprocess.PIPE, text=True, env=env)
               for part_bytes, mark in ((8 * 1024, 1), (16 * 1024, 2))]
    tier = redis_tier(redis_url)  # 16 KiB fields: the first writer's chunks take two reads
    out = memoryview(bytearray(LAYOUT.bytes_per_chunk))
    written = {bytes(payload(1)), bytes(payload(2))}
    hits = mixed = 0
    try:
        for writer in writers:
            assert writer.stdout is not None and writer.stdout.readline() == "ready\n"
        while any(writer.poll() is None for writer in writers):
            if tier.get_into(key(1), out).ok:
                hits += 1
                mixed += bytes(out) not in written
    finally:
        for writer in writers:
            writer.kill()
            writer.wait()
        tier.close()
    assert [writer.returncode for writer in writers] == [0, 0]
    assert hits > 0, "no read found the chunk: the race proved nothing"
    assert mixed == 0, f"{mixed} of {hits} hits joined two writes"
    assert tier.stats().corrupt_reads == 0
