"""Every file of the repository an operator page names exists where it says: a reader sent to
a test, a module, a manifest or a script finds it. configuration.md once sent readers to
tests/engine/test_prometheus_scrape.py (it is in tests/tools/), and s3.md to s3_config.py,
s3_client.py and s3_inventory.py (the s3 tier's modules are config.py, client.py and
inventory.py)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = ("README.md", "docs/configuration.md", "docs/deploy.md", "docs/node.md",
         "docs/sharing.md", "docs/s3.md", "docs/retention.md")
# A path in the repository: one of its top folders, then names up to a file's extension or a
# folder's closing "/" (`kubectl rollout status deploy/NAME` names no file).
REPO_PATH = re.compile(r"(?<![\w./~-])((?:tests|src|scripts|deploy|docs)/[\w./-]*?(?:\.\w+|/))"
                       r"(?![\w/-])")
MODULE = re.compile(r"`(\w+\.py)`")


@pytest.mark.parametrize("page", PAGES)
def test_every_repository_path_a_page_names_exists(page: str) -> None:
    named = set(REPO_PATH.findall((ROOT / page).read_text()))
    assert named, "the pattern finds the page's paths"
    assert {path for path in named if not (ROOT / path).exists()} == set()


@pytest.mark.parametrize("page", PAGES)
def test_every_module_a_page_names_by_its_file_name_exists(page: str) -> None:
    files = {path.name for folder in ("src", "tests", "scripts", "deploy")
             for path in (ROOT / folder).rglob("*.py")}
    named = set(MODULE.findall((ROOT / page).read_text()))
    assert named - files == set()
