"""kvtier.redaction: where a URL holds a credential, and the same URL or text masked."""

from __future__ import annotations

import pytest

from kvtier.errors import ConfigError
from kvtier.redaction import redact, redact_text, redact_value, url_credentials


@pytest.mark.parametrize("url, masked, found", [
    ("redis://:pw@h:6379/0", "redis://:***@h:6379/0", ["a password in the userinfo"]),
    ("redis://user:pw@h/0", "redis://user:***@h/0", ["a password in the userinfo"]),
    ("redis://h/0?password=pw&db=1", "redis://h/0?password=***&db=1",
     ["query parameter 'password'"]),
    ("rediss://h/0?Auth_Token=pw#secret=x", "rediss://h/0?Auth_Token=***#secret=***",
     ["query parameter 'Auth_Token'", "fragment parameter 'secret'"]),
    ("redis://h/0?pass%77ord=pw", "redis://h/0?pass%77ord=***",
     ["query parameter 'password'"]),
    ("redis://user@h:6379/0?db=1", "redis://user@h:6379/0?db=1", []),  # a user is no secret
])
def test_credentials_are_found_and_masked(url: str, masked: str, found: list[str]) -> None:
    assert redact(url) == masked
    assert url_credentials(url) == found
    assert url_credentials(masked) == found  # still a refused URL once masked


def test_text_and_nested_values_are_masked() -> None:
    text = """--kv-transfer-config '{"url":"redis://:pw@h:1/0"}' node a:pw@h:1"""
    assert redact_text(text) == (
        """--kv-transfer-config '{"url":"redis://:***@h:1/0"}' node a:***@h:1""")
    value = {"tiers": [{"url": "redis://u:pw@h"}, ("x:pw@h:1",)], "n": 3}
    assert redact_value(value) == {"tiers": [{"url": "redis://u:***@h"}, ("x:***@h:1",)], "n": 3}


def test_a_topic_with_at_signs_is_no_credential() -> None:
    """llm-d's pool topic read "kv@pool:***@<model>" in a config error's text."""
    text = "llm-d splits the topic kv@pool:<pool>@<model> at '@'"
    assert redact_text(text) == text


def test_a_config_error_never_shows_a_credential() -> None:
    error = ConfigError("url", "redis://:pw@h/0?token=t0k", "not redis://:pw@h/0")
    assert "pw" not in str(error) and "t0k" not in str(error)
    assert error.value == "redis://:***@h/0?token=***"
