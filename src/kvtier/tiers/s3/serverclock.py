"""The S3 server's clock, as this host can know it: the `Date` header of the server's last
answer, plus the time passed since by this host's monotonic clock.

An object's LastModified is stamped by the server's clock. `kvtier gc --max-age` measured an
object's age against the clock of the host it ran on: from a host minutes ahead it deleted
objects younger than the age given, from one behind it kept older ones
(tests/tools/test_gc_s3_clock_skew.py). Every answer an S3 server sends carries its clock in
`Date` (HTTP/1.1 asks it of every server with a clock; S3 signs requests against it), so the
requests gc makes anyway (its listing) tell it, at no cost. To the second: `Date` has no
finer unit, nor has LastModified on S3.

Primitives: `ServerClock`.
"""

from __future__ import annotations

import email.utils
import threading
import time
from typing import Any


class ServerClock:
    """Records the `Date` of every answer a botocore S3 client gets (an `after-call` event
    handler of that client: answers with an error status too). Thread-safe."""

    def __init__(self, client: Any) -> None:
        self._lock = threading.Lock()
        self._seen: tuple[float, float] | None = None  # (server's Date, monotonic then)
        client.meta.events.register("after-call.s3", self._record)

    def _record(self, http_response: Any = None, **_kwargs: Any) -> None:
        """botocore's after-call handler: keep the answer's Date (an answer without one, or
        with one that does not parse, is skipped)."""
        headers = getattr(http_response, "headers", None) or {}
        text = headers.get("Date") or headers.get("date")
        if not text:
            return
        try:
            server_s = email.utils.parsedate_to_datetime(str(text)).timestamp()
        except (TypeError, ValueError, IndexError):
            return
        with self._lock:
            self._seen = (server_s, time.monotonic())

    def now_s(self) -> float | None:
        """Unix time now by the server's clock, or None when no answer carried a Date yet."""
        with self._lock:
            seen = self._seen
        if seen is None:
            return None
        server_s, at = seen
        return server_s + (time.monotonic() - at)
