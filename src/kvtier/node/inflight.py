"""An engine's copies in flight into slots its connections reserved, and the connections kept
open for them. The node frees a connection's reserved slots when the connection ends; a copy
still running into one then (a device's DMA queued on a stream, a gather on another thread)
would land in a slot the node has given to another engine's chunk: a mix of two chunks,
served as KV. So a connection with a copy in flight is never closed: one ended meanwhile (a
call on it timed out, or the client closed) is parked, open and unused, until its last copy
is done, and closed then (tests/node/test_node_store_connection_end.py).

Not thread-safe: `NodeClient` holds its lock around each call.

Primitives: `WritesInFlight`.
"""

from __future__ import annotations

from collections.abc import Hashable


class WritesInFlight:
    """Copies in flight by connection, and the connections parked until theirs are done."""

    def __init__(self) -> None:
        self._copies: dict[Hashable, int] = {}
        self._parked: set[Hashable] = set()

    def start(self, connection: Hashable) -> None:
        """A copy into a slot `connection` reserved begins."""
        self._copies[connection] = self._copies.get(connection, 0) + 1

    def end(self, connection: Hashable) -> bool:
        """A copy `start`ed on `connection` is done (or will never run); True: it was the
        last of a parked connection, which the caller closes now."""
        left = self._copies.get(connection, 0) - 1
        if left > 0:
            self._copies[connection] = left
            return False
        self._copies.pop(connection, None)
        if connection in self._parked:
            self._parked.discard(connection)
            return True
        return False

    def park(self, connection: Hashable) -> bool:
        """`connection` ends: True if a copy into its slots is still in flight (the caller
        leaves it open; `end` says when to close it), False if it may be closed now."""
        if connection in self._copies:
            self._parked.add(connection)
            return True
        return False
