"""Audit rules for the command itself, as vLLM's argument parser reads it: input that holds no
vLLM server command, and flags or words the parser refuses (a misspelled flag, a flag of an
older release, `--enable-prefix-caching=false`, a value after a flag that takes none).

vLLM exits at start-up on each of these. Flags are judged against the table of vLLM
TABLE_VERSION's flags (vllm_flags.py): auditing another release, a name that table lacks
may be a flag of that release, so it is a warning there, unless it is a near miss of a flag
the table has ("did you mean ...?"), which is an error on any release. A flag the table's
release added (`flag_since`: 0.33's `--disable-prefix-caching`) is an error on an older
release audited.
"""

from __future__ import annotations

import shlex
from collections.abc import Iterator

from kvtier.tools.ops.audit.command import ServeCommand
from kvtier.tools.ops.audit.finding import Finding, Severity
from kvtier.tools.ops.audit.registry import AuditOptions, rule
from kvtier.tools.ops.audit.vllm_flags import (
    TABLE_VERSION,
    FlagLookup,
    flag_since,
    lookup_flag,
)
from kvtier.tools.ops.vllm_versions import Version, format_version

_RULE = "unrecognized-vllm-argument"
_TABLE = f"vLLM {format_version(TABLE_VERSION)}"
# Retired flags another rule reports, with what they did (calculate-kv-scales-deprecated).
_REPORTED_ELSEWHERE = frozenset({"--calculate-kv-scales"})


@rule("not-a-vllm-command", "input that holds no vLLM server command (empty, another program)")
def not_a_vllm_command(cmd: ServeCommand, _: AuditOptions) -> Iterator[Finding]:
    if cmd.entrypoint is not None:
        return
    yield Finding(
        "not-a-vllm-command", Severity.ERROR,
        "the input is empty" if not cmd.argv else
        f"no vLLM server command in the input: it runs {_clip(shlex.join(cmd.argv))!r}",
        "the audit checks the command that starts a vLLM server; there is none, so no other "
        "check ran",
        "give `vllm serve MODEL ...`, `python -m vllm.entrypoints.openai.api_server ...` or "
        "`docker run ... vllm/vllm-openai:TAG ...`: quoted, after `--`, or in a script or "
        "Kubernetes manifest",
    )


@rule(_RULE, "a flag or word vLLM's parser refuses (a typo, a retired flag, `--flag=x` on a "
             "flag that takes no value)")
def unrecognized_argument(cmd: ServeCommand, _: AuditOptions) -> Iterator[Finding]:
    version = cmd.vllm_version
    # Auditing the table's own release, the table is the truth; on another, a guess.
    severity = Severity.ERROR if version == TABLE_VERSION else Severity.WARNING
    for name, value in cmd.flags.items():
        found = lookup_flag(name.partition(".")[0])
        shown = name if value is None else f"{name} {_clip(value, 40)}"
        if found.status == "unknown":
            yield _unknown(found, shown, severity, version)
        elif found.status == "ambiguous":
            more = ", ..." if len(found.matches) > 4 else ""
            yield Finding(
                _RULE, severity,
                f"{name} abbreviates more than one flag of {_TABLE}: "
                f"{', '.join(found.matches[:4])}{more}",
                f"vLLM exits at start-up: ambiguous option: {name}",
                "write the flag in full",
            )
        elif found.status == "retired" and name not in _REPORTED_ELSEWHERE and (
                version is None or version >= TABLE_VERSION):
            yield Finding(
                _RULE, severity,
                f"{name} is a flag of older vLLM releases, not of {_TABLE}",
                f"{_TABLE} exits at start-up: unrecognized arguments: {shown}",
                "remove it, or audit with --vllm-version set to the release you run",
            )
        elif found.nargs == "0" and value is not None and "." not in name:
            yield _value_on_switch(name, value, severity)
        written = cmd.spellings.get(name, name)
        since = flag_since(written)
        if found.status == "known" and version is not None and since is not None \
                and version < since:
            yield _too_new(written, name, since, version)
    if cmd.extra_words:
        words = _clip(shlex.join(cmd.extra_words))
        yield Finding(
            _RULE, severity,
            f"{words}: words after the model {cmd.model!r} that no flag takes",
            "vLLM takes one positional word, the model, and exits at start-up: unrecognized "
            f"arguments: {words}",
            "put each value right after its flag; a flag that takes no value takes none "
            "(`--no-enable-prefix-caching`, not `--enable-prefix-caching false`)",
        )


def _unknown(found: FlagLookup, shown: str, severity: Severity,
             version: Version | None) -> Finding:
    """A name no flag of the table has: a near miss (an error on any release) or not."""
    if found.matches:
        meant = found.matches[0]
        return Finding(
            _RULE, Severity.ERROR,
            f"{found.name} is not a vLLM flag (did you mean {meant}?)",
            f"vLLM exits at start-up (unrecognized arguments: {shown}); the audit does not "
            f"read it as {meant} either, so nothing about {meant} was checked",
            f"write {meant}, then audit again",
        )
    audited = f"the audited {format_version(version)}" if version else "the release you run"
    return Finding(
        _RULE, severity,
        f"{found.name} is not a flag of {_TABLE}" + (
            "" if severity is Severity.ERROR else
            f" (the flag table this audit has; {audited} may differ)"),
        f"vLLM exits at start-up (unrecognized arguments: {shown}); what it was meant to set "
        "was not checked",
        "remove it or correct its name (`vllm serve --help=all` lists the flags of the "
        "release you run)",
    )


def _too_new(written: str, flag: str, since: Version, version: Version) -> Finding:
    """A flag (or spelling) of a release newer than the one audited."""
    older = flag if flag != written and flag_since(flag) is None else None
    return Finding(
        _RULE, Severity.ERROR,
        f"{written} is a flag of vLLM {format_version(since)} and later, not of the audited "
        f"{format_version(version)}",
        f"vLLM {format_version(version)} exits at start-up: unrecognized arguments: {written}",
        f"write {older} (what {written} means)" if older else
        f"remove it, or run vLLM {format_version(since)} or later",
    )


def _value_on_switch(name: str, value: str, severity: Severity) -> Finding:
    """`--flag=value` on a flag that takes no value."""
    negated = name.replace("--", "--no-", 1)
    off = negated if lookup_flag(negated).status == "known" else None
    return Finding(
        _RULE, severity,
        f"{name}={_clip(value, 40)}: {name} takes no value",
        f"vLLM exits at start-up: argument {name}: ignored explicit argument {value!r}",
        f"write {name}" + (f" (on) or {off} (off)" if off else ""),
    )


def _clip(text: str, limit: int = 80) -> str:
    return text if len(text) <= limit else text[:limit - 3] + "..."
