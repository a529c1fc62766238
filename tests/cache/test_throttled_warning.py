"""A warning a failing medium repeats at every chunk is logged at once, then at most once an
interval, saying how many were held back (found by trying: a node's disk made unwritable
logged a warning per dropped chunk, and the disk and shared tiers' writes do the same)."""

from __future__ import annotations

import logging
import threading

import pytest

from kvtier.core.throttled import ThrottledWarning


def test_a_repeated_warning_is_logged_once_an_interval_with_the_count_held_back(
        caplog: pytest.LogCaptureFixture) -> None:
    clock = [0.0]
    warning = ThrottledWarning(logging.getLogger("kvtier.test.throttled"), every_s=10,
                               clock=lambda: clock[0])
    with caplog.at_level(logging.WARNING, "kvtier.test.throttled"):
        for chunk in range(500):
            warning.warning("write of %d failed; dropped", chunk)
        clock[0] = 9.9
        warning.warning("write of %d failed; dropped", 500)
        clock[0] = 10.0
        warning.warning("write of %d failed; dropped", 501)
        clock[0] = 100.0
        warning.warning("write of %d failed; dropped", 502)
    assert [r.getMessage() for r in caplog.records] == [
        "write of 0 failed; dropped",
        "write of 501 failed; dropped (and 500 more like it since the last, not logged)",
        "write of 502 failed; dropped",
    ]


def test_threads_warning_at_once_log_one_line(caplog: pytest.LogCaptureFixture) -> None:
    warning = ThrottledWarning(logging.getLogger("kvtier.test.throttled"), every_s=3600)
    start = threading.Barrier(8)

    def fail() -> None:
        start.wait()
        for _ in range(100):
            warning.warning("write failed")

    threads = [threading.Thread(target=fail) for _ in range(8)]
    with caplog.at_level(logging.WARNING, "kvtier.test.throttled"):
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert [r.getMessage() for r in caplog.records] == ["write failed"]
