"""The connector's model identity for the keys' namespace: a checkpoint on disk is named by its
fingerprint (not its path), a model kvtier cannot find on disk by its name and what is known.

Engine settings that change the KV without touching the config or the files (`kv_settings`):
which LongRoPE factors --max-model-len selects, --load-format dummy.

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
from kvtier.integrations.vllm.kvsettings import kv_settings


def vllm_config(model: str, config: dict[str, Any], max_model_len: int = 2048,
                load_format: str = "auto") -> Any:
    model_config = SimpleNamespace(
        model=model, revision=None, code_revision=None, quantization=None, dtype="bfloat16",
        hf_config=SimpleNamespace(to_dict=lambda: config),
        hf_text_config=SimpleNamespace(**config), max_model_len=max_model_len)
    return SimpleNamespace(model_config=model_config,
                           load_config=SimpleNamespace(download_dir=None,
                                                       load_format=load_format))


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


LONGROPE = {"model_type": "phi3", "original_max_position_embeddings": 1024,
            "rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0,
                                "short_factor": [1.0] * 4, "long_factor": [4.0] * 4,
                                "original_max_position_embeddings": 1024}}


def test_longrope_engines_on_either_side_of_the_original_length_never_share(
        tmp_path: Path) -> None:
    """vLLM rotates every position by LongRoPE's long factors when max_model_len exceeds
    original_max_position_embeddings, by the short ones otherwise: other KV, one checkpoint."""
    model = str(checkpoint(tmp_path / "phi"))

    def fingerprint(max_model_len: int, config: dict[str, Any] = LONGROPE) -> str:
        return scheduler_model_identity(vllm_config(model, config, max_model_len))[1].digest

    assert fingerprint(1024) == fingerprint(512)  # short factors both
    assert fingerprint(4096) == fingerprint(2048)  # long factors both
    assert fingerprint(1024) != fingerprint(1025)
    # Per layer type (nested), and the legacy rope_scaling {"type": "su"}, alike.
    nested = LONGROPE | {"rope_parameters": {"full_attention": LONGROPE["rope_parameters"]}}
    assert fingerprint(1024, nested) != fingerprint(2048, nested)
    legacy = {"model_type": "phi3", "original_max_position_embeddings": 1024,
              "rope_scaling": {"type": "su", "short_factor": [1.0], "long_factor": [2.0]}}
    assert kv_settings(vllm_config(model, legacy, 1024)) == {"longrope": "short"}
    assert kv_settings(vllm_config(model, legacy, 2048)) == {"longrope": "long"}


def test_other_models_keep_their_fingerprint_whatever_the_max_model_len(tmp_path: Path) -> None:
    model = str(checkpoint(tmp_path / "llama"))
    config = {"model_type": "llama", "rope_parameters": {"rope_type": "default",
                                                         "rope_theta": 10000.0}}
    assert kv_settings(vllm_config(model, config, 1024)) == {}
    assert (scheduler_model_identity(vllm_config(model, config, 1024))
            == scheduler_model_identity(vllm_config(model, config, 4096)))


def test_dummy_weights_never_share_with_the_checkpoint_on_disk(tmp_path: Path) -> None:
    model = str(checkpoint(tmp_path / "m"))
    config = {"model_type": "llama"}
    real = scheduler_model_identity(vllm_config(model, config))[1]
    safetensors = scheduler_model_identity(vllm_config(model, config,
                                                       load_format="safetensors"))[1]
    dummy = scheduler_model_identity(vllm_config(model, config, load_format="dummy"))[1]
    assert real == safetensors
    assert dummy.digest != real.digest


def test_an_engine_loading_pt_files_is_fingerprinted_by_them(tmp_path: Path) -> None:
    """--load-format pt reads a directory's *.pt files even where safetensors files sit
    beside them: those it loads name the model, not the safetensors ones."""
    model = checkpoint(tmp_path / "both")
    config = {"model_type": "llama"}
    (model / "model.pt").write_bytes(b"\1" * 64)

    def fingerprint(load_format: str) -> str:
        return scheduler_model_identity(vllm_config(str(model), config,
                                                    load_format=load_format))[1].digest

    safetensors, pt = fingerprint("auto"), fingerprint("pt")
    assert safetensors != pt
    (model / "model.pt").write_bytes(b"\2" * 64)  # new .pt weights, the same safetensors
    assert fingerprint("auto") == safetensors
    assert fingerprint("pt") not in (pt, safetensors)


def test_llama4_temperature_tuning_as_vllm_decides_it(tmp_path: Path) -> None:
    """vLLM scales Llama 4's NoPE queries by position when max_model_len > 32768, unless the
    generation config or --override-generation-config says otherwise."""
    model = str(checkpoint(tmp_path / "scout"))
    config = {"model_type": "llama4", "architectures": ["Llama4ForConditionalGeneration"]}

    def tuning(max_model_len: int, generation: dict[str, Any] | None = None,
               override: dict[str, Any] | None = None) -> str:
        engine = vllm_config(model, config, max_model_len)
        engine.model_config.hf_config.architectures = config["architectures"]
        engine.model_config.try_get_generation_config = lambda: dict(generation or {})
        engine.model_config.override_generation_config = override or {}
        return kv_settings(engine)["attn_temperature_tuning"]

    assert (tuning(32768), tuning(65536)) == ("off", "on")
    assert tuning(65536, {"attn_temperature_tuning": False}) == "off"
    assert tuning(8192, {"attn_temperature_tuning": False},
                  {"attn_temperature_tuning": True}) == "on"
    assert "attn_temperature_tuning" not in kv_settings(vllm_config(model, {}, 65536))
    # --max-model-len -1: built at the config's length (tuning on), then fitted to memory
    # (32768 after the profile): still on.
    fitted = vllm_config(model, config, 32768)
    fitted.model_config.hf_config.architectures = config["architectures"]
    fitted.model_config.try_get_generation_config = dict
    fitted.model_config.override_generation_config = {}
    fitted.model_config.original_max_model_len = -1
    fitted.model_config.get_and_verify_max_len = lambda _length: 131072
    assert kv_settings(fitted)["attn_temperature_tuning"] == "on"
