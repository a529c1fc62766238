"""The server start shared by `kvtier bench interference` and `kvtier bench disagg`: a start
that fails because another engine holds the memory is tried again, any other failure is not."""

from __future__ import annotations

import pytest

from kvtier.errors import ServerError
from kvtier.tools.bench.serving import arrivals


def test_a_start_short_of_memory_is_retried_and_other_failures_are_not(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(arrivals, "_RETRY_WAIT_S", 0.0)
    lines: list[str] = []
    tries: list[int] = []

    def short_twice() -> str:
        tries.append(1)
        if len(tries) <= 2:
            raise ServerError("free memory on device is less than desired GPU memory")
        return "started"

    assert arrivals.retry_while_memory_short(short_twice, lines.append, "vllm: ") == "started"
    assert len(tries) == 3 and lines[0].startswith("vllm: not enough free memory")

    def always_short() -> str:
        raise ServerError("less than desired")

    with pytest.raises(ServerError):
        arrivals.retry_while_memory_short(always_short, lines.append)
    assert len(lines) == 2 + 3  # three retries, then the fourth failure is raised

    def broken() -> str:
        raise ServerError("exited with code 1")

    with pytest.raises(ServerError, match="code 1"):
        arrivals.retry_while_memory_short(broken, lines.append)
    assert len(lines) == 5
