"""`kvtier bench sharing`'s settings, read where the command builds them (its `config_from`
and the config's `validate`, on the real parser); nothing runs."""

from __future__ import annotations

import pytest

from kvtier.errors import ConfigError
from kvtier.tools.cli import bench_sharing
from kvtier.tools.cli.main import build_parser

URL = "redis://bench:secret@127.0.0.1:6390/0"


def _validated(*argv: str) -> bench_sharing.SharingConfig:
    config = bench_sharing.config_from(build_parser().parse_args(["bench", "sharing", *argv]))
    config.validate()
    return config


@pytest.mark.parametrize("sources", [["node"], ["shared", "node"]])
def test_a_redis_url_without_the_redis_source_is_refused_not_dropped(sources: list[str]) -> None:
    """`--source node --redis-url URL` ran no Redis at all and said nothing of the URL."""
    argv = [arg for source in sources for arg in ("--source", source)]
    with pytest.raises(ConfigError) as refused:
        _validated(*argv, "--redis-url", URL)
    assert refused.value.field == "redis_url" and "--source redis" in str(refused.value)
    assert "secret" not in str(refused.value)


def test_a_redis_url_with_the_redis_source_or_every_source_is_taken() -> None:
    assert _validated("--source", "redis", "--redis-url", URL).redis_url == URL
    assert _validated("--redis-url", URL).sources == ("shared", "redis", "node")
