"""The files a node holds on its host, outside its stores: its name's lock and its RAM slabs in
/dev/shm, and its socket's file. A node's name is its slabs' names, and its socket the
engines' one way in: each is checked here before the node takes it, so that two nodes never
share a slab and a node never binds over a live one.

Primitives: `hold_name`, `let_go_of_name`, `slabs_of`, `clear_stale_socket`.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
import socket
import stat
from pathlib import Path

from kvtier.tiers.shmslab import SHM_DIR, holder_of, is_own_file

SLAB_DIGEST = re.compile(r"[0-9a-f]{16}")  # a slab's name: kvtier-<node>-<its layout's>
STALE_PROBE_S = 2.0  # how long a socket file's probe waits for a node to accept


def hold_name(name: str) -> int:
    """Hold the lock of node name `name` on this host (/dev/shm/kvtier-<name>.lock, an flock
    held as long as the node runs, which the kernel drops when it ends): a node's name is its
    slabs' names, and two nodes of one name would lend each other's slots. The lock's fd.

    Raises:
        OSError: EBUSY, a node of that name runs; EACCES, another user's file (or a link,
            a directory) holds the lock's name and this node may not remove it; no /dev/shm.
    """
    path = SHM_DIR / f"kvtier-{name}.lock"
    while True:
        _clear_foreign(path)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        opened = os.fstat(fd)
        if opened.st_uid != os.geteuid() or not stat.S_ISREG(opened.st_mode):
            os.close(fd)  # another's, planted since `_clear_foreign`
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise OSError(errno.EBUSY, f"a kvtier node named {name!r} is running on this host "
                                       f"(it holds {path}): give each node its own "
                                       "--name") from None
        except BaseException:
            os.close(fd)
            raise
        try:
            held = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            held = False
        if held:
            return fd
        os.close(fd)  # a node that stopped meanwhile removed it: the path's file now


def _clear_foreign(path: Path) -> None:
    """Remove what another user (or a link, a directory) holds at the lock's name, when this
    node may (root may, in sticky /dev/shm): any user of the host may create it first, and
    one who held its flock had every node of that name refused as "running"
    (tests/node/test_node_slab_squatted.py).

    Raises:
        OSError: EACCES, it stays (naming it and its owner).
    """
    if is_own_file(path):
        return
    try:
        path.lstat()
    except FileNotFoundError:
        return
    holder = holder_of(path)
    try:
        if path.is_dir() and not path.is_symlink():
            path.rmdir()
        else:
            path.unlink()
    except FileNotFoundError:
        return
    except OSError as exc:
        raise OSError(errno.EACCES, f"{path}, this node's name's lock, is held by {holder}, "
                                    f"which this node may not remove ({exc.strerror}): "
                                    "remove it, or give the node another --name") from exc


def let_go_of_name(name: str, fd: int) -> None:
    """Remove the name's lock file, then drop the lock (so a node that opened the file before
    it went finds, once it holds the lock, that the path names another file: `hold_name`)."""
    with contextlib.suppress(FileNotFoundError):
        (SHM_DIR / f"kvtier-{name}.lock").unlink()
    os.close(fd)


def slabs_of(name: str, aside: bool = False) -> list[Path]:
    """The RAM slabs of nodes named `name` in /dev/shm (kvtier-<name>-<layout>; not those of
    a node whose name only starts like it), and with `aside` those a successor moved aside
    (<slab>.old, until recovered)."""
    prefix = f"kvtier-{name}-"
    return [path for path in sorted(SHM_DIR.glob(prefix + "*"))
            if SLAB_DIGEST.fullmatch(path.name.removeprefix(prefix).removesuffix(
                ".old" if aside else ""))]


def clear_stale_socket(path: Path) -> None:
    """Remove a socket file a dead node left; refuse to start beside a live one, or over a
    file that is not a socket.

    Raises:
        OSError: EADDRINUSE, a node answers there (or accepts and does not answer: stopped);
            EEXIST, a file that is not a socket.
    """
    try:
        found = path.lstat()
    except FileNotFoundError:
        path.parent.mkdir(parents=True, exist_ok=True)
        return
    if not stat.S_ISSOCK(found.st_mode):
        raise OSError(errno.EEXIST, f"{path} exists and is not a socket: not replaced")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(STALE_PROBE_S)  # a stopped node's full queue would block a connect
    try:
        probe.connect(str(path))
    except ConnectionRefusedError:  # no one listens: a dead node's file
        path.unlink()
        return
    except (TimeoutError, BlockingIOError) as exc:  # its queue full: not accepting
        raise OSError(errno.EADDRINUSE, f"a process listens on {path} and does not accept "
                                        "(a kvtier node stopped?)") from exc
    finally:
        probe.close()
    raise OSError(errno.EADDRINUSE, f"a kvtier node is already listening on {path}")
