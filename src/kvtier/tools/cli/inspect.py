"""`kvtier inspect --config FILE`: what each persistent tier holds, per namespace (layout
digest): the model it is the KV of and its fingerprint (from the namespace's manifest;
"unknown" without one: data of an older kvtier, or a store opened without a model), how the
tier stores chunks at rest (codec, encryption), chunks, bytes, least and most recently used.
Reads storage only; changes nothing. `--json` gives the whole fingerprint.

Exit codes: 0 listed, 1 a tier's storage could not be read, 2 bad input.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict

from rich.console import Console
from rich.table import Table

from kvtier.core.codecs import LOSSY_CODECS
from kvtier.tiers.storeconfig import StoreConfig, TierSettings
from kvtier.tools.admin.inventory import NamespaceUsage, open_inventories, read_manifests, summarize
from kvtier.tools.ops.doctor import read_store
from kvtier.units import format_size


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser("inspect", help="chunks and bytes per tier and namespace")
    p.add_argument("--config", required=True, help="kvtier store config file (YAML or JSON)")
    p.add_argument("--tier", help="only this tier (its name in the config)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=run)


def load_store(path: str) -> StoreConfig:
    """A store config file, or a connector config with a `store` section.

    Raises:
        ConfigError: unreadable or invalid.
    """
    return StoreConfig.parse(read_store(path), where=path)


def at_rest(tier: TierSettings) -> str:
    """How a tier's config stores chunks at rest: its codec (lossy ones marked) and which
    chunks it encrypts. Names no secret, file or variable."""
    codec = getattr(tier, "codec", "none")
    text = f"{codec} (LOSSY)" if codec in LOSSY_CODECS else codec
    secret = (getattr(tier, "encryption_secret_file", None)
              or getattr(tier, "encryption_secret_env", None))
    if secret:
        text += ", encrypted: " + ("all chunks" if getattr(tier, "encrypt_unsalted", False)
                                   else "salted chunks")
    return text


def run(args: argparse.Namespace) -> int:
    rows: list[NamespaceUsage] = []
    errors: dict[str, str] = {}
    store = load_store(args.config)
    encodings = {t.tier_name: at_rest(t) for t in store.tiers}
    for inventory in open_inventories(store, args.tier):
        try:
            manifests = read_manifests(inventory)
            rows += summarize(inventory, list(inventory.chunks()), manifests)
        except Exception as exc:  # an unreachable tier is reported, the others still listed
            errors[inventory.name] = f"{type(exc).__name__}: {exc}"
        finally:
            inventory.close()
    if args.json:
        print(json.dumps({"namespaces": [asdict(r) | {"at_rest": encodings[r.tier]} for r in rows],
                          "errors": errors}, indent=2))
        return 1 if errors else 0
    table = Table(title="kvtier inspect")
    for column in ("tier", "kind", "at rest", "namespace", "model", "fingerprint", "chunks",
                   "bytes", "oldest", "newest", "hits"):
        table.add_column(column, justify="right" if column in ("chunks", "bytes") else "left",
                         no_wrap=column in ("namespace", "fingerprint"))
    for r in rows:
        table.add_row(r.tier, r.kind, encodings[r.tier], r.namespace, r.model,
                      short_fingerprint(r.fingerprint), str(r.chunks),
                      format_size(r.size_bytes), _ago(r.oldest_s), _ago(r.newest_s),
                      "n/a" if r.hits is None else str(r.hits))
    console = Console(width=max(Console().width, 180))
    console.print(table)
    for tier, error in errors.items():
        console.print(f"[bold red]tier {tier}: not readable: {error}[/]")
    return 1 if errors else 0


def short_fingerprint(fingerprint: str) -> str:
    """A fingerprint's first 12 hex digits (enough for `kvtier gc --fingerprint`); "unknown"
    and "none" as they are."""
    return fingerprint[:12] if len(fingerprint) == 32 else fingerprint


def _ago(when_s: float | None) -> str:
    if when_s is None:
        return "-"
    age = max(0.0, time.time() - when_s)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if age >= size:
            return f"{age / size:.1f}{unit} ago"
    return f"{age:.0f}s ago"
