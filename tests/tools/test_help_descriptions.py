"""Every command's `--help` opens with whole sentences: the description is its module's
first paragraph, not that paragraph's first line (`kvtier bench disk-load --help` once read
"...through the worker's own path (the CPU" and stopped)."""

from __future__ import annotations

import argparse
from collections.abc import Iterator

from kvtier.tools.cli.main import build_parser

Parsers = Iterator[tuple[str, argparse.ArgumentParser]]


def _parsers(parser: argparse.ArgumentParser, name: str) -> Parsers:
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub, child in action.choices.items():
                yield from _parsers(child, f"{name} {sub}")


def test_every_description_ends_a_sentence() -> None:
    cut = {name: parser.description[-50:] for name, parser in _parsers(build_parser(), "kvtier")
           if parser.description and not parser.description.rstrip().endswith((".", ")", "`"))}
    assert cut == {}
