"""docs/architecture.md's module map ("## The folders") against src/kvtier: every module it
names exists in the folder it names it under, and every module of the cache and of testing/
is named (the tools are described a folder at a time: one module per sub-command). The map
once lacked eleven of them, among them the node's links.py, stream.py and cli.py, the disk
tier's owner.py and the scheduler's losthits.py."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src" / "kvtier"
# A folder's line: its name, then its description after two spaces or more (a folder named in
# a description, `audit/ (rules)`, is no line of its own).
FOLDER = re.compile(r"( *)([\w/]+/)(?: {2,}|$)(.*)")
MODULE = re.compile(r"(?<![\w./])((?:\w+/)*\w+\.py)\b")


def module_map() -> str:
    text = (ROOT / "docs" / "architecture.md").read_text()
    return text.split("\n## The folders\n```\n", 1)[1].split("\n```", 1)[0]


def named_modules() -> set[Path]:
    """Each module the map names, as a path below src/kvtier: a name in the folder whose line
    it is under (a line deeper than a folder's is that folder's), a path below src/kvtier."""
    folders: list[tuple[int, str]] = []  # (indent, path below src/kvtier), outermost first
    named: set[Path] = set()
    for line in module_map().splitlines():
        indent = len(line) - len(line.lstrip())
        while folders and folders[-1][0] >= indent:
            folders.pop()
        text = line
        folder = FOLDER.fullmatch(line)
        if folder:
            parent = folders[-1][1] if folders else ""
            path = folder.group(2) if folder.group(2) == "src/kvtier/" else parent + folder.group(2)
            folders.append((indent, "" if path == "src/kvtier/" else path))
            text = folder.group(3)
        here = folders[-1][1] if folders else ""
        for name in MODULE.findall(text):
            named.add(Path(name if "/" in name else here + name))
    return named


def test_every_module_the_map_names_exists_where_it_says() -> None:
    assert {path for path in named_modules() if not (SRC / path).is_file()} == set()


def test_the_map_names_every_module_of_the_cache_and_testing() -> None:
    modules = {path.relative_to(SRC) for path in SRC.rglob("*.py")
               if path.name not in ("__init__.py", "__main__.py")
               and path.relative_to(SRC).parts[0] != "tools"}
    assert modules - named_modules() == set()
