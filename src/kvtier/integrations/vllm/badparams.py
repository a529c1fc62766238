"""What a bad `kv_transfer_params` value leaves in the engine's log.

The values come from API users (an OpenAI request's extra body, passed on by vLLM), so the
log must not be theirs to fill: each was logged in full, at warning, on every request, and a
client could flood the engine's log with any text it liked, megabytes a request. A value is
shown as a bounded `repr` (its control characters and newlines escaped, at most
`SHOWN_CHARS`), and each field's problem is logged at warning once per scheduler, then at
debug: an operator learns that some client sends it, without one line per request.

Primitives: `IgnoredParams`, `shown`, `SHOWN_CHARS`.
"""

from __future__ import annotations

import logging
import reprlib
import threading

SHOWN_CHARS = 120  # the most of a value's repr a log line shows

_REPR = reprlib.Repr()
_REPR.maxstring = 60
_REPR.maxother = 60
_REPR.maxlevel = 3


def shown(value: object) -> str:
    """`value`'s repr, bounded: long strings, lists, dicts and deep nesting elided, and the
    whole cut at SHOWN_CHARS."""
    try:
        text = _REPR.repr(value)
    except Exception:  # an int past Python's digit limit, an object whose repr fails
        text = f"<a {type(value).__name__}>"
    return text if len(text) <= SHOWN_CHARS else text[:SHOWN_CHARS - 3] + "..."


class IgnoredParams:
    """The bad per-request switches of one scheduler: each field's first at warning, the
    rest at debug. Thread-safe."""

    def __init__(self, logger: logging.Logger) -> None:
        self._logger = logger
        self._lock = threading.Lock()
        self._warned: set[str] = set()
        self.count = 0  # bad values ignored, all fields

    def ignore(self, field: str, value: object, allowed: str) -> None:
        """Log that `kv_transfer_params.<field>` (`field` "": the whole of it) had `value`,
        ignored, where `allowed` says what it may be."""
        with self._lock:
            first = field not in self._warned
            self._warned.add(field)
            self.count += 1
        name = f"kv_transfer_params.{field}" if field else "kv_transfer_params"
        self._logger.log(logging.WARNING if first else logging.DEBUG,
                         "kvtier: ignoring %s=%s (%s)%s", name, shown(value), allowed,
                         "; more like it are logged at debug" if first else "")
