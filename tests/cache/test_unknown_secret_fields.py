"""An unknown config field whose name says it holds a credential never has its value shown.
A config error names the field, the value and what is allowed; for an unknown field the value
was shown as given, so the natural mistakes (`password: ...` on a redis tier, `secret` or
`encryption_key` on a disk tier, `credentials` on s3, a `password` key in vLLM's
kv_connector_extra_config) printed the secret at every engine's start, into its logs.
"""

from __future__ import annotations

import pytest

from kvtier.errors import ConfigError
from kvtier.integrations.vllm.config import ConnectorConfig
from kvtier.redaction import MASK
from kvtier.tiers.storeconfig import StoreConfig

SECRET = "hunter2-0123456789abcdef0123456789"


@pytest.mark.parametrize("tier, field", [
    ({"kind": "redis", "url": "redis://localhost:6379"}, "password"),
    ({"kind": "redis", "url": "redis://localhost:6379"}, "auth"),
    ({"kind": "disk", "path": "/tmp/kvtier-x"}, "secret"),
    ({"kind": "disk", "path": "/tmp/kvtier-x"}, "encryption_key"),
    ({"kind": "s3", "bucket": "bucket"}, "credentials"),
    ({"kind": "redis", "url": "redis://localhost:6379"}, "api_token"),
])
def test_an_unknown_secret_field_of_a_tier_is_named_not_shown(tier: dict[str, str],
                                                              field: str) -> None:
    with pytest.raises(ConfigError) as refused:
        StoreConfig.parse({"tiers": [{**tier, "capacity": "1GiB", field: SECRET}]})
    assert SECRET not in str(refused.value)
    assert refused.value.field.endswith(f".{field}") and refused.value.value == MASK
    assert "unknown field" in refused.value.allowed


def test_an_unknown_secret_key_of_the_connector_is_named_not_shown() -> None:
    with pytest.raises(ConfigError) as refused:
        ConnectorConfig.parse({"tiers": [{"kind": "memory", "capacity": "1GiB"}],
                               "password": SECRET})
    assert SECRET not in str(refused.value) and refused.value.field.endswith(".password")


def test_an_unknown_field_of_another_name_still_shows_its_value() -> None:
    with pytest.raises(ConfigError) as refused:
        StoreConfig.parse({"tiers": [{"kind": "memory", "capacity": "1GiB",
                                      "evicton": "lru"}]})
    assert refused.value.value == "lru"
