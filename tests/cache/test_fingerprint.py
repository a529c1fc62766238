"""The model fingerprint: the same checkpoint anywhere agrees, a changed one never does.

Scenarios on tiny checkpoints written by hand (safetensors: an 8-byte little-endian header
length, a JSON header, the tensor bytes) in a temp dir.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

from kvtier.core.fingerprint import model_fingerprint, weights_digest

CONFIG = {"model_type": "llama", "num_hidden_layers": 2, "num_key_value_heads": 2,
          "hidden_size": 64, "rope_theta": 10000.0, "_name_or_path": "/models/tiny",
          "transformers_version": "4.57.0"}


def write_safetensors(path: Path, tensors: dict[str, bytes], metadata: str = "pt") -> None:
    header: dict[str, object] = {"__metadata__": {"format": metadata}}
    offset = 0
    for name, data in tensors.items():
        header[name] = {"dtype": "F32", "shape": [len(data) // 4],
                        "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"".join(tensors.values()))


def floats(seed: float, n: int = 2048) -> bytes:
    return struct.pack(f"<{n}f", *(seed + i for i in range(n)))


def make_model(root: Path, seed: float = 1.0, config: dict[str, object] | None = None) -> Path:
    root.mkdir(parents=True)
    write_safetensors(root / "model-00001-of-00002.safetensors",
                      {"embed": floats(seed), "layer0.k": floats(seed + 1)})
    write_safetensors(root / "model-00002-of-00002.safetensors", {"layer1.k": floats(seed + 2)})
    (root / "config.json").write_text(json.dumps(config or CONFIG))
    return root


def fingerprint(model: Path) -> str:
    config = json.loads((model / "config.json").read_text())
    return model_fingerprint(model, config, dtype="float32").digest


def test_the_same_weights_at_two_paths_agree(tmp_path: Path) -> None:
    here = make_model(tmp_path / "node-a" / "tiny")
    there = tmp_path / "elsewhere" / "copy"
    shutil.copytree(here, there)
    # The config's own path differs too (HF writes _name_or_path): not a KV input.
    config = json.loads((there / "config.json").read_text())
    (there / "config.json").write_text(json.dumps(config | {"_name_or_path": str(there)}))
    assert fingerprint(here) == fingerprint(there)
    assert model_fingerprint(here, CONFIG).weight_files == 2


def test_a_later_mtime_changes_nothing(tmp_path: Path) -> None:
    model = make_model(tmp_path / "tiny")
    before = fingerprint(model)
    for file in model.iterdir():
        os.utime(file, (1_900_000_000, 1_900_000_000))
    assert fingerprint(model) == before


def test_a_changed_safetensors_header_changes_the_fingerprint(tmp_path: Path) -> None:
    model = make_model(tmp_path / "tiny")
    before = fingerprint(model)
    write_safetensors(model / "model-00002-of-00002.safetensors", {"layer1.k": floats(3.0)},
                      metadata="pt2")
    assert fingerprint(model) != before


def test_weights_overwritten_in_place_with_the_same_shapes_change_the_fingerprint(
        tmp_path: Path) -> None:
    model = make_model(tmp_path / "tiny")
    before = fingerprint(model)
    shutil.rmtree(model)
    make_model(model, seed=7.0)  # same names, shapes and header bytes: new values
    assert fingerprint(model) != before


def test_a_rope_theta_change_in_the_config_changes_the_fingerprint(tmp_path: Path) -> None:
    model = make_model(tmp_path / "tiny")
    other = make_model(tmp_path / "tiny-long", config=CONFIG | {"rope_theta": 500000.0})
    assert fingerprint(model) != fingerprint(other)


def test_revision_dtype_and_quantization_are_part_of_it(tmp_path: Path) -> None:
    model = make_model(tmp_path / "tiny")
    base = model_fingerprint(model, CONFIG).digest
    assert model_fingerprint(model, CONFIG, revision="abc").digest != base
    assert model_fingerprint(model, CONFIG, dtype="bfloat16").digest != base
    assert model_fingerprint(model, CONFIG, quantization="fp8").digest != base


def test_engine_settings_are_part_of_it_and_none_keeps_the_old_digest(tmp_path: Path) -> None:
    model = make_model(tmp_path / "tiny")
    base = model_fingerprint(model, CONFIG).digest
    assert model_fingerprint(model, CONFIG, settings={}).digest == base
    long = model_fingerprint(model, CONFIG, settings={"longrope": "long"}).digest
    short = model_fingerprint(model, CONFIG, settings={"longrope": "short"}).digest
    assert len({base, long, short}) == 3


def test_other_families_activations_and_routing_are_part_of_it(tmp_path: Path) -> None:
    """Keys of other model families that change the KV with the same weights (GPT-2's
    activation_function, Gemma's hidden_activation, DeepSeek's routing, GPT-J's rotary_dim),
    edited at one path."""
    model = make_model(tmp_path / "tiny")
    for key, before, after in [("activation_function", "gelu_new", "relu"),
                               ("hidden_activation", "gelu_pytorch_tanh", "gelu"),
                               ("routed_scaling_factor", 2.5, 1.0),
                               ("norm_topk_prob", True, False),
                               ("rotary_dim", 64, 32),  # GPT-J's partial RoPE
                               ("rope_local_base_freq", 10000.0, 1e6),  # sliding layers' RoPE
                               ("key_multiplier", 1.0, 0.5)]:  # Falcon-H1's K scale
        assert (model_fingerprint(model, CONFIG | {key: before}).digest
                != model_fingerprint(model, CONFIG | {key: after}).digest), key
    assert model_fingerprint(model, CONFIG).digest == model_fingerprint(
        model, CONFIG | {"final_logit_softcapping": 30.0}).digest  # the logits only


def test_a_multimodal_models_language_config_is_part_of_it(tmp_path: Path) -> None:
    """The language model's config of InternVL (llm_config), others (language_config) and
    Qwen2.5-Omni (thinker_config.text_config): an edit inside them at one path was not seen;
    a model with none of them keeps its digest."""
    model = make_model(tmp_path / "tiny")
    def nested(outer: str, inner: str | None, act: str) -> dict[str, object]:
        block = {"hidden_act": act, "rope_theta": 10000.0}
        return CONFIG | {outer: {inner: block} if inner else block}

    for outer, inner in [("llm_config", None), ("language_config", None),
                         ("thinker_config", "text_config")]:
        assert (model_fingerprint(model, nested(outer, inner, "silu")).digest
                != model_fingerprint(model, nested(outer, inner, "gelu")).digest), outer
    assert model_fingerprint(model, CONFIG).digest == model_fingerprint(
        model, CONFIG | {"vision_config": {"hidden_act": "gelu"}}).digest


def test_what_vllm_writes_into_a_language_sub_config_as_it_builds_the_model_changes_nothing(
        tmp_path: Path) -> None:
    """vLLM's Qwen3-Omni thinker sets thinker_config.architectures to the model's as each
    worker builds the model: a tensor-parallel engine's scheduler (which never builds it) and
    its workers must still agree on the digest (the storage namespace)."""
    model = make_model(tmp_path / "tiny")
    scheduler = CONFIG | {"architectures": ["Qwen3OmniMoeForConditionalGeneration"],
                          "thinker_config": {"architectures": None, "hidden_act": "silu",
                                             "text_config": {"hidden_act": "silu"}}}
    worker = json.loads(json.dumps(scheduler))
    worker["thinker_config"]["architectures"] = worker["architectures"]
    assert model_fingerprint(model, scheduler).digest == model_fingerprint(model, worker).digest


def test_pickled_checkpoints_are_sampled_at_both_ends(tmp_path: Path) -> None:
    model = tmp_path / "old"
    model.mkdir()
    (model / "pytorch_model.bin").write_bytes(b"\0" * (3 << 20))
    before = weights_digest(model)
    with open(model / "pytorch_model.bin", "r+b") as f:
        f.seek((3 << 20) - 10)
        f.write(b"x")
    after = weights_digest(model)
    assert before is not None and after is not None and before != after


def test_a_model_not_on_disk_is_fingerprinted_by_what_is_known(tmp_path: Path) -> None:
    assert weights_digest(tmp_path / "missing") is None
    assert weights_digest(tmp_path) is None  # a directory without checkpoint files
    hub = model_fingerprint(None, CONFIG, revision="main")
    assert hub.weight_files == 0
    assert hub.digest == model_fingerprint(None, CONFIG, revision="main").digest
    assert hub.digest != model_fingerprint(None, CONFIG, revision="v2").digest


def test_any_key_of_the_checkpoints_config_file_edited_in_place_changes_it(
        tmp_path: Path) -> None:
    """A key no list names (a trust_remote_code model's own scale, a family's RoPE name the
    list lacked: GPT-J's rotary_dim was one) is read from config.json by the model's code: an
    edit in place at the same path, same weights, must not be served the old KV."""
    model = make_model(tmp_path / "tiny", config=CONFIG | {"my_attention_scale": 1.0})
    before = fingerprint(model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps(config | {"my_attention_scale": 0.5}))
    assert fingerprint(model) != before


def test_a_config_file_saved_again_elsewhere_or_reformatted_changes_nothing(
        tmp_path: Path) -> None:
    """Key order, whitespace, where it was saved from and by which transformers: not KV."""
    model = make_model(tmp_path / "tiny")
    before = fingerprint(model)
    config = json.loads((model / "config.json").read_text())
    resaved = dict(reversed(list(config.items()))) | {"_name_or_path": "/elsewhere",
                                                      "transformers_version": "5.1.0"}
    (model / "config.json").write_text(json.dumps(resaved, indent=2))
    assert fingerprint(model) == before
    (model / "params.json").write_text(json.dumps({"dim": 64, "n_layers": 2}))  # Mistral's
    with_params = fingerprint(model)
    assert with_params != before
    (model / "params.json").write_text(json.dumps({"dim": 64, "n_layers": 4}))
    assert fingerprint(model) != with_params
