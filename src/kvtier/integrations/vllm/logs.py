"""kvtier's log lines where vLLM's go.

kvtier logs through `logging.getLogger("kvtier....")`. vLLM configures only its own logger
("vllm": a handler, a format, VLLM_LOGGING_LEVEL) and leaves the root logger bare, so inside a
vLLM server kvtier's INFO lines (its config, the vLLM version check, node mode, a tier's
recovery) went nowhere, and an operator could not see that kvtier was active (issue 44).

Primitives: `adopt_vllm_logging`.
"""

from __future__ import annotations

import logging


def adopt_vllm_logging() -> bool:
    """Give kvtier's loggers vLLM's handlers and level, unless the application configured
    logging itself (the root logger or kvtier's has a handler: an operator's config, pytest's
    capture) or vLLM did not (VLLM_CONFIGURE_LOGGING=0). True when it did. Idempotent."""
    ours, theirs = logging.getLogger("kvtier"), logging.getLogger("vllm")
    if ours.handlers or logging.getLogger().handlers or not theirs.handlers:
        return False
    for handler in theirs.handlers:
        ours.addHandler(handler)
    ours.setLevel(theirs.level or logging.INFO)
    ours.propagate = False  # vLLM's handlers print it; the root would add nothing
    return True
