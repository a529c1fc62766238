"""`kvtier inspect` and `kvtier gc` on a disk tier's directory while a running engine owns it
(its lock held: tiers/files/owner.py). They read and remove through inventories and never open
the tier, so they work beside the engine, which sees what gc removed, and they leave its lock
alone: another engine's open is still refused."""

from __future__ import annotations

from pathlib import Path

import pytest
from clikit import by_namespace, cli_json
from storekit import write_config
from tierkit import key, tiny_layout

from kvtier.errors import DirectoryInUse
from kvtier.tiers import build_tier
from kvtier.tiers.storeconfig import StoreConfig

LAYOUT = tiny_layout()


def test_inspect_and_gc_work_beside_the_engine_that_owns_the_directory(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = write_config(tmp_path, {"kind": "disk", "path": str(tmp_path / "disk"),
                                     "capacity": "64MiB"})
    settings = StoreConfig.load(config).tiers[1]
    engine = build_tier(settings, LAYOUT)  # the running engine's disk tier
    for i in range(4):
        assert engine.put(key(i), memoryview(bytes([i]) * LAYOUT.bytes_per_chunk))
    with pytest.raises(DirectoryInUse):
        build_tier(settings, LAYOUT)
    namespace = LAYOUT.digest()

    report = by_namespace(cli_json(capsys, "inspect", "--config", str(config)))
    assert set(report) == {namespace} and report[namespace]["chunks"] == 4
    out = cli_json(capsys, "gc", "--config", str(config), "--namespace", namespace)
    assert [(o["removed_chunks"], o["kept_chunks"]) for o in out["outcomes"]] == [(4, 0)]
    assert not any(engine.contains(key(i)) for i in range(4))
    assert by_namespace(cli_json(capsys, "inspect", "--config", str(config))) == {}

    with pytest.raises(DirectoryInUse):  # gc left the owner's lock alone
        build_tier(settings, LAYOUT)
    engine.close()
    build_tier(settings, LAYOUT).close()
