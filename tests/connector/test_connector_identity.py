"""The connector's model identity for the keys' namespace: a checkpoint on disk is named by its
fingerprint (not its path), a model kvtier cannot find on disk by its name and what is known.

Drives `scheduler_model_identity` with a stand-in for vLLM's config (only the fields it reads).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm")

from kvtier.integrations.vllm.connector import scheduler_model_identity


def vllm_config(model: str, config: dict[str, Any]) -> Any:
    model_config = SimpleNamespace(
        model=model, revision=None, code_revision=None, quantization=None, dtype="bfloat16",
        hf_config=SimpleNamespace(to_dict=lambda: config))
    return SimpleNamespace(model_config=model_config,
                           load_config=SimpleNamespace(download_dir=None))


def checkpoint(root: Path) -> Path:
    root.mkdir(parents=True)
    header = json.dumps({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}).encode()
    (root / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header
                                             + b"\1" * 16)
    return root


def test_a_checkpoint_on_disk_is_named_by_content_not_path(tmp_path: Path) -> None:
    config = {"model_type": "llama", "rope_theta": 10000.0}
    a_id, a = scheduler_model_identity(vllm_config(str(checkpoint(tmp_path / "a")), config))
    b_id, b = scheduler_model_identity(vllm_config(str(checkpoint(tmp_path / "b")), config))
    assert (a_id, a) == (b_id, b) == ("", a)
    assert a.weight_files == 1


def test_a_model_not_on_disk_keeps_its_name_in_the_namespace() -> None:
    model_id, fingerprint = scheduler_model_identity(
        vllm_config("kvtier-tests/no-such-model", {"model_type": "llama"}))
    assert model_id == "kvtier-tests/no-such-model"
    assert fingerprint.weight_files == 0
