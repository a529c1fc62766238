"""Why the node refused an engine, in the node's log: once per model and reason.

A refused engine misses, and asks again every 2 s (its back-off), so its refusal is counted
each time (`refused`) but logged once while the reason stays the same: before, only a layout
whose tiers could not open (/dev/shm full) was logged at all, and an operator who saw
`refused` grow had to find the engine's log to learn that the node held `max_layouts`
layouts, or that the engine's chunk had no slot in its RAM.

Primitives: `Refusals`.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict

from kvtier.node.protocol import Hello, Refused

log = logging.getLogger(__name__)

# Distinct (model, reason) pairs remembered as logged: any user of the node's group may send
# Hellos of ever new models, and the memory of what was logged must not grow with them.
MAX_REMEMBERED = 256


class Refusals:
    """The refusals the node logged (its `ServedLayouts`'; thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._logged: OrderedDict[tuple[str, str], None] = OrderedDict()

    def refuse(self, hello: Hello, reason: str, hint: str = "") -> Refused:
        """The Refused answer to `hello`, for `reason`; logged (a warning naming the engine,
        its model, the reason and `hint`: what the operator may do) unless the same model was
        refused for the same reason lately. Any thread."""
        model = str(hello.model)[:200]  # an engine's own words: bounded in the log
        with self._lock:
            seen = (model, reason) in self._logged
            self._logged[(model, reason)] = None
            self._logged.move_to_end((model, reason))
            while len(self._logged) > MAX_REMEMBERED:
                self._logged.popitem(last=False)
        if not seen:
            log.warning("kvtier node: engine %s (model %s) refused: %s%s; it misses and "
                        "asks again (counted: refused; logged once a reason)",
                        str(hello.engine)[:200], model, reason, f"; {hint}" if hint else "")
        return Refused(reason)
