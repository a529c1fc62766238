"""A configuration named twice on a bench's command line runs once: `kvtier bench interference
--config vllm --config vllm` started two vLLM servers of the same configuration (minutes
each on a CPU), their figures side by side under one name. `bench storage --tier` and `bench
clients --client` always kept each once; the benches that start engines did not.

Each bench's settings are read where the command builds them (its `config_from`, on the
real parser); nothing runs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvtier.errors import ConfigError
from kvtier.tools.cli import (
    bench_copy,
    bench_disagg,
    bench_fleet,
    bench_interference,
    bench_link,
    bench_pooling,
    bench_sharing,
    bench_ttft,
)
from kvtier.tools.cli.main import build_parser


def _settings(workload: str, argv: list[str]) -> Any:
    args = build_parser().parse_args(["bench", workload, *argv])
    if workload == "pooling":
        return bench_pooling.config_from(args, Path("/scratch"))
    module = {"copy": bench_copy, "disagg": bench_disagg, "fleet": bench_fleet,
              "interference": bench_interference, "link": bench_link, "sharing": bench_sharing,
              "ttft": bench_ttft}[workload]
    return module.config_from(args)


@pytest.mark.parametrize(("workload", "option", "first", "second", "field"), [
    ("interference", "--config", "vllm", "kvtier-async", "configs"),
    ("disagg", "--setup", "single", "disagg", "setups"),
    ("link", "--config", "rule", "always", "configs"),
    ("pooling", "--config", "node", "private", "configs"),
    ("sharing", "--source", "redis", "shared", "sources"),
    ("ttft", "--engine", "recompute", "kvtier-disk", "engines"),
])
def test_a_configuration_named_twice_runs_once_in_the_order_first_given(
        workload: str, option: str, first: str, second: str, field: str) -> None:
    argv = [option, first, option, second, option, first]
    assert tuple(getattr(_settings(workload, argv), field)) == (first, second)


@pytest.mark.parametrize(("workload", "argv", "field"), [
    ("ttft", ["--tokens", "1024,4096,1024"], "cached_tokens"),
    ("sharing", ["--tokens", "1024,1024"], "cached_tokens"),
    ("link", ["--gbps", "8,2,8"], "gbps"),
    ("fleet", ["--chunks", "1000", "1000"], "chunks"),
    ("fleet", ["--writers", "4", "1", "4"], "writers"),
    ("copy", ["--device", "cpu", "--chunk-mib", "2,4,2"], "chunk_mib"),
])
def test_a_length_or_speed_given_twice_is_refused(workload: str, argv: list[str],
                                                  field: str) -> None:
    """`bench ttft --tokens 1024,1024` measured the same prompt length twice (its second
    prompt, the same as the first, already stored), two rows under one length; `bench link
    --gbps 8,8` re-ran a link speed, `bench fleet --writers 4 4` a run of the writers,
    `bench copy --chunk-mib 2,2` a chunk size.
    Refused, as `bench disk-load --chunks 4,4` is."""
    with pytest.raises(ConfigError) as refused:
        _settings(workload, argv).validate()
    assert refused.value.field == field and "once" in refused.value.allowed
