"""Credentials never leak (issue 12, item 8): a Redis password put in a URL (userinfo or
query) is refused with a ConfigError that names the field and says where a password goes, and
nothing the redis tier logs (at DEBUG) ever holds the secret. What `kvtier doctor` and `kvtier
serve --dry-run` print: tests/tools/test_doctor_secrets.py.

Every test greps everything it captured for the secret.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from secretkit import SECRET, Captured
from tierkit import key

from kvtier.core.layout import KVLayout
from kvtier.errors import ConfigError
from kvtier.tiers import build_tier
from kvtier.tiers.storeconfig import StoreConfig

pytestmark = pytest.mark.redis


URLS_WITH_SECRETS = [
    f"redis://:{SECRET}@127.0.0.1:6390/0",
    f"redis://kvcache:{SECRET}@127.0.0.1:6390/0",
    f"redis://127.0.0.1:6390/0?password={SECRET}",
    f"rediss://127.0.0.1:6390/0?db=0&auth={SECRET}",
    f"redis://127.0.0.1:6390/0?access_token={SECRET}",
    f"redis://127.0.0.1:6390/0#pass={SECRET}",
]


@pytest.mark.parametrize("url", URLS_WITH_SECRETS)
def test_a_password_anywhere_in_the_url_is_refused_without_echoing_it(url: str) -> None:
    """`?password=` used to pass (only the userinfo was checked) and redis-py honours it."""
    with pytest.raises(ConfigError) as caught:
        StoreConfig.parse({"tiers": [{"kind": "redis", "capacity": 0, "url": url}]})
    error = caught.value
    assert error.field == "config.tiers.0.redis.url"
    assert "password_file" in error.allowed and "password_env" in error.allowed
    assert SECRET not in str(error) and SECRET not in repr(error.value)
    assert "***" in str(error)


def test_credentials_in_a_cluster_node_are_refused_without_echoing_them() -> None:
    with pytest.raises(ConfigError) as caught:
        StoreConfig.parse({"tiers": [{"kind": "redis", "capacity": 0,
                                      "cluster_nodes": [f"admin:{SECRET}@10.0.0.1:6379"]}]})
    assert caught.value.field == "config.tiers.0.redis.cluster_nodes"
    assert SECRET not in str(caught.value) and "password_file" in caught.value.allowed


def test_the_tier_logs_no_secret_with_a_right_or_a_wrong_password(
        secured: Any, tmp_path: Path, layout: KVLayout, captured: Captured) -> None:
    """Everything the tier logs at DEBUG, reaching the server with the right password and
    failing with a wrong one (NOAUTH, WRONGPASS), holds no secret."""
    server, password_file = secured
    wrong = tmp_path / "wrong"
    wrong.write_text("not-" + SECRET)
    wrong.chmod(0o644)  # also logs the "readable by others" warning, with the file's name
    data = memoryview(bytes(layout.bytes_per_chunk))
    for pw_file, works in ((password_file, True), (wrong, False), (None, False)):
        settings = {"kind": "redis", "capacity": "1MiB", "url": server.url,
                    "socket_timeout_ms": 500, "connect_timeout_ms": 500}
        if pw_file is not None:
            settings["password_file"] = str(pw_file)
        tier = build_tier(StoreConfig.parse({"tiers": [settings]}).tiers[0], layout)
        assert bool(tier.put(key(1), data)) is works
        assert tier.contains(key(1)) is works
        tier.close()
    text = captured.text()
    assert "readable by others" in text and "unavailable" in text.lower()
    assert SECRET not in text
