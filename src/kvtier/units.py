"""Human-readable sizes: "8GiB", "512 MiB", "1.5GB", "4096" (bytes)."""

from __future__ import annotations

import math
import re

from kvtier.errors import ConfigError

# The largest size accepted: the largest file offset / allocation a 64-bit OS can address.
# A bigger number is a typo: a ConfigError, not the OverflowError of `int(float("1" * 400))`.
MAX_SIZE_BYTES = 2**63 - 1

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2,
    "g": 1000**3, "gb": 1000**3, "t": 1000**4, "tb": 1000**4,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(value: str | int | float, field: str = "size") -> int:
    """Return a size in bytes from an int or a string such as "8GiB" or "1.5 GB".

    Raises:
        ConfigError: naming `field` when the value is negative, not a size, larger than
            MAX_SIZE_BYTES, or has an unknown unit.
    """
    if isinstance(value, bool):
        raise ConfigError(field, value, "a size in bytes or a string such as '8GiB'")
    if isinstance(value, (int, float)):
        # inf (YAML ".inf") and NaN: a ConfigError, not OverflowError/ValueError from int().
        if value != value or value in (float("inf"), float("-inf")):
            raise ConfigError(field, value, "a finite size in bytes or a string such as '8GiB'")
        if value < 0:
            raise ConfigError(field, value, "a size must not be negative")
        return _bounded(int(value), field, value)
    if str(value).lstrip().startswith("-"):  # "-5GiB" is negative, not "not a size"
        raise ConfigError(field, value, "a size must not be negative (e.g. '5GiB')")
    match = _SIZE.match(str(value))
    unit = match.group(2).lower() if match else None
    if not match or unit not in _UNITS:
        raise ConfigError(
            field, value, "a size such as 4096, '512MiB', '8GiB' or '1.5GB' (units: B, KB, "
            "MB, GB, TB, KiB, MiB, GiB, TiB)"
        )
    number = float(match.group(1)) * _UNITS[unit]
    if not math.isfinite(number):
        raise ConfigError(field, _short(value), f"a size of at most {MAX_SIZE_BYTES} bytes")
    return _bounded(int(number), field, value)


def _bounded(size: int, field: str, value: object) -> int:
    if size > MAX_SIZE_BYTES:
        raise ConfigError(field, _short(value), f"a size of at most {MAX_SIZE_BYTES} bytes")
    return size


def _short(value: object) -> object:
    """The value for an error message; a 300-digit string is cut to a readable length."""
    text = str(value)
    return value if len(text) <= 40 else text[:20] + "..." + text[-8:]


def format_size(size_bytes: float) -> str:
    """Return `size_bytes` in binary units, e.g. 1536 -> '1.5 KiB'."""
    value = float(size_bytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")
