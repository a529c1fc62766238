"""Does a connector class implement vLLM's `KVConnectorBase_V1` hooks? Read from source with
`ast`, so that neither vLLM nor the connector is imported (issue 23): the check runs against
any release, installed or not.

Rules, per release:
  - every method the connector defines that a base class of it in vLLM's base.py also
    defines has the same kind (method, classmethod, staticmethod, property) and the same
    parameters: positional ones with the same names in the same order, the same keyword-only
    names, a default wherever vLLM's has one, and *args / **kwargs wherever vLLM's takes
    them. The connector may add trailing parameters with defaults, and *args / **kwargs;
  - every @abstractmethod of those base classes is defined by the connector itself;
  - every name the connector imports from vLLM's base module exists there.
Annotations are not compared: vLLM writes many of them as strings, and a connector that
narrows a return type is still called the same way.

Primitives: `Hook`, `class_hooks(source)`, `hook_mismatches(base_source, connector_source)`.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass

BASE_MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.base"
BASE_PATH = BASE_MODULE.replace(".", "/") + ".py"
CONNECTOR_CLASS = "KVTierConnector"
KINDS = ("classmethod", "staticmethod", "property")


@dataclass(frozen=True, slots=True)
class Param:
    """One named parameter of a hook (self and cls are not listed)."""

    name: str
    kind: str  # "positional-only", "positional" or "keyword-only"
    has_default: bool


@dataclass(frozen=True, slots=True)
class Hook:
    """A method as a caller sees it."""

    name: str
    kind: str  # "method", "classmethod", "staticmethod" or "property"
    params: tuple[Param, ...]
    varargs: bool  # takes *args
    varkw: bool  # takes **kwargs
    abstract: bool  # decorated @abstractmethod

    def positional(self) -> list[Param]:
        return [p for p in self.params if p.kind != "keyword-only"]

    def keyword_only(self) -> dict[str, Param]:
        return {p.name: p for p in self.params if p.kind == "keyword-only"}


@dataclass(frozen=True, slots=True)
class ClassInfo:
    """A top-level class: the names of its bases and the hooks its body defines."""

    bases: tuple[str, ...]
    hooks: dict[str, Hook]


def class_hooks(source: str, filename: str = "<source>") -> dict[str, ClassInfo]:
    """Every top-level class of `source`, by name. Raises SyntaxError."""
    classes: dict[str, ClassInfo] = {}
    for node in ast.parse(source, filename).body:
        if isinstance(node, ast.ClassDef):
            hooks: dict[str, Hook] = {}
            for item in node.body:
                if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
                    # A property's setter repeats its name: the getter describes it.
                    hooks.setdefault(item.name, _hook(item))
            # `base.KVConnectorBase_V1` names the same class as `KVConnectorBase_V1`.
            bases = tuple(_name(b).rpartition(".")[2] for b in node.bases)
            classes[node.name] = ClassInfo(bases, hooks)
    return classes


def hook_mismatches(base_source: str, connector_source: str,
                    connector_class: str = CONNECTOR_CLASS) -> list[str]:
    """What the connector class in `connector_source` gets wrong against vLLM's base module
    `base_source`, one sentence each; [] when it matches."""
    base = class_hooks(base_source, BASE_PATH)
    connector = class_hooks(connector_source, "connector.py")
    if connector_class not in connector:
        return [f"no class {connector_class} in the connector's source"]
    problems = [f"imports {name} from {BASE_MODULE}, which does not define it"
                for name in _imported_from_base(connector_source)
                if name not in _top_level_names(base_source)]
    ours = connector[connector_class]
    inherited = _base_hooks(ours.bases, base, problems)
    for name, theirs in inherited.items():
        if name in ours.hooks:
            problems += [f"{name}: {p}" for p in _compare(theirs, ours.hooks[name])]
        elif theirs.abstract:
            problems.append(f"{name}: abstract in vLLM, not implemented")
    return problems


def _base_hooks(bases: tuple[str, ...], base: dict[str, ClassInfo],
                problems: list[str]) -> dict[str, Hook]:
    """The hooks of `bases` (and of their bases in base.py), the first definition of each
    name winning as in the MRO of single-level mixins."""
    hooks: dict[str, Hook] = {}
    pending, seen = list(bases), set()
    while pending:
        name = pending.pop(0)
        if name in seen or name in ("ABC", "object", "Generic"):
            continue
        seen.add(name)
        if name not in base:
            problems.append(f"base class {name} is not defined in vLLM's base module")
            continue
        for hook_name, hook in base[name].hooks.items():
            hooks.setdefault(hook_name, hook)
        pending += base[name].bases
    return hooks


def _compare(theirs: Hook, ours: Hook) -> list[str]:
    """How `ours` cannot stand in for `theirs` (vLLM's), one phrase each."""
    if theirs.kind != ours.kind:
        return [f"a {ours.kind} in kvtier, a {theirs.kind} in vLLM"]
    if theirs.kind == "property":
        return []
    problems: list[str] = []
    ours_positional = ours.positional()
    for index, param in enumerate(theirs.positional()):
        if index >= len(ours_positional):
            problems.append(f"lacks vLLM's positional parameter {param.name!r}")
            continue
        mine = ours_positional[index]
        if mine.name != param.name:
            problems.append(f"positional parameter {index + 1} is {mine.name!r}, vLLM's is "
                            f"{param.name!r}")
        elif mine.kind != param.kind:
            problems.append(f"parameter {param.name!r} is {mine.kind}, vLLM's is {param.kind}")
        elif param.has_default and not mine.has_default:
            problems.append(f"parameter {param.name!r} has no default, vLLM's has one")
    problems += [f"adds parameter {extra.name!r} without a default"
                 for extra in ours_positional[len(theirs.positional()):]
                 if not extra.has_default]
    ours_keywords = ours.keyword_only()
    for name, param in theirs.keyword_only().items():
        if name not in ours_keywords:
            problems.append(f"lacks vLLM's keyword-only parameter {name!r}")
        elif param.has_default and not ours_keywords[name].has_default:
            problems.append(f"keyword-only parameter {name!r} has no default, vLLM's has one")
    problems += [f"adds keyword-only parameter {name!r} without a default"
                 for name, param in ours_keywords.items()
                 if name not in theirs.keyword_only() and not param.has_default]
    if theirs.varargs and not ours.varargs:
        problems.append("takes no *args, vLLM's takes them")
    if theirs.varkw and not ours.varkw:
        problems.append("takes no **kwargs, vLLM's takes them")
    return problems


def _hook(node: ast.FunctionDef | ast.AsyncFunctionDef) -> Hook:
    decorators = [_name(d) for d in node.decorator_list]
    kind = next((k for k in KINDS if k in decorators), "method")
    if any(d.endswith(".setter") or d.endswith(".deleter") for d in decorators):
        kind = "property"
    args = node.args
    positional = [(a, "positional-only") for a in args.posonlyargs]
    positional += [(a, "positional") for a in args.args]
    if kind != "staticmethod":
        positional = positional[1:]  # self or cls: how it is named is the connector's affair
    # Defaults belong to the last positional parameters (of posonly + regular together).
    first_default = len(args.posonlyargs) + len(args.args) - len(args.defaults)
    offset = 0 if kind == "staticmethod" else 1
    params = [Param(a.arg, k, i + offset >= first_default) for i, (a, k) in enumerate(positional)]
    params += [Param(a.arg, "keyword-only", d is not None)
               for a, d in zip(args.kwonlyargs, args.kw_defaults)]
    return Hook(node.name, kind, tuple(params), varargs=args.vararg is not None,
                varkw=args.kwarg is not None,
                abstract=any(d.rpartition(".")[2] == "abstractmethod" for d in decorators))


def _name(node: ast.expr) -> str:
    """`abc.abstractmethod` -> "abc.abstractmethod"; `Generic[T]` -> "Generic"."""
    if isinstance(node, ast.Subscript | ast.Call):
        return _name(node.value if isinstance(node, ast.Subscript) else node.func)
    return ast.unparse(node)


def _imported_from_base(source: str) -> list[str]:
    """The names `source` imports from vLLM's base module, anywhere in the file."""
    return [alias.name for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.ImportFrom) and node.module == BASE_MODULE
            for alias in node.names]


def _top_level_names(source: str) -> set[str]:
    """What a module defines at its top level (classes, functions, assignments, imports),
    including inside top-level `if` / `try` blocks (TYPE_CHECKING, fallbacks)."""
    names: set[str] = set()
    pending: list[ast.stmt] = list(ast.parse(source).body)
    while pending:
        node = pending.pop()
        if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names.update((a.asname or a.name).partition(".")[0] for a in node.names)
        elif isinstance(node, ast.If | ast.Try):
            pending += node.body + node.orelse
            pending += getattr(node, "finalbody", [])
            for handler in getattr(node, "handlers", []):
                pending += handler.body
    return names
