"""kvtier's connector implements `KVConnectorBase_V1` as each supported vLLM release defines
it (issue 23): hooks, parameters and abstract methods, read from the release's own base.py
and from kvtier's connector.py with `ast` (hookcheck.py), without importing either.

The CUDA release (vllm 0.33) is not installed in CI: its wheel is downloaded once into a
cache (vllm_sources.py). Without a registry this fails, saying so, unless KVTIER_OFFLINE=1.
The synthetic cases below show that the check does fail on a broken connector.
"""

from __future__ import annotations

from pathlib import Path
from textwrap import dedent

import pytest
from hookcheck import BASE_PATH, class_hooks, hook_mismatches
from vllm_sources import release_source

from kvtier.integrations.vllm.versions import SUPPORTED_RELEASES

CONNECTOR_PY = Path(__file__).resolve().parents[2] / "src/kvtier/integrations/vllm/connector.py"


@pytest.mark.parametrize("release", SUPPORTED_RELEASES, ids=lambda r: r.label())
def test_the_connector_implements_every_hook_of_the_release(release):
    source = release_source(release, BASE_PATH)
    problems = hook_mismatches(source, CONNECTOR_PY.read_text())

    assert not problems, (f"KVTierConnector does not match {release.distribution} "
                          f"{release.version}'s KVConnectorBase_V1 ({BASE_PATH}):\n  "
                          + "\n  ".join(problems))
    # The check saw the real thing: the release's abstract hooks are all there.
    abstract = {name for info in class_hooks(source).values()
                for name, hook in info.hooks.items() if hook.abstract}
    assert {"start_load_kv", "wait_for_save", "get_num_new_matched_tokens",
            "build_connector_meta", "request_finished_all_groups"} <= abstract


# -- the check itself, on synthetic sources ---------------------------------------------

BASE = dedent('''
    from abc import ABC, abstractmethod

    class SupportsHMA(ABC):
        @abstractmethod
        def request_finished_all_groups(self, request, block_ids): ...

    class KVConnectorBase_V1(ABC):
        def __init__(self, vllm_config, role, kv_cache_config=None): ...
        @property
        def requires_kv_delivery(self): ...
        @abstractmethod
        def start_load_kv(self, forward_context, **kwargs): ...
        @abstractmethod
        def wait_for_save(self): ...
        def get_finished(self, finished_req_ids): ...
        @classmethod
        def build_kv_connector_stats(cls, data=None): ...
        def shutdown(self, *, timeout_s=None): ...
''')

GOOD = dedent('''
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, SupportsHMA

    class KVTierConnector(KVConnectorBase_V1, SupportsHMA):
        def __init__(self, vllm_config, role, kv_cache_config=None, extra=0): ...
        @property
        def requires_kv_delivery(self): ...
        def request_finished_all_groups(self, request, block_ids): ...
        def start_load_kv(self, forward_context, **kwargs): ...
        def wait_for_save(self): ...
        def get_finished(self, finished_req_ids, **kwargs): ...
        @classmethod
        def build_kv_connector_stats(cls, data=None): ...
        def shutdown(self, *, timeout_s=None): ...
        def _helper(self, anything): ...
''')


def case(old: str, new: str, expected: str) -> object:
    """GOOD with `old` replaced by `new`, and the problem the check must report."""
    assert old in GOOD
    return pytest.param(GOOD.replace(old, new), expected, id=expected.partition(",")[0])


def test_a_matching_connector_passes():
    # Extra trailing parameters with defaults, **kwargs and private helpers are allowed.
    assert hook_mismatches(BASE, GOOD) == []


@pytest.mark.parametrize(("source", "expected"), [
    case("    def wait_for_save(self): ...\n", "",
         "wait_for_save: abstract in vLLM, not implemented"),
    case("    def request_finished_all_groups(self, request, block_ids): ...\n", "",
         "request_finished_all_groups: abstract in vLLM, not implemented"),
    case("get_finished(self, finished_req_ids,", "get_finished(self, req_ids,",
         "get_finished: positional parameter 1 is 'req_ids', vLLM's is 'finished_req_ids'"),
    case("start_load_kv(self, forward_context, **kwargs)", "start_load_kv(self, ctx, **kw)",
         "start_load_kv: positional parameter 1 is 'ctx', vLLM's is 'forward_context'"),
    case("start_load_kv(self, forward_context, **kwargs)",
         "start_load_kv(self, forward_context)",
         "start_load_kv: takes no **kwargs, vLLM's takes them"),
    case("get_finished(self, finished_req_ids,", "get_finished(self, finished_req_ids, step,",
         "get_finished: adds parameter 'step' without a default"),
    case("kv_cache_config=None, extra=0", "kv_cache_config, extra=0",
         "__init__: parameter 'kv_cache_config' has no default, vLLM's has one"),
    case("    @classmethod\n    def build_kv", "    def build_kv",
         "build_kv_connector_stats: a method in kvtier, a classmethod in vLLM"),
    case("    @property\n    def requires", "    def requires",
         "requires_kv_delivery: a method in kvtier, a property in vLLM"),
    case("shutdown(self, *, timeout_s=None)", "shutdown(self)",
         "shutdown: lacks vLLM's keyword-only parameter 'timeout_s'"),
    case("import KVConnectorBase_V1,", "import KVConnectorBase_V1, KVConnectorStats,",
         "imports KVConnectorStats from vllm.distributed.kv_transfer.kv_connector.v1.base, "
         "which does not define it"),
    case("(KVConnectorBase_V1, SupportsHMA)", "(KVConnectorBase_V1, SupportsHMA2)",
         "base class SupportsHMA2 is not defined in vLLM's base module"),
    case("class KVTierConnector(", "class Renamed(", "no class KVTierConnector"),
])
def test_a_broken_connector_is_reported(source, expected):
    problems = hook_mismatches(BASE, source)

    assert any(expected in problem for problem in problems), problems


def test_a_hook_changed_by_a_release_is_reported():
    # vLLM adding a required parameter to a hook: the connector's old signature no longer fits.
    release = BASE.replace("def wait_for_save(self)", "def wait_for_save(self, step)")

    assert hook_mismatches(release, GOOD) == ["wait_for_save: lacks vLLM's positional "
                                              "parameter 'step'"]
