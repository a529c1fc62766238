"""Two S3 clients on chunk-sized objects against the same server: boto3 (the s3 tier's
client) and obstore (a binding of the Rust `object_store` crate), the measurement behind the
s3 tier's choice of client (docs/performance.md, "The s3 tier").

    pip install obstore 'moto[server]'
    python -m kvtier.tools.bench.s3_clients [--sizes 0.25,2,8] [--total-mib 64] [--threads 8]

A private moto server (an S3 emulator) is started on 127.0.0.1, unless KVTIER_BENCH_S3_ENDPOINT
and KVTIER_BENCH_S3_BUCKET name an endpoint (credentials from the environment). For each size
it PUTs then GETs `total-mib` of objects, one client after the other, on one thread and on
`threads`; then times 100 HEADs. Figures: GB/s (1e9 B/s) and ms per object.

Primitives: `main`.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from kvtier.tools.bench.s3_baseline import local_s3

MIB = 1024**2


def _clients(url: str, bucket: str, threads: int) -> dict[str, tuple[Callable[..., Any], ...]]:
    import boto3
    from botocore.config import Config

    try:
        import obstore
        from obstore.store import S3Store
    except ImportError as exc:
        raise SystemExit("pip install obstore (the Rust-backed client compared)") from exc
    boto = boto3.client("s3", endpoint_url=url, region_name="us-east-1", config=Config(
        s3={"addressing_style": "path"}, max_pool_connections=max(10, threads),
        retries={"total_max_attempts": 1}))
    store = S3Store(bucket, endpoint=url, region="us-east-1", virtual_hosted_style_request=False,
                    access_key_id=os.environ["AWS_ACCESS_KEY_ID"],
                    secret_access_key=os.environ["AWS_SECRET_ACCESS_KEY"],
                    client_options={"allow_http": True})
    return {
        "boto3": (lambda k, d: boto.put_object(Bucket=bucket, Key=k, Body=d),
                  lambda k: boto.get_object(Bucket=bucket, Key=k)["Body"].read(),
                  lambda k: boto.head_object(Bucket=bucket, Key=k)),
        "obstore": (lambda k, d: obstore.put(store, k, d),
                    lambda k: bytes(obstore.get(store, k).bytes()),
                    lambda k: obstore.head(store, k)),
    }


def _timed(pool: ThreadPoolExecutor | None, body: Callable[[int], Any], n: int) -> float:
    start = time.perf_counter()
    if pool is None:
        for i in range(n):
            body(i)
    else:
        list(pool.map(body, range(n)))
    return time.perf_counter() - start


def _bind(call: Callable[..., Any], keys: list[str], *args: Any) -> Callable[[int], Any]:
    """i -> call(keys[i], *args)."""
    return lambda i: call(keys[i], *args)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="0.25,2,8", help="object sizes in MiB")
    parser.add_argument("--total-mib", type=int, default=64, help="MiB moved per point")
    parser.add_argument("--threads", type=int, default=8, help="threads of the parallel rows")
    args = parser.parse_args(argv)
    with local_s3() as (url, bucket), ThreadPoolExecutor(args.threads) as pool:
        clients = _clients(url, bucket, args.threads)
        print(f"{'client':8} {'size':>8} {'threads':>7} {'put GB/s':>9} {'ms/obj':>7} "
              f"{'get GB/s':>9} {'ms/obj':>7}")
        for size in (int(float(s) * MIB) for s in args.sizes.split(",")):
            data = os.urandom(size)
            n = max(4, args.total_mib * MIB // size)
            for threads, runner in ((1, None), (args.threads, pool)):
                for name, (put, get, _head) in clients.items():
                    keys = [f"clients/{name}/{size}/{threads}/{i}" for i in range(n)]
                    put(keys[0], data)
                    get(keys[0])  # warm the connection
                    put_s = _timed(runner, _bind(put, keys, data), n)
                    get_s = _timed(runner, _bind(get, keys), n)
                    print(f"{name:8} {size / MIB:>6g}Mi {threads:>7} "
                          f"{n * size / put_s / 1e9:>9.3f} {put_s / n * 1e3 * threads:>7.1f} "
                          f"{n * size / get_s / 1e9:>9.3f} {get_s / n * 1e3 * threads:>7.1f}")
        clients["boto3"][0]("clients/head", b"x")
        for name, (_put, _get, head) in clients.items():
            seconds = _timed(None, _bind(head, ["clients/head"] * 100), 100)
            print(f"{name:8} HEAD: {seconds / 100 * 1e3:.2f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
