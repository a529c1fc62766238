"""`kvtier inspect --config FILE`: what each persistent tier holds, per namespace (layout
digest): the model it is the KV of and its fingerprint (from the namespace's manifest;
"unknown" without one: data of an older kvtier, or a store opened without a model), how the
tier stores chunks at rest (codec, encryption), chunks, bytes, least and most recently used
(how long ago by the clock that stamped those times, as `kvtier gc --max-age` measures them:
a shared directory's, read off an empty file created in its root and removed at once; an S3
server's; `inventory.storage_now`). Reads storage only; changes nothing but that file.
`--json` gives the whole fingerprint, the times of use as Unix times (`oldest_s`,
`newest_s`) and their ages in seconds by that clock (`oldest_age_s`, `newest_age_s`).

`kvtier inspect --metrics URL` (with or without `--config`) adds what a hit on each tier
costs on a running kvtier-served vLLM: its measured restore seconds per 1k tokens, the
engine's recompute seconds per 1k tokens, and the router weight they imply for llm-d and
Dynamo (kvtier.tools.ops.restorecost), in the table and as a table of its own; and what the
engine's cache did and holds (kvtier.tools.ops.enginecache): the tokens it found, loaded, and
found but did not load by reason, and the chunks and bytes each tier holds now.

Exit codes: 0 listed, 1 a tier's storage could not be read (no answer within 5 s: a dead
mount; its directory does not exist: a wrong path, an unmounted volume, or no engine has
used the tier on this machine yet; each said, the other tiers still listed), 2 bad input (an
unreadable /metrics included; a `--config` without a persistent tier, unless `--metrics`
asks about the tiers' costs alone).
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict

from rich.console import Console
from rich.table import Table
from rich.text import Text

from kvtier.core.codecs import LOSSY_CODECS
from kvtier.tiers.storeconfig import StoreConfig, TierSettings
from kvtier.tools.admin.inventory import (
    NamespaceUsage,
    open_inventories,
    persistent_tiers,
    read_manifests,
    storage_now,
    summarize,
)
from kvtier.tools.cli.literal import literal
from kvtier.tools.cli.weights import print_router_weights
from kvtier.tools.ops.doctor import read_store
from kvtier.tools.ops.enginecache import EngineCache, parse_engine_cache
from kvtier.tools.ops.restorecost import (
    WEIGHT_FORMULA,
    TierWeight,
    fetch_metrics,
    measured_weights,
    parse_restore_costs,
    tier_media,
)
from kvtier.units import format_size


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser("inspect", help="chunks and bytes per tier and namespace")
    p.add_argument("--config", help="kvtier store config file (YAML or JSON)")
    p.add_argument("--metrics", metavar="URL",
                   help="a kvtier-served vLLM's /metrics: per-tier restore cost, recompute's, "
                        "and the router weights they imply")
    p.add_argument("--tier", help="only this tier (its name in the config)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=run, usage_error=p.error)


def load_store(path: str, reading_only: bool = False) -> StoreConfig:
    """A store config file, or a connector config with a `store` section; `reading_only`:
    for a command that only reads the tiers (directories it cannot write are accepted).

    Raises:
        ConfigError: unreadable or invalid.
    """
    return StoreConfig.parse(read_store(path), where=path, reading_only=reading_only)


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
    if args.config is None and args.metrics is None:
        args.usage_error("give --config FILE, --metrics URL, or both")  # exits 2
    # `is not None`: an empty value (`--config "$KVTIER_CONFIG"`, the variable unset) is
    # refused by what reads it, not taken for the option left out
    store = load_store(args.config, reading_only=True) if args.config is not None else None
    weights: tuple[TierWeight, ...] = ()
    costs = None
    engine: EngineCache | None = None
    if args.metrics is not None:
        text = fetch_metrics(args.metrics)
        costs, engine = parse_restore_costs(text), parse_engine_cache(text)
        weights = measured_weights(costs, tier_media(store) if store else None)
    rows: list[NamespaceUsage] = []
    errors: dict[str, str] = {}
    # With --metrics, a config of memory tiers only still names the tiers' media.
    listed = store is not None and not (args.metrics and args.tier is None
                                        and not persistent_tiers(store))
    clocks: dict[str, float] = {}  # tier -> now by its storage's clock (the ages)
    if store is not None and listed:
        rows, errors = _inventory(store, args.tier, clocks)
    encodings = {t.tier_name: at_rest(t) for t in store.tiers} if store else {}
    if args.json:
        print(json.dumps({"namespaces": [_json_row(r, encodings, clocks) for r in rows],
                          "errors": errors,
                          **({"restore_costs": asdict(costs), "router_weight_formula":
                              WEIGHT_FORMULA, "router_weights": [asdict(w) for w in weights]}
                             if costs is not None else {}),
                          **({"engine_cache": asdict(engine)} if engine is not None else {})},
                         indent=2))
        return 1 if errors else 0
    console = Console(width=max(Console().width, 180))
    if listed:
        console.print(_table(rows, encodings, {w.tier: w for w in weights} if costs else None,
                             clocks))
    if costs is not None:
        print_router_weights(console, weights, costs.decisions)
    if engine is not None:
        console.print(_lost_table(engine))
        console.print(_residency_table(engine))
        if any(h.capacity_bytes <= 0 for h in engine.residency.values()):
            console.print(literal(UNCOUNTED))
    print_errors(console, errors)
    return 1 if errors else 0


def print_errors(console: Console, errors: dict[str, str]) -> None:
    """Each tier that could not be read, with its error (shown literally)."""
    for tier, error in errors.items():
        console.print(literal(f"tier {tier}: not readable: {error}", style="bold red"))


def _inventory(store: StoreConfig, only: str | None, clocks: dict[str, float] | None = None,
               ) -> tuple[list[NamespaceUsage], dict[str, str]]:
    """Each tier's rows, and the error of each that could not be read; with `clocks`, each
    tier's now by its storage's clock is put there (the ages, as gc takes them)."""
    rows: list[NamespaceUsage] = []
    errors: dict[str, str] = {}
    for inventory in open_inventories(store, only, unanswered=errors):
        try:
            manifests = read_manifests(inventory)
            rows += summarize(inventory, list(inventory.chunks()), manifests)
            if clocks is not None:
                clocks[inventory.name] = storage_now(inventory)
        except Exception as exc:  # an unreachable tier is reported, the others still listed
            errors[inventory.name] = f"{type(exc).__name__}: {exc}"
        finally:
            inventory.close()
    return rows, errors


def _table(rows: list[NamespaceUsage], encodings: dict[str, str],
           weights: dict[str, TierWeight] | None, clocks: dict[str, float]) -> Table:
    """The inventory; with `weights` (--metrics), each tier's restore cost and weight.
    `clocks`: each tier's now by its storage's clock, that its ages are taken by."""
    table = Table(title="kvtier inspect")
    columns = ["tier", "kind", "at rest", "namespace", "model", "fingerprint", "chunks",
               "bytes", "oldest", "newest", "hits"]
    if weights is not None:
        columns += ["restore s/1k tok", "weight"]
    for column in columns:
        table.add_column(column, justify="right" if column in ("chunks", "bytes") else "left",
                         no_wrap=column in ("namespace", "fingerprint"))
    for r in rows:
        cells: list[str | Text] = [
            r.tier, r.kind, encodings[r.tier], literal(r.namespace), literal(r.model),
            literal(short_fingerprint(r.fingerprint)), str(r.chunks), format_size(r.size_bytes),
            _ago(r.oldest_s, clocks.get(r.tier)), _ago(r.newest_s, clocks.get(r.tier)),
            "n/a" if r.hits is None else str(r.hits)]
        if weights is not None:
            w = weights.get(r.tier)
            cost = None if w is None else w.restore_s_per_1k
            cells += ["not measured" if cost is None else f"{cost:.4f}",
                      "-" if w is None or w.weight is None else f"{w.weight:.2f}"]
        table.add_row(*cells)
    return table


def _json_row(row: NamespaceUsage, encodings: dict[str, str],
              clocks: dict[str, float]) -> dict[str, object]:
    """A namespace's row of `--json`: its fields, how its tier stores chunks at rest, and the
    ages of its times of use, in seconds by its tier's storage clock (None without chunks)."""
    now_s = clocks.get(row.tier)
    return asdict(row) | {"at_rest": encodings[row.tier],
                          "oldest_age_s": _age_s(row.oldest_s, now_s),
                          "newest_age_s": _age_s(row.newest_s, now_s)}


def _lost_table(engine: EngineCache) -> Table:
    """Tokens the engine found beyond vLLM's own cache, loaded, and not loaded by reason."""
    table = Table(title="hits found and not loaded (tokens, since the engine started)")
    for column in ("", "tokens", "of found"):
        table.add_column(column, justify="left" if not column else "right")
    found = engine.found_tokens
    rows = [("found", found), ("loaded", engine.loaded_tokens),
            *((f"lost: {reason}", tokens) for reason, tokens in engine.lost_tokens.items())]
    for name, tokens in rows:
        table.add_row(name, f"{tokens:.0f}", f"{tokens / found:.1%}" if found else "-")
    return table


def _residency_table(engine: EngineCache) -> Table:
    """What each tier holds now, as the engine sees it (its own layout's namespace). A tier
    of capacity 0 has no bound of kvtier's and no count to match (a redis tier's gauges stay
    0, an s3 tier's count only this engine's stores, a node's tiers are the node's): its row
    says so (`UNCOUNTED`) rather than "0 B", which read as an empty, disabled tier."""
    table = Table(title="residency now (the engine's tiers)")
    for column in ("tier", "chunks", "bytes", "capacity"):
        table.add_column(column, justify="left" if column == "tier" else "right")
    for tier, held in sorted(engine.residency.items()):
        if held.capacity_bytes <= 0:
            table.add_row(tier, "-", "-", "no bound")
        else:
            table.add_row(tier, f"{held.chunks:.0f}", format_size(int(held.used_bytes)),
                          format_size(int(held.capacity_bytes)))
    return table


# Printed under the residency table when a row is a tier of capacity 0.
UNCOUNTED = ("-: not counted by the engine (a redis or s3 tier of capacity 0, bounded by the "
             "server; a kvtier node's tiers): what it holds is in the table of --config, or "
             "kvtier node status")


def short_fingerprint(fingerprint: str) -> str:
    """A fingerprint's first 12 hex digits (enough for `kvtier gc --fingerprint`); "unknown"
    and "none" as they are."""
    return fingerprint[:12] if len(fingerprint) == 32 else fingerprint


def _age_s(when_s: float | None, now_s: float | None) -> float | None:
    """Seconds before `now_s` (the storage's clock; None: this host's) `when_s` was, at
    least 0; None without a `when_s`."""
    if when_s is None:
        return None
    return max(0.0, (time.time() if now_s is None else now_s) - when_s)


def _ago(when_s: float | None, now_s: float | None) -> str:
    """How long before `now_s` (the storage's clock; None: this host's) `when_s` was."""
    age = _age_s(when_s, now_s)
    if age is None:
        return "-"
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if age >= size:
            return f"{age / size:.1f}{unit} ago"
    return f"{age:.0f}s ago"
