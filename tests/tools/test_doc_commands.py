"""The operator pages' `kvtier` commands against the command's own parser: configuration.md's
table of operator tools (which the README calls the full list) names every command and every
`kvtier bench` workload, and nothing else; every `kvtier ...` command line in an operator page
uses only options its (sub-)command has, each with a value it takes (a lowercase word: an
upper-case one is a placeholder). Before this test the table lacked `kvtier proxy` and the
benches `sharing`, `disagg`, `mover`, `prefix-repetition` and `long-doc`; and `kvtier bench
sharing --help` said its default was "both" of its three sources."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from kvtier.tools.bench.sharing import SOURCES
from kvtier.tools.cli.main import build_parser

ROOT = Path(__file__).resolve().parents[2]
PAGES = ("README.md", "docs/configuration.md", "docs/deploy.md", "docs/node.md",
         "docs/sharing.md", "docs/s3.md", "docs/retention.md")


def commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()
             ) -> dict[tuple[str, ...], argparse.ArgumentParser]:
    """Every (sub-)command's words -> its parser."""
    found = {path: parser}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found |= commands(sub, (*path, name))
    return found


PARSERS = commands(build_parser())


def tool_table() -> str:
    text = (ROOT / "docs/configuration.md").read_text()
    return text.split("\n## Operator tools\n", 1)[1].split("\n## ", 1)[0]


def tabled() -> set[tuple[str, ...]]:
    """The commands the table's first column names (each one's longest match)."""
    cells = [line.split("|")[1] for line in tool_table().splitlines() if line.startswith("| `")]
    return {longest(words.split()) for cell in cells
            for words in re.findall(r"`kvtier ([a-z -]+)", cell)}


def longest(words: list[str]) -> tuple[str, ...]:
    """The longest command `words` start with."""
    path: tuple[str, ...] = ()
    for word in words:
        if (*path, word) not in PARSERS:
            break
        path = (*path, word)
    return path


def test_the_tool_table_names_every_command_and_bench() -> None:
    def named(path: tuple[str, ...]) -> tuple[str, ...]:
        return path if path[0] == "bench" else path[:1]  # a bench by its workload

    assert {named(path) for path in tabled()} == {named(path) for path in PARSERS
                                                  if path and path != ("bench",)}


def command_lines(text: str) -> list[str]:
    """Each `kvtier ...` command line of a page: a code span, or a line of a code block (its
    continuation lines joined)."""
    text = text.replace("\\\n", " ")
    spans = re.findall(r"`(kvtier [^`]+)`", text)
    blocks = [line.strip() for block in re.findall(r"```(?:bash)?\n(.*?)```", text, re.S)
              for line in block.splitlines() if line.strip().startswith("kvtier ")]
    return spans + blocks


@pytest.mark.parametrize("page", PAGES)
def test_every_command_line_uses_options_its_command_has(page: str) -> None:
    wrong = []
    for line in command_lines((ROOT / page).read_text()):
        words = line.split("#", 1)[0].split(" -- ", 1)[0].split()
        path = longest(words[1:])
        if not path:
            continue
        actions = {o: action for action in PARSERS[path]._actions for o in action.option_strings}
        for word, value in zip(words, [*words[1:], ""]):
            flag = word.split("=", 1)[0]
            if not re.fullmatch(r"--?[a-z][\w-]*", flag):
                continue
            if flag not in actions:
                wrong.append(f"{line}: {flag}")
                continue
            value = word.split("=", 1)[1] if "=" in word else value
            choices = actions[flag].choices
            if choices and re.fullmatch(r"[a-z][\w.-]*", value) and value not in choices:
                wrong.append(f"{line}: {flag} {value}")
    assert wrong == []


def test_bench_sharing_help_names_its_default_sources() -> None:
    source = next(a for a in PARSERS[("bench", "sharing")]._actions if a.dest == "source")
    assert all(name in str(source.help) for name in SOURCES)
