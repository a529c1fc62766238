"""The workload generator: seeded, prefix-structured, at the configured rate."""

from __future__ import annotations

from itertools import pairwise

import pytest

from kvtier.errors import ConfigError
from kvtier.tools.sim.workload import WorkloadConfig, generate, workload_preset

BT = 16


def _requests(cfg: WorkloadConfig, n: int = 2000, seed: int = 1) -> list:
    return list(generate(cfg, n, BT, seed))


def test_same_seed_same_traffic_other_seed_other_traffic() -> None:
    cfg = workload_preset("chat")
    a, b, c = _requests(cfg), _requests(cfg), _requests(cfg, seed=2)
    key = [(r.arrival_s, r.prompt_tokens, r.output_tokens, r.hashes[:r.n_full_blocks])
           for r in a]
    assert key == [(r.arrival_s, r.prompt_tokens, r.output_tokens, r.hashes[:r.n_full_blocks])
                   for r in b]
    assert key != [(r.arrival_s, r.prompt_tokens, r.output_tokens,
                    r.hashes[:r.n_full_blocks]) for r in c]


def test_arrivals_are_ordered_and_at_the_configured_rate() -> None:
    reqs = _requests(workload_preset("chat", rate_rps=20.0, think_s=2.0), n=20_000)
    times = [r.arrival_s for r in reqs]
    assert times == sorted(times)
    rate = len(reqs) / times[-1]
    assert 17.0 < rate < 23.0


def test_a_later_turn_extends_the_whole_previous_turn() -> None:
    # Turn k+1's prompt is turn k's prompt plus its reply plus a new message, so the block
    # hashes of turn k's full sequence (prompt and output) must be a prefix of turn k+1's.
    by_session: dict[int, list] = {}
    for r in generate(workload_preset("chat", turns_mean=5.0), 2000, BT, 1):
        snapshot = list(r.hashes[:r.n_full_blocks])  # taken before later turns append
        assert r.n_full_blocks == (r.prompt_tokens + r.output_tokens) // BT
        by_session.setdefault(r.session, []).append((r, snapshot))
    checked = 0
    for turns in by_session.values():
        for (prev, prev_hashes), (nxt, nxt_hashes) in pairwise(turns):
            assert nxt.prompt_tokens > prev.prompt_tokens + prev.output_tokens
            assert nxt_hashes[:len(prev_hashes)] == prev_hashes
            checked += 1
    assert checked > 500


def test_sessions_share_exactly_the_system_prompt_blocks() -> None:
    cfg = workload_preset("chat", system_prompts=1, system_tokens=10 * BT + 5, turns_mean=1.0)
    reqs = _requests(cfg, n=200)
    firsts = {tuple(r.hashes[:10]) for r in reqs}
    assert len(firsts) == 1  # the 10 full system-prompt blocks are shared by all sessions
    elevenths = [r.hashes[10] for r in reqs]  # mixes the system prompt with the message
    assert len(set(elevenths)) == len(elevenths)


def test_unique_workload_shares_no_block() -> None:
    reqs = _requests(workload_preset("unique"), n=3000)
    seen: set[int] = set()
    total = 0
    for r in reqs:
        blocks = r.hashes[:r.n_full_blocks]
        seen.update(blocks)
        total += len(blocks)
    assert total > 10_000 and len(seen) == total


def test_popular_documents_repeat() -> None:
    reqs = _requests(workload_preset("rag"), n=3000)
    heads = [r.hashes[30] for r in reqs if r.n_full_blocks > 30]
    assert len(set(heads)) < 0.7 * len(heads)


@pytest.mark.parametrize("field,value", [
    ("rate_rps", 0.0), ("turns_mean", 0.5), ("doc_prob", 1.5), ("output_tokens", 0),
    ("system_tokens", -1), ("max_context", 100),
])
def test_invalid_workload_raises_config_error(field: str, value: float) -> None:
    with pytest.raises(ConfigError) as info:
        workload_preset("chat", **{field: value})
    assert field in info.value.field


def test_unknown_preset() -> None:
    with pytest.raises(ConfigError):
        workload_preset("nope")
