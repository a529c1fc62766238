"""argparse `type=` functions for numbers that must be finite and in range.

Primitives: `finite_float`, `positive_float`, `fraction`, `positive_int`,
`non_negative_int`, `int_in(low, high)`, `size_gb`, `tier_size`, `tier_size_or_zero`,
`path_and_tier_size`, `port_number`, `listen_host`, `path_text`,
`output_file`, `plot_file` (an output file whose suffix names an image format), `output_dir`
(their parent must exist), `work_dir` (a writable directory),
`any_path`, `url_of(*schemes)` (`http_url`, `redis_url`); and one `action=`: `AppendOnce`
(a repeatable option whose values are kept once each).

argparse turns their `ArgumentTypeError` into "kvtier CMD: error: argument --x: ..." and
exit status 2, before a command runs; `float("inf")`, `float("nan")` and "1e400" are refused
here instead of escaping later as OverflowError from int() (issue 14).
"""

from __future__ import annotations

import argparse
import math
import os
import tempfile
import urllib.parse
from collections.abc import Callable
from pathlib import Path

from kvtier.errors import ConfigError
from kvtier.redaction import redact_text
from kvtier.units import parse_size

# A billion GB (an exabyte): larger sizes are typos.
MAX_GB = 1e9
# The longest file-name component Linux file systems take (NAME_MAX).
NAME_MAX_BYTES = 255
# A tier or KV cache a command line sizes below this is a unit left out: `--memory 64` was a
# memory tier of 64 bytes, which holds no chunk ("8GiB" was meant). Config files may hold
# smaller sizes (tests' tiers of a few chunks of a tiny model); a flag sizes a real machine's.
MIN_TIER_BYTES = 1024**2
# Larger counts (sessions, tokens, engines) are typos; they would make the tools allocate
# or loop for hours.
MAX_COUNT = 10**9


def finite_float(text: str) -> float:
    """A finite number (not nan, inf or an overflowing literal such as 1e400)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return value


def positive_float(text: str) -> float:
    """A finite number > 0."""
    value = finite_float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: must be greater than 0")
    return value


def size_gb(text: str) -> float:
    """A size in GB/GiB, > 0 and at most MAX_GB (1e300 overflowed when turned into bytes)."""
    value = positive_float(text)
    if value > MAX_GB:
        raise argparse.ArgumentTypeError(f"{text!r}: must be at most {MAX_GB:g}")
    return value


def fraction(text: str) -> float:
    """A number in (0, 1]."""
    value = finite_float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"{text!r}: must be in (0, 1]")
    return value


def _integer(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if abs(value) > MAX_COUNT:
        raise argparse.ArgumentTypeError(f"{text!r}: must be at most {MAX_COUNT}")
    return value


def positive_int(text: str) -> int:
    """A whole number in 1..MAX_COUNT."""
    value = _integer(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: must be at least 1")
    return value


def non_negative_int(text: str) -> int:
    """A whole number in 0..MAX_COUNT."""
    value = _integer(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: must be 0 or more")
    return value


def int_in(low: int, high: int) -> Callable[[str], int]:
    """A type function for a whole number in low..high."""

    def whole_number(text: str) -> int:
        value = _integer(text)
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{text!r}: must be in {low}..{high}")
        return value

    return whole_number


def _check_tier_size(text: str, zero_ok: bool) -> None:
    try:
        size = parse_size(text, "size")
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(f"{text!r}: {exc.allowed}") from None
    if size < MIN_TIER_BYTES and not (zero_ok and size == 0):
        raise argparse.ArgumentTypeError(
            f"{text!r}: a size such as 8GiB, at least 1MiB (a bare number is bytes)"
            + (", or 0 for none" if zero_ok else ""))


def tier_size(text: str) -> str:
    """A tier's (or a KV cache's) size, at least MIN_TIER_BYTES; returned as given."""
    _check_tier_size(text, zero_ok=False)
    return text


def tier_size_or_zero(text: str) -> str:
    """`tier_size`, or 0 (none); returned as given."""
    _check_tier_size(text, zero_ok=True)
    return text


def path_and_tier_size(text: str) -> str:
    """PATH:SIZE with a `tier_size`; returned as given (text without a ':' too: the command
    names what is missing)."""
    _, sep, size = text.rpartition(":")
    if sep and size:
        _check_tier_size(size, zero_ok=False)
    return text


def listen_host(text: str) -> str:
    """An address to listen on, not blank: a socket bound to "" listens on every interface
    (vLLM's server binds `args.host or ""`), so `--host "$HOST"` with the variable unset
    exposed a server meant for 127.0.0.1 (kvtier.node.cli refuses it the same way)."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"{text!r}: an address such as 127.0.0.1 (this "
                                         "machine only) or 0.0.0.0 (every interface), not "
                                         "empty: empty listens on every interface")
    return text


def port_number(text: str) -> int:
    """A TCP port, 1-65535 (issue 14: -1 and 99999 are refused)."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is outside 1-65535")
    return port


def path_text(text: str) -> str:
    """A path that can name a file: not empty, no NUL byte, no component longer than
    NAME_MAX_BYTES (the OS refuses those with ENAMETOOLONG, which escaped as OSError)."""
    if not text.strip() or "\0" in text:
        raise argparse.ArgumentTypeError(f"{text!r} is not a path")
    longest = max(len(part.encode("utf-8", "surrogateescape")) for part in text.split("/"))
    if longest > NAME_MAX_BYTES:
        raise argparse.ArgumentTypeError(
            f"{text[:40]!r}...: a path component is {longest} bytes, over {NAME_MAX_BYTES}")
    return text


def _parent_exists(text: str) -> Path:
    path = Path(path_text(text))
    parent = path.parent
    if not parent.is_dir():
        what = "is not a directory" if parent.exists() else "does not exist"
        raise argparse.ArgumentTypeError(
            f"directory {str(parent)!r} {what} (kvtier creates no parent directories)")
    return path


def output_file(text: str) -> Path:
    """A file to write: its parent directory must exist already, since kvtier creates no
    parent directories (issue 14: `--plot a/b/c.png` must not make a/b); not a directory;
    and one that can be written, probed now: a benchmark writes its JSON after minutes of
    work, and `--json /sys/x.json` (or a read-only mount, or a directory the user may not
    write) failed only then, as a traceback."""
    path = _parent_exists(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a directory, not a file")
    try:
        if path.is_file():  # opened to append: nothing written, nothing truncated
            path.open("ab").close()
        elif not path.exists():  # a fifo or a device (/dev/stdout) is left alone
            fd, probe = tempfile.mkstemp(prefix=".kvtier-probe-", dir=path.parent)
            os.close(fd)
            os.unlink(probe)
    except OSError as exc:
        raise argparse.ArgumentTypeError(
            f"{text!r}: cannot be written ({exc.strerror or exc})") from None
    return path


def plot_file(text: str) -> Path:
    """An image to write (`--plot`, `--png`): an `output_file` whose suffix is a format
    matplotlib writes. matplotlib reads the format from the suffix: `--plot hit` wrote
    hit.png, not the file asked for, and `--plot hit.txt` failed only after the work."""
    path = output_file(text)
    from matplotlib.backend_bases import FigureCanvasBase

    formats = sorted(FigureCanvasBase.get_supported_filetypes())
    if path.suffix[1:].lower() not in formats:
        raise argparse.ArgumentTypeError(
            f"{text!r}: a file name ending in an image format: .png, or one of "
            f"{', '.join('.' + f for f in formats if f != 'png')}")
    return path


def output_dir(text: str) -> Path:
    """A directory to write into (made if missing): its parent must exist already, and, where
    it is missing, take it (probed now, as for `output_file`). One that exists is not probed:
    a read-only model cache (`--model-root`) that holds the model is only read."""
    path = _parent_exists(text)
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} exists and is not a directory")
    if not path.exists():
        try:
            os.rmdir(tempfile.mkdtemp(prefix=".kvtier-probe-", dir=path.parent))
        except OSError as exc:
            raise argparse.ArgumentTypeError(
                f"{text!r}: cannot be written ({exc.strerror or exc})") from None
    return path


def work_dir(text: str) -> Path:
    """An existing directory where files can be created: probed by creating (and removing) a
    temporary directory in it, so /proc, a read-only mount or a full disk fail here, in one
    line, not as a traceback half-way through a benchmark (issue 14: `--dir /proc`).
    """
    path = Path(path_text(text))
    if not path.is_dir():
        what = "is not a directory" if path.exists() else "does not exist"
        raise argparse.ArgumentTypeError(f"{text!r} {what}")
    try:
        probe = tempfile.mkdtemp(prefix=".kvtier-probe-", dir=path)
        os.rmdir(probe)
    except OSError as exc:
        raise argparse.ArgumentTypeError(
            f"{text!r}: cannot create files there ({exc.strerror or exc})") from None
    return path


def any_path(text: str) -> Path:
    """`path_text` as a Path (it need not exist)."""
    return Path(path_text(text))


class AppendOnce(argparse.Action):
    """`action=AppendOnce`: a repeatable option (`--config vllm --config kvtier-async`), its
    values in the order first given, each once. With `append`, a configuration named twice
    started its engines twice (minutes each on a CPU), both runs reported under one name."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: object, option_string: str | None = None) -> None:
        given = list(getattr(namespace, self.dest, None) or ())  # a copy: never the default
        if values not in given:
            given.append(values)
        setattr(namespace, self.dest, given)


def url_of(*schemes: str) -> Callable[[str], str]:
    """A type function for a URL with one of `schemes` and a host, checked before a command
    connects anywhere (issue 24: `kvtier proxy --prefill x` must not start serving, then fail
    every request)."""

    def url(text: str) -> str:
        try:
            parts = urllib.parse.urlsplit(text)
        except ValueError:
            parts = urllib.parse.urlsplit("")
        if parts.scheme not in schemes or not parts.netloc:
            raise argparse.ArgumentTypeError(
                f"{redact_text(text)[:80]!r} is not a {' or '.join(schemes)} URL with a host")
        return text

    return url


http_url = url_of("http", "https")
redis_url = url_of("redis", "rediss")
