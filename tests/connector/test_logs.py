"""kvtier's log lines go where vLLM's go (integrations/vllm/logs.py), unless the application
set up logging itself."""

from __future__ import annotations

import io
import logging
from collections.abc import Iterator

import pytest

from kvtier.integrations.vllm.logs import adopt_vllm_logging


@pytest.fixture
def bare_logging() -> Iterator[io.StringIO]:
    """Loggers as a vLLM server has them: vLLM's with a handler, the root and kvtier's bare;
    restored after."""
    root, ours, theirs = (logging.getLogger(), logging.getLogger("kvtier"),
                          logging.getLogger("vllm"))
    saved = [(lg, lg.handlers[:], lg.level, lg.propagate) for lg in (root, ours, theirs)]
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("VLLM %(levelname)s %(message)s"))
    root.handlers, ours.handlers, theirs.handlers = [], [], [handler]
    theirs.setLevel(logging.INFO)
    try:
        yield stream
    finally:
        for logger, handlers, level, propagate in saved:
            logger.handlers, logger.propagate = handlers, propagate
            logger.setLevel(level)


def test_kvtier_info_lines_appear_in_vllms_log(bare_logging: io.StringIO) -> None:
    logging.getLogger().handlers = []  # pytest's capture handler, added for the test's call
    logging.getLogger("kvtier.integrations.vllm.connector").info("kvtier: hello before")
    assert bare_logging.getvalue() == ""  # went nowhere: what operators saw
    assert adopt_vllm_logging()
    logging.getLogger("kvtier.integrations.vllm.connector").info("kvtier: node mode")
    assert bare_logging.getvalue() == "VLLM INFO kvtier: node mode\n"
    assert not adopt_vllm_logging()  # once: no second copy of each line
    logging.getLogger("kvtier.node.client").info("kvtier: again")
    assert bare_logging.getvalue().count("again") == 1


def test_an_applications_own_logging_is_left_alone(bare_logging: io.StringIO) -> None:
    logging.getLogger().handlers = [logging.NullHandler()]  # the application's own
    assert not adopt_vllm_logging()
    assert logging.getLogger("kvtier").handlers == []
