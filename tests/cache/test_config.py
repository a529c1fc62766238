"""Config is validated once, at the edge; every mistake is a ConfigError that names the
field, echoes the value and says what is allowed."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from kvtier.errors import ConfigError
from kvtier.tiers.files.disk import DiskTierConfig
from kvtier.tiers.files.shared import SharedTierConfig
from kvtier.tiers.memory import MemoryTierConfig
from kvtier.tiers.storeconfig import StoreConfig
from kvtier.units import format_size, parse_size

# The README's example; its paths are rooted in the test's temp dir, because a path is
# checked when the config is validated (tests/cache/test_tier_paths.py).
GOOD_YAML = """\
tiers:
  - {{kind: memory, capacity: 8GiB}}
  - {{kind: disk, path: {root}/mnt/nvme/kvtier, capacity: 200GiB, eviction: arc, admit_after: 2}}
  - {{kind: shared, path: {root}/mnt/shared/kvtier, capacity: 2TiB}}
write_queue_depth: 16
"""
X = "/tmp/kvtier-test"  # a creatable path, for tests of other fields of a file tier


def _memory(**fields: Any) -> dict[str, Any]:
    return {"tiers": [{"kind": "memory", "capacity": "1GiB", **fields}]}


def test_the_documented_yaml_example_loads_into_typed_tiers(tmp_path: Path) -> None:
    """An operator writes the README's YAML; it loads into typed, frozen tier configs."""
    path = tmp_path / "kvtier.yaml"
    path.write_text(GOOD_YAML.format(root=tmp_path))
    config = StoreConfig.load(path)
    memory, disk, shared = config.tiers
    assert isinstance(memory, MemoryTierConfig) and memory.capacity == 8 * 2**30
    assert isinstance(disk, DiskTierConfig) and disk.path == tmp_path / "mnt/nvme/kvtier"
    assert disk.eviction == "arc" and disk.admit_after == 2 and disk.capacity == 200 * 2**30
    assert isinstance(shared, SharedTierConfig) and shared.capacity == 2 * 2**40
    assert [t.tier_name for t in config.tiers] == ["memory", "disk", "shared"]
    assert config.write_queue_depth == 16
    with pytest.raises(ValidationError, match="frozen"):
        memory.capacity = 1  # type: ignore[misc]


def test_json_loads_the_same_config_as_yaml(tmp_path: Path) -> None:
    yaml_path, json_path = tmp_path / "a.yaml", tmp_path / "a.json"
    yaml_path.write_text(GOOD_YAML.format(root=tmp_path))
    json_path.write_text(json.dumps(StoreConfig.load(yaml_path).model_dump(mode="json")))
    assert StoreConfig.load(json_path) == StoreConfig.load(yaml_path)


@pytest.mark.parametrize("text, expected", [
    ("8GiB", 8 * 2**30), ("512 MiB", 512 * 2**20), ("1.5GB", 1_500_000_000), ("4096", 4096),
    ("2tib", 2 * 2**40), ("10KB", 10_000), (123, 123), ("0", 0),
])
def test_sizes_accept_human_units(text: str | int, expected: int) -> None:
    assert parse_size(text) == expected
    assert StoreConfig.parse(_memory(capacity=text)).tiers[0].capacity == expected


def test_format_size_is_binary_and_readable() -> None:
    assert format_size(1536) == "1.5 KiB" and format_size(100) == "100 B"
    assert format_size(8 * 2**30) == "8.0 GiB"


@pytest.mark.parametrize("config, field, value, allowed", [
    (_memory(capacity="8 bananas"), "tiers.0.memory.capacity", "8 bananas", "GiB"),
    (_memory(capacity="-1GiB"), "tiers.0.memory.capacity", "-1GiB", "must not be negative"),
    (_memory(capacity=-5), "tiers.0.memory.capacity", -5, "negative"),
    (_memory(capacity=True), "tiers.0.memory.capacity", True, "8GiB"),
    (_memory(capacity=float("inf")), "tiers.0.memory.capacity", float("inf"), "GiB"),
    (_memory(eviction="fifo"), "tiers.0.memory.eviction", "fifo", "lru"),
    (_memory(admit_after=0), "tiers.0.memory.admit_after", 0, "1"),
    (_memory(pin="maybe"), "tiers.0.memory.pin", "maybe", "auto"),
    ({"tiers": [{"kind": "nvme", "capacity": 1}]}, "tiers.0.kind", "nvme", "shared"),
    ({"tiers": [{"capacity": 1}]}, "tiers.0.kind", None, "memory"),
    ({"tiers": [{"kind": "disk", "capacity": 1, "path": X, "io_threads": 0}]},
     "tiers.0.disk.io_threads", 0, "1"),
    ({"tiers": [{"kind": "disk", "capacity": 1, "path": X, "o_direct": "yes"}]},
     "tiers.0.disk.o_direct", "yes", "auto"),
    ({"tiers": [{"kind": "shared", "capacity": 1, "path": X, "scan_interval_s": 0}]},
     "tiers.0.shared.scan_interval_s", 0, "0"),
    # accepted and ignored before: its quota evicts by last use only
    ({"tiers": [{"kind": "shared", "capacity": 1, "path": X, "eviction": "arc"}]},
     "tiers.0.shared.eviction", "arc", "lru"),
    ({"tiers": []}, "tiers", [], "at least 1"),
    ({**_memory(), "write_queue_depth": 0}, "write_queue_depth", 0, "1"),
    ({**_memory(), "io_threads": 1000}, "io_threads", 1000, "64"),
    # true or false for a number: pydantic took `ttl_s: true` as a TTL of 1 s
    (_memory(ttl_s=True), "tiers.0.memory.ttl_s", True, "a number, not true or false"),
    ({**_memory(), "write_queue_depth": True}, "write_queue_depth", True, "not true or false"),
    (_memory(tenant_quota={"share": True}), "tiers.0.memory.tenant_quota.share", True,
     "not true or false"),
])
def test_every_bad_value_names_field_value_and_what_is_allowed(
    config: dict[str, Any], field: str, value: object, allowed: str,
) -> None:
    """Each of these is a real typo or misunderstanding; the error must say where, what was
    given and what would have been accepted - not a pydantic traceback or an OverflowError."""
    with pytest.raises(ConfigError) as caught:
        StoreConfig.parse(config, where="kvtier.yaml")
    error = caught.value
    assert error.field == f"kvtier.yaml.{field}"
    assert error.value == value or (value is None and error.value is None)
    assert allowed in error.allowed
    assert error.field in str(error) and repr(error.value) in str(error)


def test_a_missing_required_field_is_named() -> None:
    """A disk tier without a path: the error names `path`."""
    with pytest.raises(ConfigError) as caught:
        StoreConfig.parse({"tiers": [{"kind": "disk", "capacity": "1GiB"}]})
    assert caught.value.field == "config.tiers.0.disk.path"
    assert "required" in caught.value.allowed.lower()


def test_an_unknown_field_is_rejected_and_the_known_ones_listed() -> None:
    """A misspelt option (`capcity`) must not be silently ignored (the tier would run with
    a default the operator never chose): the error lists the fields that exist."""
    with pytest.raises(ConfigError) as caught:
        StoreConfig.parse({"tiers": [{"kind": "disk", "path": X, "capacity": 1,
                                      "capcity": "9GiB"}]})
    assert caught.value.field == "config.tiers.0.disk.capcity"
    assert caught.value.value == "9GiB"
    assert "capacity" in caught.value.allowed and "o_direct" in caught.value.allowed
    with pytest.raises(ConfigError) as caught:
        StoreConfig.parse({**_memory(), "write_depth": 3})
    assert caught.value.field == "config.write_depth"
    assert "write_queue_depth" in caught.value.allowed


def test_a_typo_in_a_nested_mapping_lists_that_mappings_fields() -> None:
    """`tenant_quota: {shares: 0.5}` listed the memory tier's fields, not `share` and `cap`."""
    with pytest.raises(ConfigError) as caught:
        StoreConfig.parse(_memory(tenant_quota={"shares": 0.5}))
    assert caught.value.field == "config.tiers.0.memory.tenant_quota.shares"
    assert caught.value.allowed == "unknown field; allowed fields: cap, share"



def test_a_typo_lists_no_field_that_is_always_refused() -> None:
    """The fields that exist only to be refused (a secret inline: `encryption_secret`, an s3
    tier's `access_key_id`...) were listed as allowed beside a typo's error: an operator who
    took the list at its word was refused next."""
    def listed(tier: dict[str, Any]) -> set[str]:
        with pytest.raises(ConfigError) as caught:
            StoreConfig.parse({"tiers": [{"kind": "memory", "capacity": "1GiB"}, tier]})
        return set(caught.value.allowed.split("allowed fields: ", 1)[1].split(", "))

    shared = listed({"kind": "shared", "path": "/tmp/kvtier-typo", "capacity": "1GiB",
                     "codecc": "zstd"})
    assert "encryption_secret_file" in shared and "encryption_secret" not in shared
    s3 = listed({"kind": "s3", "bucket": "kv-cache", "region": "us-east-1", "regon": "x"})
    assert "endpoint_url" in s3 and "credentials_file" in s3
    assert not s3 & {"access_key_id", "secret_access_key", "aws_access_key_id",
                     "encryption_secret"}


def test_a_ram_tier_behind_a_slower_one_is_refused() -> None:
    """Tiers go fastest first: a disk tier first made every store wait for the disk, and the
    RAM behind it held only what the disk already did."""
    with pytest.raises(ConfigError) as caught:
        StoreConfig.parse({"tiers": [{"kind": "disk", "path": X, "capacity": "1GiB"},
                                     {"kind": "memory", "capacity": "1GiB"}]})
    assert caught.value.field == "config.tiers"
    assert "RAM first" in caught.value.allowed
    StoreConfig.parse({"tiers": [{"kind": "disk", "path": X, "capacity": "1GiB"}]})  # alone


def test_two_tiers_with_one_name_are_rejected_naming_the_name() -> None:
    """Two memory tiers without names would both be called "memory": stats and logs could
    not tell them apart. Naming them apart fixes it."""
    twice = {"tiers": [{"kind": "memory", "capacity": 1}, {"kind": "memory", "capacity": 2}]}
    with pytest.raises(ConfigError) as caught:
        StoreConfig.parse(twice)
    assert caught.value.field == "config.tiers"
    assert "'memory'" in caught.value.allowed and "twice" in caught.value.allowed
    named = {"tiers": [{"kind": "memory", "capacity": 1, "name": "hot"},
                       {"kind": "memory", "capacity": 2, "name": "warm"}]}
    assert [t.tier_name for t in StoreConfig.parse(named).tiers] == ["hot", "warm"]


def test_unreadable_or_malformed_files_are_config_errors(tmp_path: Path) -> None:
    """A missing file, broken YAML or broken JSON: ConfigError naming the file."""
    broken_yaml, broken_json = tmp_path / "bad.yaml", tmp_path / "bad.json"
    broken_yaml.write_text("tiers: [ {kind: memory")
    broken_json.write_text("{not json")
    for path in (tmp_path / "missing.yaml", broken_yaml, broken_json):
        with pytest.raises(ConfigError) as caught:
            StoreConfig.load(path)
        assert caught.value.value == str(path)


def test_a_file_that_is_not_a_mapping_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "list.yaml"
    path.write_text("- memory\n- disk\n")
    with pytest.raises(ConfigError) as caught:
        StoreConfig.load(path)
    assert caught.value.field == str(path)
    assert "dictionary" in caught.value.allowed


def test_a_redis_ca_file_without_tls_is_refused() -> None:
    """A CA bundle with a plain redis:// URL would leave the connection in clear text."""
    with pytest.raises(ConfigError, match="tls_ca_file"):
        StoreConfig.parse({"tiers": [{"kind": "redis", "capacity": 0, "tls_ca_file": "/ca.pem"}]})
    tls = StoreConfig.parse({"tiers": [{"kind": "redis", "capacity": 0, "tls": True,
                                        "tls_ca_file": "/ca.pem"}]})
    assert str(tls.tiers[0].tls_ca_file) == "/ca.pem"
