"""docs/configuration.md against the config models: the operator's reference must name every
key the connector accepts, with the code's default, and no key it refuses; every field of
every tier kind is documented (an s3 tier's in docs/s3.md, which the reference points to),
and the tier table names no setting its kind lacks. Before this test the reference lacked the
store's own keys (`io_threads`, `read_timeout_s`, ...) and several tiers' fields (`pin`,
the redis tier's `key_prefix` and `io_threads`), and s3.md lacked `conditional_put`."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import pytest

from kvtier.integrations.vllm.config import ConnectorConfig
from kvtier.tiers.registry import config_model, public_kinds
from kvtier.tiers.storeconfig import StoreConfig

DOCS = Path(__file__).resolve().parents[2] / "docs"
REFERENCE = (DOCS / "configuration.md").read_text()
# A tier kind's fields may be documented in its own page, which the reference links to.
KIND_PAGES = {"s3": (DOCS / "s3.md").read_text()}
SNAKE = re.compile(r"`([a-z][a-z0-9]*(?:_[a-z0-9]+)+)`")


def section(text: str, heading: str) -> str:
    """The text under `## heading`, up to the next `## `."""
    return text.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]


def key_table() -> dict[str, str]:
    """The reference's table of keys: key -> its default cell."""
    rows = [line.split("|") for line in section(REFERENCE, "Every key of the extra config")
            .splitlines() if line.startswith("| `")]
    return {row[1].strip().strip("`"): row[2].strip() for row in rows}


def tier_rows() -> dict[str, str]:
    """The Tiers table: kind -> its row."""
    rows = [line for line in section(REFERENCE, "Tiers").splitlines() if line.startswith("| ")]
    return {line.split("|")[2].strip().strip("`"): line for line in rows[1:]}


def shown(value: Any) -> str:
    """A default as the reference writes it."""
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return f"`{value}`" if isinstance(value, str) else str(value)


def code_defaults() -> dict[str, Any]:
    """The default of every key with a plain default, from the models themselves."""
    defaults = {name: field.default for name, field in StoreConfig.model_fields.items()
                if name != "tiers"}
    defaults |= {f.name: f.default for f in dataclasses.fields(ConnectorConfig)
                 if f.name in ConnectorConfig.known_keys() and f.default is not None}
    return defaults


def test_the_reference_lists_exactly_the_keys_the_connector_accepts() -> None:
    assert set(key_table()) == set(ConnectorConfig.known_keys())


@pytest.mark.parametrize("key", sorted(code_defaults()))
def test_the_reference_gives_each_key_its_default(key: str) -> None:
    assert key_table()[key].startswith(shown(code_defaults()[key])), key_table()[key]


def refused(field: Any) -> bool:
    """A field that exists only to refuse a value (a secret inline, a key in the config)."""
    return field.annotation is type(None)


@pytest.mark.parametrize("kind", public_kinds())
def test_every_field_of_a_tier_kind_is_documented(kind: str) -> None:
    text = REFERENCE + KIND_PAGES.get(kind, "")
    missing = [name for name, field in config_model(kind).model_fields.items()
               if not refused(field) and f"`{name}`" not in text]
    assert not missing


@pytest.mark.parametrize("kind", public_kinds())
def test_the_tier_table_names_only_fields_of_its_kind(kind: str) -> None:
    fields = set(config_model(kind).model_fields)
    named = set(SNAKE.findall(tier_rows()[kind]))
    assert named <= fields, named - fields


def test_compression_names_every_kind_that_takes_a_codec() -> None:
    first_line = section(REFERENCE, "Compression and encryption at rest").strip().splitlines()[0]
    takes = {kind for kind in public_kinds() if "codec" in config_model(kind).model_fields}
    assert set(re.findall(r"`(\w+)`", first_line)) == takes
