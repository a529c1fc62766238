"""kvtier's error vocabulary lives in one module (kvtier.errors), and every exception in it is
a KVTierError, so that `except KVTierError` catches whatever kvtier raises on purpose."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import kvtier.errors
from kvtier.errors import KVTierError

SRC = Path(kvtier.errors.__file__).parent


def _exception_classes(path: Path) -> list[str]:
    """Classes in `path` whose bases name an exception: a built-in one or one of
    kvtier.errors'."""
    ours = {name for name, obj in inspect.getmembers(kvtier.errors, inspect.isclass)
            if issubclass(obj, BaseException)}
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ClassDef):
            bases = [ast.unparse(base).rsplit(".", 1)[-1] for base in node.bases]
            if any(b.endswith(("Error", "Exception")) or b in ours for b in bases):
                found.append(f"{path.relative_to(SRC)}:{node.name}")
    return found


def test_every_exception_class_is_defined_in_errors() -> None:
    elsewhere = [found for path in SRC.rglob("*.py") if path.name != "errors.py"
                 or path.parent != SRC for found in _exception_classes(path)]
    assert elsewhere == []


def test_every_error_is_a_kvtier_error() -> None:
    classes = [obj for _, obj in inspect.getmembers(kvtier.errors, inspect.isclass)
               if obj.__module__ == "kvtier.errors"]
    assert len(classes) >= 10
    assert [c.__name__ for c in classes if not issubclass(c, KVTierError)] == []
