"""`kvtier gc --config FILE`: evict chunks of persistent tiers to a quota (`--quota 500GiB`),
by age (`--max-age 7d`), or whole namespaces: one (`--namespace DIGEST`), or every namespace
of a model checkpoint, by its manifest (`--fingerprint PREFIX`, at least 6 hex digits of the
fingerprint `kvtier inspect` shows, and/or `--model NAME`, as served); `--dry-run` reports
what would go. Every run also deletes what no reader reaches (redis values of an older kvtier:
a value per part, not a chunk's hash); `--orphans` does only that. Rules combine (see
kvtier/tools/admin/gc.py).

Exit codes: 0 done (also when no namespace matched: said so), 1 a tier's storage could not
be read: no answer within 5 s (a dead mount), or its directory does not exist (a wrong path,
an unmounted volume, or no engine has used the tier on this machine yet); each is said and
the other tiers are still collected, and a cron job sees a gc that could not do its work,
rather than a 0 for a tier it never reached; or a deletion failed partway (a command the
storage refused, a connection dropped): said, and what it had removed by then is reported.
2 bad input (a config without a persistent
tier included: there is nothing for gc to collect).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict

from rich.console import Console
from rich.table import Table

from kvtier.errors import GcStopped
from kvtier.tools.admin.gc import GcOutcome, GcRequest, parse_duration, run_gc
from kvtier.tools.admin.inventory import open_inventories
from kvtier.tools.cli.inspect import load_store, print_errors, short_fingerprint
from kvtier.tools.cli.literal import literal
from kvtier.units import format_size, parse_size


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser("gc", help="evict chunks to a quota, by age, or a namespace")
    p.add_argument("--config", required=True, help="kvtier store config file (YAML or JSON)")
    p.add_argument("--tier", help="only this tier (its name in the config)")
    p.add_argument("--quota", help="keep at most this much per tier, e.g. 500GiB")
    p.add_argument("--max-age", help="evict chunks unused for longer, e.g. 12h, 7d")
    p.add_argument("--namespace", help="only this layout digest (alone: evict all of it)")
    p.add_argument("--fingerprint", help="only namespaces of the model whose fingerprint starts "
                   "with this (>= 6 hex digits; `kvtier inspect` shows them; alone: evict them)")
    p.add_argument("--model", help="only namespaces of this model, its name as served (alone: "
                   "evict them)")
    p.add_argument("--orphans", action="store_true",
                   help="evict no chunk, only delete what no reader reaches (redis values "
                        "an older kvtier wrote; every gc run deletes them too)")
    p.add_argument("--dry-run", action="store_true", help="report, delete nothing")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    request = GcRequest(
        quota_bytes=parse_size(args.quota, "--quota") if args.quota is not None else None,
        max_age_s=parse_duration(args.max_age) if args.max_age is not None else None,
        namespace=args.namespace, dry_run=args.dry_run, orphans_only=args.orphans,
        fingerprint=args.fingerprint.strip().lower() if args.fingerprint is not None else None,
        model=args.model)
    request.validate()
    outcomes: list[GcOutcome] = []
    errors: dict[str, str] = {}
    stopped: dict[str, str] = {}
    for inventory in open_inventories(load_store(args.config), args.tier, unanswered=errors):
        try:
            outcomes += run_gc([inventory], request)
        except GcStopped as exc:  # what it removed before is reported
            outcomes += exc.outcomes
            stopped[inventory.name] = str(exc) if exc.counted else \
                f"{exc} (what it removed could not be counted: the tier could not be listed)"
        except Exception as exc:  # an unreachable tier is reported, the others still run
            errors[inventory.name] = f"{type(exc).__name__}: {exc}"
        finally:
            inventory.close()
    failed = 1 if errors or stopped else 0
    unmatched = _unmatched(request) if not outcomes and not failed else None
    if args.json:
        print(json.dumps({"outcomes": [asdict(o) for o in outcomes], "errors": errors,
                          "stopped": stopped, "dry_run": args.dry_run,
                          "unmatched": unmatched}, indent=2))
        return failed
    if unmatched:
        Console().print(literal(unmatched))
        return 0
    verb = "would remove" if args.dry_run else "removed"
    table = Table(title=f"kvtier gc{' (dry run)' if args.dry_run else ''}")
    for column in ("tier", "namespace", "model", "fingerprint", f"{verb} chunks",
                   f"{verb} bytes", "kept chunks", "kept bytes", "kept in use",
                   f"{verb} orphans", f"{verb} manifest"):
        table.add_column(column, no_wrap=column in ("namespace", "fingerprint"))
    for o in outcomes:
        table.add_row(o.tier, literal(o.namespace), literal(o.model),
                      literal(short_fingerprint(o.fingerprint)),
                      str(o.removed_chunks), format_size(o.removed_bytes), str(o.kept_chunks),
                      format_size(o.kept_bytes), str(o.kept_used), str(o.removed_orphans),
                      "yes" if o.removed_manifest else "no")
    console = Console(width=max(Console().width, 200))
    console.print(table)
    print_errors(console, errors)
    for tier, error in stopped.items():
        console.print(literal(f"tier {tier}: stopped partway, the table counts what it had "
                              f"removed: {error}", style="bold red"))
    return failed


def _unmatched(request: GcRequest) -> str | None:
    """What to say when a namespace selection matched nothing (None: no selection)."""
    rules = [f"--{name} {value}" for name, value in (
        ("namespace", request.namespace), ("fingerprint", request.fingerprint),
        ("model", request.model)) if value is not None]
    if not rules:
        return None
    return (f"no namespace matches {' '.join(rules)}: nothing removed (`kvtier inspect` lists "
            "each namespace's model and fingerprint; namespaces written before manifests "
            "existed show as unknown and are removed with --namespace)")
