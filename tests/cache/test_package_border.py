"""The border between the cache and the operator tools (issue 24).

The cache (kvtier.core, kvtier.tiers, kvtier.integrations, kvtier.config, kvtier.errors, ...)
is what vLLM imports, with only the dependencies pyproject's [project] list names; the tools
(kvtier.tools) import the cache and bring their own (the `tools` extra). These tests read the
code, and import the connector in a fresh interpreter, so that a stray import fails here.

Inside the cache, packages import one way only: kvtier.config (and errors, units, redaction)
<- kvtier.core <- kvtier.tiers <- kvtier.integrations. `kvtier.config` knows no tier: the
store's config model lives with the tier factory (kvtier.tiers.storeconfig).
"""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

from tierkit import run_probe, tools_dependencies

SRC = Path(__file__).resolve().parents[2] / "src" / "kvtier"
PYPROJECT = SRC.parents[1] / "pyproject.toml"
TOOLS = SRC / "tools"


def _imported_modules(path: Path) -> set[str]:
    """Every module `path` imports by name (relative imports resolved), at any depth."""
    module = "kvtier." + ".".join(path.relative_to(SRC).with_suffix("").parts)
    package = module.rsplit(".", 1)[0] if path.name != "__init__.py" else module
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            found.add(base)
    return found


def test_the_cache_never_imports_the_tools() -> None:
    offenders = {
        str(path.relative_to(SRC)): sorted(m for m in _imported_modules(path)
                                          if m.startswith("kvtier.tools"))
        for path in SRC.rglob("*.py") if TOOLS not in path.parents
    }
    assert {f: m for f, m in offenders.items() if m} == {}


# Each cache package and the kvtier packages it must never import (not even for type checks).
LAYERS = {
    "config.py": ("kvtier.core", "kvtier.tiers", "kvtier.node", "kvtier.integrations"),
    "core": ("kvtier.tiers", "kvtier.node", "kvtier.integrations"),
    "tiers": ("kvtier.node", "kvtier.integrations"),
    "node": ("kvtier.integrations",),
}


def test_the_cache_packages_import_one_way_only() -> None:
    """No circle at package level: config <- core <- tiers <- node <- integrations."""
    offenders = {}
    for part, forbidden in LAYERS.items():
        paths = [SRC / part] if part.endswith(".py") else sorted((SRC / part).rglob("*.py"))
        for path in paths:
            found = sorted(m for m in _imported_modules(path) if m.startswith(forbidden))
            if found:
                offenders[str(path.relative_to(SRC))] = found
    assert offenders == {}


def test_importing_the_config_imports_no_tier() -> None:
    """`kvtier.config` imports no module of kvtier.tiers (nor the rest of the cache)."""
    probe = ("import json, sys\n"
             "import kvtier.config\n"
             "print(json.dumps(sorted(m for m in sys.modules if m.startswith('kvtier'))))\n")
    loaded = run_probe(probe)
    assert "kvtier.config" in loaded
    assert not [m for m in loaded if m.startswith(("kvtier.tiers", "kvtier.core",
                                                   "kvtier.integrations"))], loaded


def test_the_cache_imports_without_thetools_dependencies() -> None:
    """Without vLLM in the picture: the tools' dependencies made unimportable, every cache
    module still imports."""
    probe = (
        "import importlib, json, pkgutil, sys\n"
        f"for name in {tools_dependencies()!r}: sys.modules[name] = None\n"
        "import kvtier\n"
        "names = [m.name for m in pkgutil.walk_packages(kvtier.__path__, 'kvtier.')\n"
        "         if not m.name.startswith(('kvtier.tools', 'kvtier.integrations'))]\n"
        "for name in names: importlib.import_module(name)\n"
        "print(json.dumps(names))\n"
    )
    imported = run_probe(probe)
    assert "kvtier.core.store" in imported and "kvtier.tiers.redis.tier" in imported


def test_every_cache_dependency_is_declared_and_used() -> None:
    """pyproject's [project] dependencies are the ones the cache imports: none missing, none
    declared and imported nowhere."""
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    import_names = {"pyyaml": "yaml", "ml-dtypes": "ml_dtypes", "prometheus_client":
                    "prometheus_client", "pyzmq": "zmq"}
    declared = {import_names.get(name, name) for name in
                (dep.split(">")[0].split("=")[0] for dep in project["dependencies"])}
    imported = {m.split(".")[0] for path in SRC.rglob("*.py") if TOOLS not in path.parents
                for m in _imported_modules(path)}
    assert declared - imported == set(), "declared and imported nowhere in the cache"


def test_the_connectors_scheduler_and_worker_sides_never_import_each_other() -> None:
    """integrations/vllm/: scheduler/ and worker/ share only what lies beside them (the
    messages, the config, the engine's description), never a module of the other side."""
    vllm = SRC / "integrations" / "vllm"
    offenders = {}
    for side, other in (("scheduler", "worker"), ("worker", "scheduler")):
        for path in sorted((vllm / side).rglob("*.py")):
            found = sorted(m for m in _imported_modules(path)
                           if m.startswith(f"kvtier.integrations.vllm.{other}"))
            if found:
                offenders[str(path.relative_to(SRC))] = found
    shared = [path for path in vllm.glob("*.py") if path.name not in ("connector.py",
                                                                      "__init__.py")]
    for path in shared:  # the shared modules belong to neither side
        found = sorted(m for m in _imported_modules(path)
                       if m.startswith(("kvtier.integrations.vllm.scheduler",
                                        "kvtier.integrations.vllm.worker")))
        if found:
            offenders[str(path.relative_to(SRC))] = found
    assert offenders == {}


# -- the tests and kvtier.testing: the cache's tests need no tool (issue 42) ---------------

TESTS = SRC.parents[1] / "tests"
TESTING = SRC / "testing"
# Test files that name kvtier.tools in a string on purpose: to check that nothing imports it.
BORDER_TESTS = {"cache/test_package_border.py", "connector/test_connector_border.py"}


def _test_imports(path: Path) -> set[str]:
    """Every module a test file imports by name, at any depth (tests are no package)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level:
            found.add(node.module or "")
    return found


def _strings_naming_the_tools(path: Path) -> list[str]:
    """The string constants of a file (not its docstrings) that name kvtier.tools: a module
    run by `python -m`, imported by name (importlib), or patched by its dotted path."""
    tree = ast.parse(path.read_text(), str(path))
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef,
                                       ast.ClassDef))
                  and node.body and isinstance(node.body[0], ast.Expr)
                  and isinstance(node.body[0].value, ast.Constant)}
    return [node.value for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str)
            and id(node) not in docstrings and "kvtier.tools" in node.value]


def _tests_outside_the_tools() -> list[Path]:
    return sorted(p for p in TESTS.rglob("*.py") if "tools" not in p.relative_to(TESTS).parts[:1])


def test_no_test_outside_tests_tools_imports_the_tools() -> None:
    """tests/cache, tiers, faults, connector, engine, vllm_api, gpu and the shared kits
    (tests/*.py) import nothing of kvtier.tools, at any depth, nor run it (`-m
    kvtier.tools...`): the cache's tests run without the `tools` extra."""
    paths = _tests_outside_the_tools()
    assert any(p.name == "vllm_harness.py" for p in paths)
    imports = {str(p.relative_to(TESTS)): sorted(m for m in _test_imports(p)
                                                  if m.startswith("kvtier.tools"))
               for p in paths}
    assert {f: m for f, m in imports.items() if m} == {}
    strings = {str(p.relative_to(TESTS)): _strings_naming_the_tools(p) for p in paths
               if str(p.relative_to(TESTS)) not in BORDER_TESTS}
    assert {f: s for f, s in strings.items() if s} == {}


def test_the_tests_kits_reach_the_tools_only_from_tests_tools() -> None:
    """A plain grep, as a reviewer would run it: outside tests/tools, "kvtier.tools" appears
    in the border tests only (and in prose: a docstring or comment naming a tool's module)."""
    offenders = []
    for path in _tests_outside_the_tools():
        relative = str(path.relative_to(TESTS))
        for number, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if relative not in BORDER_TESTS and ("-m kvtier.tools" in code
                                                 or "import kvtier.tools" in code
                                                 or "from kvtier.tools" in code):
                offenders.append(f"{relative}:{number}: {line.strip()}")
    assert offenders == []


def test_kvtier_testing_imports_no_tool() -> None:
    """kvtier.testing (the cache's test doubles) imports nothing of kvtier.tools."""
    offenders = {str(p.relative_to(SRC)): sorted(m for m in _imported_modules(p)
                                                 if m.startswith("kvtier.tools"))
                 for p in TESTING.rglob("*.py")}
    assert {f: m for f, m in offenders.items() if m} == {}


def test_kvtier_testing_imports_without_the_tools_dependencies() -> None:
    """The tools' dependencies made unimportable, every kvtier.testing module still imports
    (those that need vLLM or torch import them only when called)."""
    probe = (
        "import importlib, json, pkgutil, sys\n"
        f"for name in {tools_dependencies()!r}: sys.modules[name] = None\n"
        "import kvtier.testing\n"
        "names = [m.name for m in pkgutil.walk_packages(kvtier.testing.__path__,\n"
        "                                                'kvtier.testing.')]\n"
        "for name in names: importlib.import_module(name)\n"
        "print(json.dumps(sorted(names + [m for m in sys.modules\n"
        "                                 if m.startswith('kvtier.tools')])))\n"
    )
    imported = run_probe(probe)
    assert "kvtier.testing.tinymodel" in imported and "kvtier.testing.netem" in imported
    assert not [m for m in imported if m.startswith("kvtier.tools")], imported


def test_the_cache_never_imports_kvtier_testing() -> None:
    """The cache (core, tiers, integrations, config, errors, ...) imports nothing of
    kvtier.testing: test doubles are the tests' and the tools', never vLLM's."""
    offenders = {
        str(path.relative_to(SRC)): sorted(m for m in _imported_modules(path)
                                          if m.startswith("kvtier.testing"))
        for path in SRC.rglob("*.py") if TOOLS not in path.parents and TESTING not in path.parents
    }
    assert {f: m for f, m in offenders.items() if m} == {}
