"""What a file tier's directory (`disk`, `shared`: the `path` field) must be, checked when the
config is validated, so that a bad path is a ConfigError naming the field, the value and the
fix, not a NotADirectoryError or PermissionError from deep in a vLLM worker 45 s into start-up
(issue 12, item 10).

A usable path is an existing directory this process can use, or one it can create: its
nearest existing ancestor is a directory it may write into. Never under /proc or /sys (kernel
views, not storage: writes there fail or, worse, reach a kernel knob). A `disk` tier must be
able to write; a `shared` tier may be a read-only directory (it serves the hits others wrote),
so only what cannot be used at all is refused for it.

The check does no I/O beyond stat/access: it creates nothing (the tier creates its directory
when it is built), so validating a config changes nothing on the machine. A directory that
does not answer within `CHECK_TIMEOUT_S` (a dead hard-mounted NFS server blocks a stat for
ever) is not checked, and said so: reading a config must not hang an engine's start, and the
store leaves such a tier out when it opens (`kvtier.tiers.open_store`).

An empty `path` is refused before any of this: pathlib reads "" as ".", the working
directory of whichever process opens the tier (a vLLM worker's, a cron job's), so a template
whose variable came out empty (`path: "${KVTIER_DIR}"`) would fill a directory nobody chose.

A `disk` tier's directory is its own: once the tier has made (or found) it, `check_owned`
refuses a layout directory another user owns (they could have put chunk files in it, which
would be served as KV), and warns of a root under another user's directory.

Primitives: `TierDirectory` (the `path` field's type), `check_directory`, `check_owned`,
`KERNEL_FILESYSTEMS`, `CHECK_TIMEOUT_S`.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Annotated

from pydantic import BeforeValidator

from kvtier.core.stall import call_within
from kvtier.errors import ConfigError

log = logging.getLogger(__name__)
CHECK_TIMEOUT_S = 5.0
_warned_owners: set[str] = set()  # directories of other users' a tier's path is under, logged

KERNEL_FILESYSTEMS = (Path("/proc"), Path("/sys"))
_FIX = ("give a directory on a local or shared filesystem that exists and is writable by this "
        "user, or that can be created under a writable parent")


def _not_blank(value: object) -> object:
    """`value` unless it is a blank string (see the module doc: "" is the working directory)."""
    if isinstance(value, str) and not value.strip():
        raise ValueError(f"a directory, not an empty path (pathlib takes it for the working "
                         f"directory of the process that opens the tier); {_FIX}")
    return value


# A file tier's `path`: a blank string is refused before pydantic makes it a Path (".").
TierDirectory = Annotated[Path, BeforeValidator(_not_blank)]


def check_directory(path: Path, *, read_only_ok: bool) -> Path:
    """`path` when a tier can use it as its directory, a leading `~` expanded (a shell
    does not expand it in a JSON or YAML config: `~/kv` made a folder named `~`).

    Args:
        path: the configured directory (relative paths are taken from the working directory,
            as the tier takes them).
        read_only_ok: accept an existing directory this process may read but not write
            (a `shared` tier serving hits only).

    Returns:
        `path`, as given but for a leading `~` (the user's home) or `~user`.

    Raises:
        ValueError: what is wrong and the fix (pydantic and `kvtier.config.parse_model` turn
            it into a ConfigError naming the field and the value).
    """
    path = path.expanduser()
    checked, _ = call_within(lambda: _check(path, read_only_ok), CHECK_TIMEOUT_S,
                             "kvtier-path-check")
    if not checked:
        log.warning("kvtier: directory %s did not answer within %g s (a dead mount?): not "
                    "checked", path, CHECK_TIMEOUT_S)
    return path


def check_owned(field: str, root: Path, directory: Path) -> None:
    """Check that no other user could have put chunk files in a disk tier's `directory` (its
    layout directory, under `root`): it must be this user's (the tier makes it, 0700: one
    another user made first, a /tmp/kvtier squatted before the tier ran, had its chunk files
    served as KV, forged ones included: tests/faults/test_foreign_disk_directory.py). A `root`
    or a directory above it of another user but root's (who may swap the directories in it at
    any time, as OpenSSH's StrictModes has it for ~/.ssh) is a warning, not a refusal: an
    engine in a container, as root, on a volume its host's user owns is the common case.

    Raises:
        ConfigError: `field` (the tier's path), naming the directory and its owner.
    """
    me = os.geteuid()
    try:
        owner = os.stat(directory, follow_symlinks=False).st_uid
    except FileNotFoundError:  # a read-only root without the layout's directory: empty
        owner = me
    if owner != me:
        raise ConfigError(field, str(root),
                          f"a directory of this user's (uid {me}): {directory} belongs to uid "
                          f"{owner}, who could put chunk files in it that would be served "
                          f"as KV; give a directory this user owns (or creates)")
    real = Path(os.path.realpath(root))
    for above in (real, *real.parents):
        try:
            owner = os.stat(above, follow_symlinks=False).st_uid
        except FileNotFoundError:
            continue
        if owner not in (me, 0) and str(above) not in _warned_owners:
            _warned_owners.add(str(above))
            log.warning("%s %s: %s belongs to uid %d, who could replace the tier's directory "
                        "with one of their chunk files (served as KV): use a directory only "
                        "this user (uid %d) and root own, unless uid %d is trusted", field,
                        root, above, owner, me, owner)
            return


def _check(path: Path, read_only_ok: bool) -> None:
    """`check_directory`'s checks, on a thread of their own."""
    full = Path(os.path.abspath(path))
    real = Path(os.path.realpath(full))
    for kernel in KERNEL_FILESYSTEMS:
        if full.is_relative_to(kernel) or real.is_relative_to(kernel):
            raise ValueError(f"{kernel} is a kernel filesystem, not storage; {_FIX}")
    existing = full
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        what = "a file" if existing.is_file() else "not a directory"
        subject = "it is" if existing == full else f"{existing}, a parent of it, is"
        raise ValueError(f"not a directory: {subject} {what}; {_FIX}")
    if existing != full:  # to be created by the tier
        if not os.access(existing, os.W_OK | os.X_OK):
            raise ValueError(f"does not exist and cannot be created: {_denied(existing)}; "
                             f"{_FIX}")
        return
    if not os.access(full, os.R_OK | os.X_OK):
        raise ValueError(f"the directory is not readable by this user (uid {os.getuid()}); "
                         f"chmod/chown it or {_FIX}")
    if not read_only_ok and not os.access(full, os.W_OK):
        raise ValueError(f"the directory is not writable: {_denied(full)}; {_FIX}")


def _denied(directory: Path) -> str:
    """Why this process may not write in `directory` (an existing directory)."""
    try:
        read_only = bool(os.statvfs(directory).f_flag & os.ST_RDONLY)
    except OSError:
        read_only = False
    if read_only:
        return f"{directory} is on a read-only filesystem"
    return f"{directory} is not writable by this user (uid {os.getuid()})"
