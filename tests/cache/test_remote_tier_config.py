"""The redis and s3 tiers' settings are checked when the store config is parsed. A value the
tier cannot use (a TTL that overflows, a URL that redis-py or botocore refuses on first use,
a setting another one silently overrides) is a ConfigError that names the field, echoes the
value and says what is allowed: never a raw exception later, in a worker, nor a setting
quietly ignored."""

from __future__ import annotations

from typing import Any

import pytest

from kvtier.errors import ConfigError
from kvtier.tiers.storeconfig import StoreConfig

INF, NAN = float("inf"), float("nan")
YEAR_S = 365 * 24 * 3600


def _redis(**fields: Any) -> dict[str, Any]:
    return {"kind": "redis", "capacity": 0, **fields}


def _s3(**fields: Any) -> dict[str, Any]:
    return {"kind": "s3", "bucket": "kvtier-test", **fields}


@pytest.mark.parametrize("tier, field, value, allowed", [
    # int(inf * 1000) raised OverflowError when the tier was built; 0.1 ms became no TTL
    (_redis(ttl_s=INF), "redis.ttl_s", INF, "365 days"),
    (_redis(ttl_s=NAN), "redis.ttl_s", NAN, "365 days"),
    (_redis(ttl_s=0.0001), "redis.ttl_s", 0.0001, "1 ms"),
    (_redis(ttl_s=0), "redis.ttl_s", 0, "null"),
    (_redis(ttl_s=YEAR_S + 1), "redis.ttl_s", YEAR_S + 1, "365 days"),
    # 1e15 ms raised OverflowError from socket.settimeout on the tier's first call, which the
    # tier's error handling did not catch; .inf grew the backoff without end
    (_redis(socket_timeout_ms=10**15), "redis.socket_timeout_ms", 10**15, "less than or equal"),
    (_redis(connect_timeout_ms=10**15), "redis.connect_timeout_ms", 10**15,
     "less than or equal"),
    (_redis(retry_max_s=INF), "redis.retry_max_s", INF, "less than or equal to 3600"),
    # a lookup's budget: its own reply deadline, within a minute
    (_redis(lookup_timeout_ms=0), "redis.lookup_timeout_ms", 0, "greater than or equal to 1"),
    (_redis(lookup_timeout_ms=60_001), "redis.lookup_timeout_ms", 60_001,
     "less than or equal to 60000"),
    (_s3(retry_max_s=INF), "s3.retry_max_s", INF, "less than or equal to 3600"),
    # a part larger than Redis takes in one value: every store of a chunk that large failed
    (_redis(part_bytes="1GiB"), "redis.part_bytes", "1GiB", "1 KiB to 512 MiB"),
    # redis-py raised ValueError on first use, or took the bad part for its default
    (_redis(url="redis://127.0.0.1:notaport/0"), "redis.url", "redis://127.0.0.1:notaport/0",
     "a port from 1 to 65535"),
    (_redis(url="redis://127.0.0.1:99999/0"), "redis.url", "redis://127.0.0.1:99999/0",
     "a port from 1 to 65535"),
    (_redis(url="redis://127.0.0.1:0/0"), "redis.url", "redis://127.0.0.1:0/0",
     "a port from 1 to 65535"),
    (_redis(url="redis://127.0.0.1:1/abc"), "redis.url", "redis://127.0.0.1:1/abc",
     "a database number >= 0"),
    (_redis(url="redis://127.0.0.1:1/-1"), "redis.url", "redis://127.0.0.1:1/-1",
     "a database number >= 0"),
    (_redis(url="redis://127.0.0.1:1?db=-1"), "redis.url", "redis://127.0.0.1:1?db=-1",
     "a database number >= 0"),
    (_redis(url="redis://127.0.0.1:1?db=x"), "redis.url", "redis://127.0.0.1:1?db=x",
     "'db'"),
    # redis-py let a query option override the tier's own timeouts and TLS checks, and
    # raised on first use for one it does not know
    (_redis(url="redis://127.0.0.1:1/0?socket_timeout=30"), "redis.url",
     "redis://127.0.0.1:1/0?socket_timeout=30", "no query option but db (found: socket_timeout)"),
    (_redis(url="rediss://cache:6380/0?ssl_cert_reqs=none&db=1"), "redis.url",
     "rediss://cache:6380/0?ssl_cert_reqs=none&db=1", "(found: ssl_cert_reqs)"),
    (_redis(url="redis://127.0.0.1:1/0?foo"), "redis.url", "redis://127.0.0.1:1/0?foo",
     "(found: foo)"),
    # redis-py took localhost for an empty host (a template's unset variable), ?db= over the
    # path's database, the URL's user over `username`: each silently
    (_redis(url="redis://:6379/0"), "redis.url", "redis://:6379/0", "a host"),
    (_redis(url="redis://cache:6379/1?db=3"), "redis.url", "redis://cache:6379/1?db=3",
     "one database"),
    (_redis(url="redis://kvcache@cache:6379/0", username="other"), "redis.username", "other",
     "not two different users"),
    (_redis(cluster_nodes=["10.0.0.1:0"]), "redis.cluster_nodes", ["10.0.0.1:0"],
     "a port from 1 to 65535"),
    (_redis(cluster_nodes=["10.0.0.1:6379", "10.0.0.2:99999"]), "redis.cluster_nodes",
     ["10.0.0.1:6379", "10.0.0.2:99999"], "a port from 1 to 65535"),
    # S3's naming rules: only the length and '/' were checked
    (_s3(bucket="My_Bucket!"), "s3.bucket", "My_Bucket!", "letters, digits"),
    (_s3(bucket="bucket name"), "s3.bucket", "bucket name", "letters, digits"),
    (_s3(bucket="-bucket"), "s3.bucket", "-bucket", "beginning and ending with a letter"),
    (_s3(bucket="bucket."), "s3.bucket", "bucket.", "beginning and ending with a letter"),
    (_s3(bucket="kv..cache"), "s3.bucket", "kv..cache", "never two in a row"),
    (_s3(bucket="ab"), "s3.bucket", "ab", "3 to 63 characters"),
    (_s3(endpoint_url="https://minio:notaport"), "s3.endpoint_url", "https://minio:notaport",
     "a port from 1 to 65535"),
    (_s3(endpoint_url="https://minio:99999"), "s3.endpoint_url", "https://minio:99999",
     "a port from 1 to 65535"),
    (_s3(endpoint_url="http://minio:0"), "s3.endpoint_url", "http://minio:0",
     "a port from 1 to 65535"),
    (_s3(region=""), "s3.region", "", "us-east-1"),
    # A setting another one left unused is named: the tier reaches a cluster through
    # cluster_nodes alone (the url was ignored)
    (_redis(url="redis://10.0.0.1:6379/0", cluster_nodes=["10.0.0.2:6379"]), "redis.url",
     "redis://10.0.0.1:6379/0", "url or cluster_nodes, not both"),
    # password_env was read only without password_file (as the encryption secret's sources)
    (_redis(password_file="/etc/kvtier/redis-password", password_env="REDIS_PW"),
     "redis.password_env", "REDIS_PW", "password_file or password_env, not both"),
    # "" fell back to KVTIER_REDIS_PASSWORD / REDIS_PASSWORD, silently
    (_redis(password_env=""), "redis.password_env", "", "the name of an environment variable"),
    (_redis(password_env="REDIS PW"), "redis.password_env", "REDIS PW",
     "the name of an environment variable"),
    # the CA of a clear-text endpoint verifies nothing (the redis tier refuses the same)
    (_s3(endpoint_url="http://minio:9000", tls_ca_file="/etc/kvtier/ca.pem"), "s3.tls_ca_file",
     "/etc/kvtier/ca.pem", "use an https:// endpoint_url"),
])
def test_every_bad_remote_tier_value_names_field_value_and_what_is_allowed(
    tier: dict[str, Any], field: str, value: object, allowed: str,
) -> None:
    with pytest.raises(ConfigError) as caught:
        StoreConfig.parse({"tiers": [tier]}, where="kvtier.yaml")
    error = caught.value
    assert error.field == f"kvtier.yaml.tiers.0.{field}"
    assert repr(error.value) == repr(value)  # repr: NaN equals nothing, not even itself
    assert allowed in error.allowed
    assert error.field in str(error) and repr(error.value) in str(error)


@pytest.mark.parametrize("tier", [
    _redis(),
    _redis(url="redis://127.0.0.1:6379/0", ttl_s=0.001),
    _redis(url="rediss://cache.internal/3", ttl_s=YEAR_S),
    _redis(url="redis://[::1]:6379", ttl_s=None),
    _redis(url="redis://kvcache@127.0.0.1:6379/0/"),  # an ACL user, no password
    _redis(url="redis://127.0.0.1:6379?db=2"),
    _redis(url="redis://127.0.0.1:6379/2?db=2"),  # the same database twice
    _redis(url="redis://kvcache@127.0.0.1:6379/0", username="kvcache"),
    _redis(cluster_nodes=["10.0.0.1:1", "10.0.0.2:65535"], tls=True),
    _redis(password_env="REDIS_PW"),
    _s3(),
    _s3(bucket="kv.cache-01", region="eu-west-3"),
    _s3(bucket="a" * 63, endpoint_url="http://127.0.0.1:9000"),
    _s3(bucket="Legacy_Bucket"),  # us-east-1's names before 2018, and GCS's
    _s3(endpoint_url="https://minio.internal:9000", tls_ca_file="/etc/kvtier/ca.pem"),
    _s3(tls_ca_file="/etc/kvtier/ca.pem"),  # AWS's endpoint: https
])
def test_the_forms_operators_use_still_parse(tier: dict[str, Any]) -> None:
    [parsed] = StoreConfig.parse({"tiers": [tier]}).tiers
    assert parsed.kind == tier["kind"]
