"""The small error vocabulary of kvtier.

Every public function says which of these it raises. Failures of I/O on a cache tier are
normally returned as data (a miss, a dropped write) and counted; these exceptions are for
the caller's mistakes (ConfigError) and for tier internals that the store turns into misses.
"""

from kvtier.redaction import redact_text, redact_value


class KVTierError(Exception):
    """Base class of all kvtier errors."""


class ConfigError(KVTierError, ValueError):
    """A configuration value is invalid.

    The message names the field, the value given and what is allowed. Credentials in the
    value or the explanation (a URL's password, `?password=`) are masked (kvtier.redaction):
    these messages are printed and logged.
    """

    def __init__(self, field: str, value: object, allowed: str) -> None:
        self.field = field
        self.value = redact_value(value)
        self.allowed = redact_text(allowed)
        super().__init__(f"invalid config {field}={self.value!r}: {self.allowed}")


class TierUnavailable(KVTierError):
    """A tier cannot serve right now (directory unwritable, server down, ...)."""


class CorruptBlock(KVTierError):
    """Stored chunk data failed verification (magic, version, layout, key, size or checksum)."""
