"""Fault drill: `group_shared` between two real users of one group (issue 12, item 4).

The administrator makes the cache root setgid and owned by the cache group, so that
everything created below it belongs to that group. kvtier's explicit chmod(0o770) of each
directory it created cleared the setgid bit the kernel had inherited, so the files below fell
into the writer's primary group and the other members of the group could not read them.

The test creates a group and two users (each with its own primary group, both members of the
cache group), then runs a writer as one user and a reader-and-writer as the other, each a
real process that drops root privileges after importing kvtier (the interpreter lives under
/root, which those users cannot read). Needs root and useradd: skipped otherwise.
"""

from __future__ import annotations

import grp
import json
import os
import pwd
import shutil
import stat
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("useradd") is None,
    reason="needs root and useradd/groupadd to create two users in one group")

CHILD = r"""
import json, os, sys
from kvtier.core.keys import ChunkKey
from kvtier.core.layout import KVLayout
from kvtier.tiers import build_tier
import kvtier.tiers.files.shared  # imported before dropping root: /root is not readable after
from kvtier.tiers.storeconfig import StoreConfig
root, user, group, keys = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4:]
import pwd
entry = pwd.getpwnam(user)
os.setgroups([group])
os.setgid(entry.pw_gid)
os.setuid(entry.pw_uid)
os.umask(0o022)
layout = KVLayout(num_layers=1, num_kv_heads=1, head_size=64, dtype="float16",
                  tokens_per_chunk=16)
config = StoreConfig.parse({"tiers": [{"kind": "shared", "path": root, "capacity": "1MiB",
                                       "group_shared": True}]})
tier = build_tier(config.tiers[0], layout)
report = {}
for spec in keys:
    verb, k = spec.split(":")
    key = ChunkKey(bytes.fromhex(k))
    data = bytes([key[0]]) * layout.bytes_per_chunk
    if verb == "put":
        report[spec] = tier.put(key, memoryview(data)).failure
    else:
        out = bytearray(layout.bytes_per_chunk)
        result = tier.get_into(key, memoryview(out))
        report[spec] = result.failure if not result else (None if out == data else "wrong")
print(json.dumps(report))
"""


def _run(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True, text=True)


@pytest.fixture
def two_users() -> Iterator[tuple[str, str, int]]:
    """(user a, user b, gid of their shared group), removed afterwards."""
    suffix = uuid.uuid4().hex[:8]
    group, users = f"kvtg{suffix}", [f"kvta{suffix}", f"kvtb{suffix}"]
    _run("groupadd", group)
    try:
        for user in users:
            _run("useradd", "-M", "-U", "-G", group, "-s", "/usr/sbin/nologin", user)
        yield users[0], users[1], grp.getgrnam(group).gr_gid
    finally:
        for user in users:
            subprocess.run(["userdel", user], capture_output=True)
        subprocess.run(["groupdel", group], capture_output=True)


def _as_user(root: Path, user: str, gid: int, *specs: str) -> dict[str, str | None]:
    done = subprocess.run([sys.executable, "-c", CHILD, str(root), user, str(gid), *specs],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def test_two_users_of_one_group_share_chunks_under_a_setgid_root(
        two_users: tuple[str, str, int]) -> None:
    user_a, user_b, gid = two_users
    base = Path(tempfile.mkdtemp(prefix="kvtier-group-", dir="/tmp"))
    try:
        os.chmod(base, 0o755)  # traversable by the two users (pytest's tmp_path is not)
        root = base / "cache"
        root.mkdir()
        os.chown(root, 0, gid)
        os.chmod(root, 0o2770)  # the administrator's setup: setgid, the cache group
        k1, k2 = "11" * 16, "22" * 16  # different shard directories
        assert _as_user(root, user_a, gid, f"put:{k1}") == {f"put:{k1}": None}
        # b reads a's chunk, and writes into the directories a created.
        assert _as_user(root, user_b, gid, f"get:{k1}", f"put:{k1[:30]}ff") == {
            f"get:{k1}": None, f"put:{k1[:30]}ff": None}
        assert _as_user(root, user_b, gid, f"put:{k2}") == {f"put:{k2}": None}
        assert _as_user(root, user_a, gid, f"get:{k2}") == {f"get:{k2}": None}
        for path in [root, *root.rglob("*")]:
            info = path.lstat()
            assert info.st_gid == gid, f"{path} is in group {info.st_gid}, not the cache group"
            if stat.S_ISDIR(info.st_mode):
                assert info.st_mode & stat.S_ISGID, f"{path} lost its setgid bit"
                assert stat.S_IMODE(info.st_mode) & 0o770 == 0o770
        owners = {pwd.getpwuid(p.lstat().st_uid).pw_name for p in root.rglob("*.kvc")}
        assert owners == {user_a, user_b}
    finally:
        shutil.rmtree(base, ignore_errors=True)
