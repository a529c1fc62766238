"""kvtier.testing.ports: the servers' ports lie below the kernel's ephemeral range (where
vLLM's own processes take theirs as a server starts) and are free when picked."""

from __future__ import annotations

import random
import socket
from pathlib import Path

import pytest

from kvtier.testing import ports


def test_a_port_is_free_and_below_the_ephemeral_range() -> None:
    low = ports.ephemeral_low()
    for _ in range(20):
        port = ports.free_port()
        assert ports.LOWEST <= port < low
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # raises if it were taken


def test_a_port_in_use_is_never_picked(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        # The first candidate tried is the taken port (a fault injected: random order fixed).
        monkeypatch.setattr(ports._DRAW, "sample",
                            lambda population, k: [taken, *list(population)[:k - 1]])
        assert ports.free_port() != taken


def test_a_seeded_global_generator_does_not_repeat_the_picks() -> None:
    """vLLM seeds `random` (seed 0) in each process that builds an engine: two test processes
    drew the same port for two servers started at once (one answered the other's health
    check)."""
    picks = []
    for _ in range(2):
        random.seed(0)
        picks.append([ports.free_port() for _ in range(5)])
    assert picks[0] != picks[1]


def test_ports_with_an_offset_are_both_free() -> None:
    port = ports.free_port(also=(10_000,))
    assert port + 10_000 < ports.ephemeral_low()
    with socket.socket() as a, socket.socket() as b:
        a.bind(("127.0.0.1", port))
        b.bind(("127.0.0.1", port + 10_000))


def test_no_room_below_the_range_is_the_kernels_pick_or_a_clear_error(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    narrow = tmp_path / "ip_local_port_range"
    narrow.write_text("10500\t60999\n")
    monkeypatch.setattr(ports, "EPHEMERAL_RANGE", narrow)
    assert ports.free_port() >= 10_500  # the kernel's pick, in its range
    with pytest.raises(RuntimeError, match="no room below the ephemeral range"):
        ports.free_port(also=(10_000,))
    monkeypatch.setattr(ports, "EPHEMERAL_RANGE", tmp_path / "absent")
    assert ports.ephemeral_low() == 32_768
