"""The flags vLLM's `vllm serve` parser accepts, from a table generated from that parser
(vllm_flag_table.py, by scripts/gen_vllm_flags.py), so that the audit knows them where vLLM
is not installed.

Primitives:
    TABLE_VERSION      -- the vLLM release the table comes from
    RETIRED_FLAGS      -- flags older releases accepted that the table's release lacks
    flag_since(name)   -- the release that added a flag of the table, when it is known
    FlagLookup         -- what vLLM's parser makes of one flag name (frozen)
    lookup_flag(name)  -- resolve an alias or a unique prefix, or say why vLLM refuses the name
    Arguments, read_arguments(argv) -- the model, flags and extra words of vLLM's arguments

vLLM's parser (FlexibleArgumentParser, an argparse parser) reads `_` as `-` in a flag's name
before any `.`, `--flag=value` as `--flag value`, `--json-flag.key value` as a key of the
JSON flag, `-O3` as `--optimization-level 3`, and, as argparse does, a unique prefix of a
long flag as that flag (`--max-model` is `--max-model-len`); `read_arguments` reads words
the same way.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from kvtier.tools.ops.audit.vllm_flag_table import ALIASES, FLAGS, VLLM_VERSION
from kvtier.tools.ops.vllm_versions import Version, parse_version

TABLE_VERSION: Version = parse_version(VLLM_VERSION)
# Flags of older releases that the table's release no longer has (name -> nargs), so that an
# audit of such a release does not call them typos. The release that dropped each is not
# recorded: the audit knows only that TABLE_VERSION lacks it.
RETIRED_FLAGS: dict[str, str] = {
    "--calculate-kv-scales": "0",  # no effect from v0.19 (rules_kvcache reports it)
    "--disable-async-output-proc": "0",  # V0 engine
    "--enable-reasoning": "0",  # implied by --reasoning-parser
    "--guided-decoding-backend": "1",  # became --structured-outputs-config.backend
    "--max-seq-len-to-capture": "1",  # CUDA graphs: --compilation-config
    "--num-scheduler-steps": "1",  # V0 multi-step scheduling
    "--preemption-mode": "1",  # V0 swap / recompute
    "--swap-space": "1",  # V0 CPU swap space, GiB
    "--task": "1",  # became --runner / --convert
    "--use-v2-block-manager": "0",  # V0 block manager
    "--worker-use-ray": "0",  # became --distributed-executor-backend ray
}
# Flags the table's release (0.33) added to 0.32's. 0.33 also shows each `--enable-x` /
# `--no-enable-x` boolean as `--enable-x` / `--disable-x` (and `--disable-x` as `--enable-x`),
# the old `--no-` forms still accepted: those new spellings are the table's aliases of a
# `--no-` flag that begin otherwise (`--disable-prefix-caching` -> `--no-enable-prefix-caching`).
# `--disable-log-requests` is such a spelling too, and a flag of releases before 0.2x: no
# release is given for it.
_ADDED_IN_0_33: frozenset[str] = frozenset({
    "--monokernel", "--no-monokernel", "--reasoning-effort-map", "--sleep-mode-backend",
    "--watchdog-config"})
_SINCE_0_33: Version = (0, 33, 0)
OLD_SPELLINGS = frozenset({"--disable-log-requests"})
_LONG_NAMES = sorted(set(FLAGS) | {a for a in ALIASES if a.startswith("--")})
_CLOSE_CUTOFF = 0.75  # difflib ratio: --kv-transfer-confg matches, --bogus-flag does not

Status = Literal["known", "retired", "ambiguous", "unknown"]


@dataclass(frozen=True, slots=True)
class FlagLookup:
    """What vLLM's parser makes of one flag name."""

    name: str  # the name as written, `_` read as `-`
    status: Status  # "known": vLLM TABLE_VERSION takes it; otherwise why it does not
    flag: str | None  # the flag it stands for (alias or unique prefix resolved); None unknown
    # values it takes: "0", "1", "?", "+", "*" (argparse's nargs); None when that cannot be told
    nargs: str | None
    # "ambiguous": the flags it could abbreviate; "unknown": the nearest flag, if one is close
    matches: tuple[str, ...] = ()


def lookup_flag(name: str) -> FlagLookup:
    """What vLLM TABLE_VERSION's parser makes of the flag `name` (no `=value`, no `.key`).

    Pure; any thread.
    """
    if name in FLAGS:
        return FlagLookup(name, "known", name, FLAGS[name])
    if name in ALIASES:
        return FlagLookup(name, "known", ALIASES[name], FLAGS[ALIASES[name]])
    if name.startswith("--") and len(name) > 2:
        prefixed = [f for f in _LONG_NAMES if f.startswith(name)]
        if len(prefixed) == 1:
            flag = ALIASES.get(prefixed[0], prefixed[0])
            return FlagLookup(name, "known", flag, FLAGS[flag])
        if prefixed:  # argparse: "ambiguous option: --max could match ..."
            nargs = {FLAGS[ALIASES.get(f, f)] for f in prefixed}
            return FlagLookup(name, "ambiguous", None,
                              nargs.pop() if len(nargs) == 1 else None, tuple(prefixed))
    if name in RETIRED_FLAGS:
        return FlagLookup(name, "retired", name, RETIRED_FLAGS[name])
    close = difflib.get_close_matches(name.lstrip("-"), [f.lstrip("-") for f in _LONG_NAMES],
                                      n=1, cutoff=_CLOSE_CUTOFF) if name.startswith("--") else []
    if close:
        match = ALIASES.get("--" + close[0], "--" + close[0])
        return FlagLookup(name, "unknown", None, FLAGS[match], (match,))
    return FlagLookup(name, "unknown", None, None)


def flag_since(name: str) -> Version | None:
    """The vLLM release that added `name` (a full flag or alias of the table), when the table
    knows it (flags new in the table's release); None for older flags and unknown names."""
    if name in _ADDED_IN_0_33:
        return _SINCE_0_33
    target = ALIASES.get(name)
    if (target is not None and target.startswith("--no-") and not name.startswith("--no-")
            and name not in OLD_SPELLINGS):
        return _SINCE_0_33
    return None


@dataclass(frozen=True, slots=True)
class Arguments:
    """vLLM's arguments as its parser reads them."""

    model: str | None  # the positional model (`--model` is among the flags)
    # flag -> its value (the words of a flag taking several joined by spaces), None for none;
    # known names as lookup_flag resolves them, unknown ones as written
    flags: Mapping[str, str | None]
    extra_words: tuple[str, ...]  # positional words after the model: vLLM refuses them
    # a flag of `flags` -> its name as written, where that was an alias or a prefix of it
    spellings: Mapping[str, str] = field(default_factory=dict)


def _vllm_words(words: Sequence[str]) -> list[str]:
    """`words` as vLLM's FlexibleArgumentParser rewrites them before argparse reads them:
    `_` as `-` in a long flag's name (before any `.`), `-O3` / `-O=3` / `-O 3` as
    `--optimization-level 3`."""
    out: list[str] = []
    for i, word in enumerate(words):
        if word.startswith("--"):
            name, eq, value = word.partition("=")
            head, dot, key = name.partition(".")
            out.append(head.replace("_", "-") + dot + key + eq + value)
        elif word.startswith("-O") and word != "-O":
            out += ["--optimization-level", word[3:] if word[2] == "=" else word[2:]]
        elif word == "-O" and words[i + 1:i + 2] in (["0"], ["1"], ["2"], ["3"]):
            out.append("--optimization-level")
        else:
            out.append(word)
    return out


def read_arguments(argv: Sequence[str]) -> Arguments:
    """vLLM's arguments (the words after `vllm serve`) as its parser reads them: each flag
    takes the words `lookup_flag` says it takes.

    Pure; any thread.
    """
    words = _vllm_words(argv)
    model: str | None = None
    flags: dict[str, str | None] = {}
    spellings: dict[str, str] = {}
    extra: list[str] = []
    i = 0
    while i < len(words):
        word = words[i]
        i += 1
        if word == "--":  # argparse: every word after it is positional
            rest = words[i:]
            model = model or (rest.pop(0) if rest else None)
            extra.extend(rest)
            break
        if not _is_option(word):
            if model is None:
                model = word
            else:
                extra.append(word)
            continue
        name, eq, value = word.partition("=")
        if "." in name:  # --json-flag.key value: vLLM takes the next word, whatever it is
            base, _, key = name.partition(".")
            name = f"{lookup_flag(base).flag or base}.{key}"
            taken = [] if eq else words[i:i + 1]
        else:
            found = lookup_flag(name)
            if found.flag is not None:  # a repeated flag: its last spelling
                spellings.pop(found.flag, None)
                if found.flag != name:
                    spellings[found.flag] = name
            name = found.flag or name
            # A name argparse does not know takes no word; the one after it is the model, or,
            # once there is a model, an extra word vLLM names with it (`--bogus 3`).
            nargs = found.nargs or ("?" if model is not None else "0")
            taken = [] if eq else _values(words, i, nargs)
        i += len(taken)
        flags[name] = value if eq else (" ".join(taken) if taken else None)
    return Arguments(model, flags, tuple(extra), spellings)


def _values(words: Sequence[str], start: int, nargs: str) -> list[str]:
    """The words from `start` that a flag taking `nargs` values gets: up to the next flag."""
    limit = len(words) if nargs in ("+", "*") else int(nargs) if nargs.isdigit() else 1
    taken: list[str] = []
    for word in words[start:start + limit]:
        if _is_option(word):
            break
        taken.append(word)
    return taken


def _is_option(word: str) -> bool:
    """Whether argparse reads `word` as a flag rather than a value (`-1` is a value)."""
    return word.startswith("-") and word != "-" and not _is_number(word)


def _is_number(tok: str) -> bool:
    try:
        float(tok)
    except ValueError:
        return False
    return True
