"""A temp dir of their own for the vLLM engines kvtier starts for its tests and benchmarks,
removed with them.

vLLM (0.32) puts each engine's rendezvous file in the temp dir, `vllm_dist_<uuid>` (2.4 KB,
`get_file_store_init_method` in vllm/utils/network_utils.py). Torch's FileStore removes it
only when every rank's store is destroyed, which an engine whose processes are killed never
does: every OpenAI server stopped (vLLM force-kills its engine core), a worker a test kills,
an engine core slow to exit. About 40 stayed in /tmp after a suite run. Such a file names no
process, and another engine's (another run's) may be live beside it: an engine's is told
apart by where it is, a folder of the engine's own that TMPDIR names for its processes (and
Python's cached temp dir names while an engine is built in this process), removed once the
engine has ended. What else vLLM makes in its temp dir goes with it (a server with several
API processes: its Prometheus folder, a `tmpXXXXXXXX` that a kill leaves).

A server kvtier starts (`kvtier serve` included) gets the same, from
kvtier.tools.ops.server, unless it loads its weights from vLLM's weight cache daemon: vLLM
looks for the daemon's socket in the temp dir it shares with the host.

Primitives: `own_temp_dir` (the folder, removed at exit), `temp_dir_named` (this process's
and its children's temp dir, for a block).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

PREFIX = "kvtier-vllm-"  # the folders' names in the temp dir


@contextlib.contextmanager
def own_temp_dir() -> Iterator[Path]:
    """A new folder in the temp dir, removed with what is in it at exit (whatever ended the
    block). Call it where the engine's processes have ended by then."""
    folder = Path(tempfile.mkdtemp(prefix=PREFIX))
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@contextlib.contextmanager
def temp_dir_named(folder: Path) -> Iterator[None]:
    """The temp dir is `folder` inside the block: for this process (`tempfile`'s cached one:
    set once, it ignores TMPDIR) and for the processes it starts meanwhile (TMPDIR, and the
    cached one a forked child inherits). Both as they were afterwards. Another thread's temp
    files made meanwhile go there too."""
    saved_env, saved_cached = os.environ.get("TMPDIR"), tempfile.tempdir
    os.environ["TMPDIR"] = tempfile.tempdir = str(folder)
    try:
        yield
    finally:
        tempfile.tempdir = saved_cached
        if saved_env is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = saved_env
