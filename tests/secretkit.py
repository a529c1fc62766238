"""Secrets that must never be printed: the password a redis-server of a test requires
(`SECRET`) and everything one run printed or logged, as one text to grep (`Captured`), for
tests/faults/test_redis_secrets.py and tests/tools/test_doctor_secrets.py (their fixtures
`captured` and `secured`: tests/conftest.py). Not named conftest.py: see tierkit.py.
"""

from __future__ import annotations

import logging

import pytest

SECRET = "Zq7-s3cret-pw"  # nothing kvtier prints may contain this


class Captured:
    """stdout, stderr and every log record of one run, as one text to grep."""

    def __init__(self, capsys: pytest.CaptureFixture[str],
                 caplog: pytest.LogCaptureFixture) -> None:
        self.capsys, self.caplog = capsys, caplog
        caplog.set_level(logging.DEBUG)

    def text(self) -> str:
        out, err = self.capsys.readouterr()
        logs = "\n".join(f"{r.getMessage()} {r.exc_text or ''}" for r in self.caplog.records)
        return f"{out}\n{err}\n{logs}\n{self.caplog.text}"
