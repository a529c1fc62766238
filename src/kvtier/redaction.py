"""Credentials never printed: the one place that finds and masks them in URLs and text.

A URL can carry a secret in its userinfo (`redis://user:PASSWORD@host`) and in its query or
fragment (`?password=`, `&auth=`, `#token=`: redis-py even honours `?password=`, overriding
the password file). `url_credentials` names where a URL holds one (the redis tier refuses such
a URL); `redact` masks them. Everything kvtier prints or logs that may hold a URL goes through
`redact` or `redact_text`: `kvtier doctor`, `kvtier serve --dry-run`, ConfigError messages,
the redis tier's log lines (issue 12, item 8).

Imports nothing of kvtier (kvtier.errors uses it).

Primitives: `MASK`, `url_credentials`, `redact`, `redact_text`, `redact_value`,
`secret_field`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any
from urllib.parse import unquote, urlsplit, urlunsplit

MASK = "***"
# A query/fragment parameter whose name holds one of these carries a credential.
SECRET_WORDS = ("pass", "pwd", "auth", "token", "secret", "cred", "apikey", "api_key",
                "access_key", "private_key", "sig")
_URL = re.compile(r"[a-zA-Z][a-zA-Z0-9+.-]*://[^\s'\"<>`]+")
# "user:password@host" without a scheme (e.g. a mistyped cluster node); never right after an
# "@" (a topic such as llm-d's kv@pool:<pool>@<model> is no credential)
_BARE_USERINFO = re.compile(r"(?<![:/\w@])([\w.~%+-]*):([^\s@/'\"]+)@")


def _secret_name(name: str) -> bool:
    lowered = unquote(name).lower()
    return any(word in lowered for word in SECRET_WORDS)


def secret_field(name: object) -> bool:
    """Whether a config field named `name` would hold a credential by its name (`password`,
    `secret`, `auth`, `credentials`, `*_key`...): a config error about an unknown field of
    such a name shows MASK for its value (tests/cache/test_unknown_secret_fields.py)."""
    return isinstance(name, str) and (_secret_name(name) or "key" in name.lower())


def url_credentials(url: str) -> list[str]:
    """Where `url` carries a credential, e.g. ["a password in the userinfo",
    "query parameter 'password'"]; [] when it carries none."""
    try:
        parts = urlsplit(url)
    except ValueError:  # e.g. an unbalanced "[" in the host
        return ["an unparsable URL (it may hide a credential)"]
    password = parts.password
    found = []
    if password is not None:
        found.append("a password in the userinfo")
    for where, text in (("query", parts.query), ("fragment", parts.fragment)):
        for item in filter(None, re.split(r"[&;]", text)):
            name = item.partition("=")[0]
            if _secret_name(name):
                found.append(f"{where} parameter {unquote(name)!r}")
    return found


def _mask_params(text: str) -> str:
    items = re.split(r"([&;])", text)
    return "".join(
        f"{item.partition('=')[0]}={MASK}" if item not in ("&", ";") and _secret_name(
            item.partition("=")[0]) else item
        for item in items)


def redact(url: str) -> str:
    """`url` with every credential masked (the userinfo's password, secret-named query and
    fragment parameters); a URL too malformed to parse keeps only its scheme and host."""
    try:
        parts = urlsplit(url)
        netloc = parts.netloc
    except ValueError:
        return url.partition("://")[0] + "://" + MASK
    if "@" in netloc:
        userinfo, _, hostport = netloc.rpartition("@")
        user, colon, _password = userinfo.partition(":")
        netloc = f"{user}:{MASK}@{hostport}" if colon else netloc
    return urlunsplit((parts.scheme, netloc, parts.path, _mask_params(parts.query),
                       _mask_params(parts.fragment)))


def redact_text(text: str) -> str:
    """`text` with every URL in it redacted (`redact`), and any "user:password@" too."""
    text = _URL.sub(lambda match: redact(match.group(0)), text)
    return _BARE_USERINFO.sub(lambda match: f"{match.group(1)}:{MASK}@", text)


def redact_value(value: Any) -> Any:
    """A copy of `value` (str, or mappings/lists/tuples of them, e.g. a tier config dict)
    with every URL in every string redacted; other values unchanged."""
    if isinstance(value, str):
        return redact_text(value)
    if isinstance(value, Mapping):
        return {k: redact_value(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(redact_value(v) for v in value)
    return value
