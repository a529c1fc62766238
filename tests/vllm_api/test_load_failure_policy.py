"""kvtier's connector sets `kv_load_failure_policy` to "recompute" in its constructor, and each
supported vLLM release reads the policy only after building the scheduler-role connector,
from the object the connector wrote to. Read from the releases' source with `ast` (as
test_connector_api.py reads base.py), without importing vLLM.

vLLM offers a connector no way to state its load-failure needs (no hook or class attribute
in `KVConnectorBase_V1` of 0.32 or 0.33), and kvtier cannot avoid reporting a failed load:
its blocks are unfilled and only vLLM can recompute them. vLLM's default policy, "fail",
would end such a request with an error where a miss must cost recomputation only. So the
connector writes the policy, which works only as long as these checks hold.

Primitives: `policy_problems(scheduler_source, base_source)`.
"""

from __future__ import annotations

import ast
from pathlib import Path
from textwrap import dedent

import pytest
from hookcheck import BASE_PATH
from test_connector_api import CONNECTOR_PY
from vllm_sources import release_source

from kvtier.integrations.vllm.versions import SUPPORTED_RELEASES

SCHEDULER_PATH = "vllm/v1/core/sched/scheduler.py"
POLICY = "kv_load_failure_policy"


def policy_problems(scheduler_source: str, base_source: str) -> list[str]:
    """Why a policy written by the scheduler-role connector's constructor would not take
    effect in this release; [] when it would."""
    init = _method(scheduler_source, "Scheduler", "__init__")
    if init is None:
        return ["no Scheduler.__init__ in the scheduler module"]
    creations = [node for node in ast.walk(init) if isinstance(node, ast.Call)
                 and _unparse(node.func).endswith("create_connector")
                 and _unparse(_keyword(node, "role")).endswith(".SCHEDULER")]
    if not creations:
        return ["Scheduler.__init__ builds no connector with role SCHEDULER"]
    built_at = creations[0].lineno
    reads = [node for node in ast.walk(init) if isinstance(node, ast.Attribute)
             and node.attr == POLICY and isinstance(node.ctx, ast.Load)]
    problems = [f"Scheduler.__init__ reads {POLICY} (line {r.lineno}) before it builds the "
                f"connector (line {built_at})" for r in reads if r.lineno <= built_at]
    if not any(r.lineno > built_at for r in reads):
        problems.append(f"Scheduler.__init__ reads no {POLICY} after building the connector")
    for read in reads:
        source = _assigned(init, read.value)
        if not source.endswith("vllm_config.kv_transfer_config"):
            problems.append(f"Scheduler.__init__ reads {POLICY} from {source}, not from the "
                            "vllm_config.kv_transfer_config the connector is given")
    if not _unparse(_keyword(creations[0], "config")).endswith("vllm_config"):
        problems.append("the connector is not built with the scheduler's vllm_config")
    base_init = _method(base_source, "KVConnectorBase_V1", "__init__")
    kept = base_init is not None and any(
        isinstance(node, ast.Assign) and _unparse(node.value) == "vllm_config.kv_transfer_config"
        and any(_unparse(t) == "self._kv_transfer_config" for t in node.targets)
        for node in ast.walk(base_init))
    if not kept:
        problems.append("KVConnectorBase_V1.__init__ does not keep vllm_config's own "
                        "kv_transfer_config as self._kv_transfer_config")
    return problems


def _method(source: str, class_name: str, name: str) -> ast.FunctionDef | None:
    for node in ast.parse(source).body:
        if isinstance(node, ast.ClassDef) and node.name == class_name:
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == name:
                    return item
    return None


def _keyword(call: ast.Call, name: str) -> ast.expr | None:
    return next((k.value for k in call.keywords if k.arg == name), None)


def _unparse(node: ast.expr | None) -> str:
    return "" if node is None else ast.unparse(node)


def _assigned(function: ast.FunctionDef, value: ast.expr) -> str:
    """`value` as source; a local name is replaced by what the function assigns it."""
    if isinstance(value, ast.Name):
        for node in ast.walk(function):
            if isinstance(node, ast.Assign) and any(
                    isinstance(t, ast.Name) and t.id == value.id for t in node.targets):
                return _unparse(node.value)
    return _unparse(value)


@pytest.mark.parametrize("release", SUPPORTED_RELEASES, ids=lambda r: r.label())
def test_the_release_reads_the_policy_after_building_the_connector(release):
    problems = policy_problems(release_source(release, SCHEDULER_PATH),
                               release_source(release, BASE_PATH))

    assert not problems, (f"{release.distribution} {release.version}: the policy kvtier's "
                          "connector writes would not take effect:\n  " + "\n  ".join(problems))


def test_the_connector_writes_the_policy_in_its_constructor():
    init = _method(Path(CONNECTOR_PY).read_text(), "KVTierConnector", "__init__")
    assert init is not None
    writes = [node for node in ast.walk(init) if isinstance(node, ast.Attribute)
              and node.attr == POLICY and isinstance(node.ctx, ast.Store)]
    assert [_unparse(w.value) for w in writes] == ["self._kv_transfer_config"]


# -- the check itself, on synthetic sources ---------------------------------------------

SCHEDULER = dedent('''
    class Scheduler(SchedulerInterface):
        def __init__(self, vllm_config, kv_cache_config):
            self.vllm_config = vllm_config
            kv_transfer_config = self.vllm_config.kv_transfer_config
            if kv_transfer_config is not None:
                self.connector = KVConnectorFactory.create_connector(
                    config=self.vllm_config, role=KVConnectorRole.SCHEDULER,
                    kv_cache_config=kv_cache_config)
                policy = kv_transfer_config.kv_load_failure_policy
                self.recompute_kv_load_failures = policy == "recompute"
''')
BASE = dedent('''
    class KVConnectorBase_V1:
        def __init__(self, vllm_config, role, kv_cache_config):
            self._kv_transfer_config = vllm_config.kv_transfer_config
''')


def test_a_release_as_read_today_passes():
    assert policy_problems(SCHEDULER, BASE) == []


@pytest.mark.parametrize(("scheduler", "base", "expected"), [
    # The policy read before the connector exists: the connector's write comes too late.
    (SCHEDULER.replace("        if kv_transfer_config is not None:",
                       "        early = kv_transfer_config.kv_load_failure_policy\n"
                       "        if kv_transfer_config is not None:"), BASE,
     "before it builds the connector"),
    # vLLM stops reading the policy (e.g. takes it from the connector some other way).
    (SCHEDULER.replace("kv_transfer_config.kv_load_failure_policy", '"fail"'), BASE,
     "reads no kv_load_failure_policy after"),
    # The policy read from a copy of the config.
    (SCHEDULER.replace("policy = kv_transfer_config.", "policy = self.copied."), BASE,
     "from self.copied"),
    # The connector handed a copy of the config.
    (SCHEDULER, BASE.replace("= vllm_config.kv_transfer_config",
                             "= copy(vllm_config.kv_transfer_config)"),
     "does not keep vllm_config's own"),
], ids=["read-early", "not-read", "read-from-a-copy", "connector-given-a-copy"])
def test_a_release_that_would_ignore_the_write_is_reported(scheduler, base, expected):
    problems = policy_problems(scheduler, base)

    assert any(expected in problem for problem in problems), problems
