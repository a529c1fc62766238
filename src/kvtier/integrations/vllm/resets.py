"""Resetting an engine's caches once the blocks kvtier keeps are released.

A request whose last steps stored KV keeps its blocks until the workers report the stores done,
one or two engine steps after it ended (`StorePlanner.end_request`: the stores of its last
chunks run in the next plan). vLLM's block-pool reset fails while any block is held:
`reset_prefix_cache()` returns False, and with `reset_running_requests=True` it raises
"Failed to reset KV cache even when all the running requests are preempted" (running requests
are preempted, ended ones are not), as `LLM.sleep()` does on an engine in the caller's process
(its pause resets that way). vLLM's engine-core process steps on until the blocks are released,
and its sleep and pause wait for that; an engine in the caller's process
(`VLLM_ENABLE_V1_MULTIPROCESSING=0`, the `external_launcher` of RL trainers) steps only inside
`generate`, which returns before: there a reset right after a rollout failed whenever its last
request ended with chunks still to store (tests/engine/test_weight_update_reset.py).

Primitives: `release_held_blocks` (steps an engine in this process until no ended request
holds blocks), `reset_prefix_cache` (vLLM's, once they are released; retried until it succeeds
or its deadline passes).
"""

from __future__ import annotations

import logging
import time
from typing import Any

logger = logging.getLogger(__name__)

# The message of vLLM 0.32-0.33's scheduler when reset_running_requests=True meets held blocks
# (a RuntimeError in this process; an engine-core process's failure comes back as Exception).
HELD_BLOCKS = "Failed to reset KV cache"
RETRY_S = 0.01  # between two tries on an engine in its own process (it steps meanwhile)


def _scheduler_here(llm: Any) -> Any | None:
    """The scheduler of an `LLM` whose engine core runs in this process; None otherwise."""
    from vllm.v1.engine.core_client import InprocClient

    client = llm.llm_engine.engine_core
    return client.engine_core.scheduler if isinstance(client, InprocClient) else None


def release_held_blocks(llm: Any, timeout_s: float = 30.0) -> None:
    """Step `llm` (a vLLM `LLM`) until no ended request holds blocks for kvtier's stores, as
    vLLM's engine-core process does on its own. Call it before `llm.sleep()` or
    `reset_prefix_cache` on an engine in this process; on one in its own process it does
    nothing. Requests of the caller's still running are left to the caller's own steps
    (stepping here would take their outputs): the held blocks are then released as they run.

    Raises TimeoutError if blocks are still held after `timeout_s` of steps."""
    scheduler = _scheduler_here(llm)
    if scheduler is None:
        return
    engine = llm.llm_engine
    deadline = time.monotonic() + timeout_s
    steps = 0
    while scheduler.has_finished_requests() \
            and not engine.output_processor.has_unfinished_requests():
        if time.monotonic() >= deadline:
            raise TimeoutError(f"kvtier: ended requests still hold blocks after {steps} engine "
                               f"steps ({timeout_s:g} s): their stores have not finished")
        engine.step()  # outputs: none of the caller's (it has no request unfinished)
        steps += 1
    if steps:
        logger.debug("kvtier: %d engine step(s) released the blocks ended requests held", steps)


def reset_prefix_cache(llm: Any, *, reset_running_requests: bool = False,
                       reset_connector: bool = True, timeout_s: float = 30.0) -> None:
    """vLLM's `llm.reset_prefix_cache(reset_running_requests, reset_connector)` once the
    blocks kvtier keeps for ended requests' stores are released: the reset an RL loop runs
    after a weight update in place (`reset_connector=True`: kvtier offers nothing stored
    before). An engine in this process is stepped until they are (`release_held_blocks`) and
    reset once; one in its own process is asked again every 10 ms, as it steps on its own,
    until the reset succeeds (each try with `reset_connector` retires kvtier's chunks again:
    harmless).

    Raises RuntimeError if the reset fails on an engine in this process (requests of the
    caller's running, without `reset_running_requests=True`), TimeoutError if it has not
    succeeded within `timeout_s` on one in its own process; any other failure of vLLM's reset
    as it is."""
    here = _scheduler_here(llm) is not None
    deadline = time.monotonic() + timeout_s
    tries = 0
    while True:
        release_held_blocks(llm, max(0.0, deadline - time.monotonic()))
        tries += 1
        try:
            if llm.reset_prefix_cache(reset_running_requests, reset_connector):
                return
        except Exception as error:  # only vLLM's held-blocks failure is retried
            if here or HELD_BLOCKS not in str(error):
                raise
        if here:  # nothing steps this engine between two tries
            raise RuntimeError("kvtier: vLLM's reset_prefix_cache failed: blocks in use by "
                               "requests still running in this process (pass "
                               "reset_running_requests=True to preempt them)")
        if time.monotonic() >= deadline:
            raise TimeoutError(f"kvtier: vLLM's reset_prefix_cache did not succeed in {tries} "
                               f"tries ({timeout_s:g} s): blocks still in use (requests "
                               "running, without reset_running_requests=True?)")
        time.sleep(RETRY_S)
