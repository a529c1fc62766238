"""A streaming-input session (vLLM's resumable request: one request id, its input in pieces)
follows each piece's kv_transfer_params. vLLM replaces the session's sampling params with each
new piece's (`Scheduler._update_request_as_session`, run here on real `Request`s) but keeps
`request.kv_transfer_params` the first piece's: kvtier read its switches once, so a later
piece's skip_store was ignored and its chunks stored. Scheduler logic only, as in
test_connector_scheduler.py (whose `Engine` driver is reused)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm")

from test_connector_scheduler import BLOCK, Engine
from vllm import SamplingParams
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request, StreamingUpdate


def piece(tokens: list[int], params: dict[str, Any] | None) -> Request:
    extra = {"kv_transfer_params": params} if params else None
    return Request("s", tokens, SamplingParams(max_tokens=1, extra_args=extra), None,
                   resumable=True)


def next_piece(session: Request, update: Request) -> None:
    """vLLM's own update of a waiting session with its next input piece."""
    scheduler = SimpleNamespace(hash_block_size=BLOCK, num_waiting_for_streaming_input=0,
                                log_stats=False)
    Scheduler._update_request_as_session(scheduler, session,  # type: ignore[arg-type]
                                         StreamingUpdate.from_request(update))


def test_a_later_pieces_skip_store_stops_the_sessions_stores() -> None:
    engine = Engine()
    session = piece(list(range(1000, 1200)), None)
    engine.admit(session, list(range(7)))
    assert len(engine.step(new={"s": (list(range(7)), 0, 200)}).stores) == 3
    session.num_computed_tokens = 200
    next_piece(session, piece(list(range(1200, 1400)), {"skip_store": True}))
    assert session.kv_transfer_params is None  # vLLM's: still the first piece's
    engine.admit(session, list(range(7, 13)), local_tokens=200)
    assert engine.step(cached={"s": (list(range(7, 13)), 200, 200)}).stores == []
    # A third piece without the switch stores again (what its own params say).
    session.num_computed_tokens = 400
    next_piece(session, piece(list(range(1400, 1600)), None))
    engine.admit(session, list(range(13, 19)), local_tokens=400)
    assert engine.step(cached={"s": (list(range(13, 19)), 400, 200)}).stores != []


def test_an_unchanged_pieces_controls_are_not_read_again() -> None:
    """The check is the sampling params' identity: steps of one piece parse nothing."""
    engine = Engine()
    session = piece(list(range(1000, 1200)), {"skip_store": True})
    engine.admit(session, list(range(7)))
    state = engine.sched._requests.state(session)
    controls = state.controls
    assert controls.skip_store
    assert engine.sched._requests.state(session).controls is controls
