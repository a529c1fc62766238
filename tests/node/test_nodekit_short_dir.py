"""The node tests' short socket directory (nodekit.short_dir, for a --basetemp too long for an
AF_UNIX path) is removed by the process's exit: the engine tests' module fixtures that take
one never removed it, and a kvn-* stayed in /tmp after each of their runs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = """import sys
from pathlib import Path
sys.path[:0] = [sys.argv[1], sys.argv[2]]
from nodekit import short_dir
long_basetemp = Path(sys.argv[3], "x" * 120)
directory = short_dir(long_basetemp)
assert directory.is_dir() and len(str(directory / "node.sock")) < 100
print(directory)
"""


def test_a_short_directory_is_gone_when_the_process_ends(tmp_path: Path) -> None:
    tests = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(tests), str(tests / "node"),
                           str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    directory = Path(done.stdout.strip())
    assert directory.name.startswith("kvn-")
    assert not directory.exists()
