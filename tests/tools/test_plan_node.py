"""`kvtier plan --node-engines N`: one kvtier node for N engines of a model, against N private
CPU tiers of the same bytes. Expected figures come from the model's shapes and the node's slab
layout (slots aligned to 4 KiB, a 32 B record per slot, a 64 B footer), worked out here."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from kvtier.errors import ConfigError
from kvtier.integrations.vllm.config import ConnectorConfig
from kvtier.node.config import NodeConfig
from kvtier.tiers.storeconfig import StoreConfig
from kvtier.tools.cli.main import main
from kvtier.tools.ops.hardware import gpu_profile
from kvtier.tools.ops.modelspec import load_model_spec
from kvtier.tools.ops.sizing import Plan, PlanRequest, make_plan

CONFIGS = Path(__file__).parents[1] / "data" / "configs"
GIB, MIB = 1024**3, 1024**2
# Llama-3-8B: 32 layers x 8 KV heads x 128 x (K, V) x 2 B (BF16) per token, on one rank.
LLAMA_8B_TOKEN_BYTES = 32 * 8 * 128 * 2 * 2


def req(model: str, **kw) -> PlanRequest:
    kw.setdefault("gpu", gpu_profile("h100"))
    kw.setdefault("vllm_version", (0, 21, 0))
    return PlanRequest(model=load_model_spec(CONFIGS / f"{model}.json"), **kw)


def node_of(plan: Plan):
    assert plan.node is not None
    return plan.node


def test_eight_engines_pool_their_private_tiers_into_one_slab():
    # A 1 TiB node, 8 engines at TP 1: each engine's share 128 GiB, 60% of it (the default
    # --host-kv-fraction) its private CPU tier, 76.8 GiB; the node holds the same bytes,
    # 8 x 76.8 = 614.4 GiB, in the one layout's slab (its /dev/shm grown to the whole RAM).
    plan = make_plan(req("llama-3-8b", node_engines=8, host_ram_bytes=1024 * GIB,
                         node_shm_bytes=1024 * GIB, context_tokens=8192, nvme_bytes=0))
    node = node_of(plan)
    assert plan.cpu_offload_gib == 76.8  # each engine's in-process commands get its share
    memory = json.loads(_flag(plan, "kvtier", "--kv-transfer-config"))
    assert memory["kv_connector_extra_config"]["tiers"] == [{"kind": "memory",
                                                             "capacity": "76.8GiB"}]
    assert (node.engines, node.layouts, node.gpus) == (8, 1, 8)
    assert node.node_config == {"tiers": [{"kind": "memory", "capacity": "614.4GiB"}]}
    slab = int(614.4 * GIB)
    assert node.slab_capacity_bytes == node.ram_tier_bytes == node.ram_tier_pooled_bytes == slab
    # 256-token chunks (the connector's default, a multiple of the 16-token block) of
    # 32 MiB, already 4 KiB-aligned: 614.4 GiB / 32 MiB = 19,660.8 slots -> 19,660.
    assert node.tokens_per_chunk == 256
    assert node.chunk_bytes == node.slot_bytes == 256 * LLAMA_8B_TOKEN_BYTES == 32 * MIB
    slots, private_slots = 19_660, 2_457  # 76.8 GiB / 32 MiB = 2,457.6
    assert node.slab_file_bytes == slots * (32 * MIB + 96 + 8) + 64  # a record, a stamp
    assert node.shm_bytes == node.slab_file_bytes
    assert node.shm_restart_bytes == 2 * node.shm_bytes
    assert node.pod_memory_bytes == node.shm_bytes + 16 * GIB
    # Unique prefixes: every slot is one chunk of 256 tokens; a session of 8,192 tokens is
    # 32 chunks. Private: one engine's tier. The gain is the upper bound (all shared).
    assert (node.pooled_tokens, node.private_tokens) == (slots * 256, private_slots * 256)
    assert (node.pooled_sessions, node.private_sessions) == (slots // 32, private_slots // 32)
    assert node.gain == pytest.approx(slots / private_slots) and 7.9 < node.gain < 8.1
    assert node.shm_bytes_wanted == 1024 * GIB and node.shm_bytes_given
    assert not any("/dev/shm" in n for n in node.notes if "warm restart" not in n)


def test_the_default_ram_tier_is_held_to_what_dev_shm_holds():
    # The same node with the default /dev/shm, half its RAM (512 GiB): the 614.4 GiB that the
    # private tiers would pool was node.yaml's capacity, and the node could not create the
    # slab (ENOSPC: every engine refused). The default is held to 90% of /dev/shm, and said.
    plan = make_plan(req("llama-3-8b", node_engines=8, host_ram_bytes=1024 * GIB,
                         context_tokens=8192, nvme_bytes=0))
    node = node_of(plan)
    assert node.shm_bytes_wanted == 512 * GIB and not node.shm_bytes_given
    assert any("/dev/shm is 512 GiB, half its RAM" in a for a in plan.assumptions)
    assert node.ram_tier_pooled_bytes == int(614.4 * GIB)
    room = 0.9 * 512 * GIB
    assert room - GIB < node.shm_bytes <= room  # the slab's file, records and all
    capacity = node.node_config["tiers"][0]["capacity"]
    assert int(float(capacity.removesuffix("GiB")) * GIB) == node.slab_capacity_bytes
    assert node.ram_tier_bytes == node.slab_capacity_bytes < node.ram_tier_pooled_bytes
    notes = " ".join(node.notes)
    assert "the node's RAM tier is held to " in notes and "10% of it left free" in notes
    assert "do not fit" not in notes
    # An explicit size (--from-sglang: each engine's tier) is kept; the notes say it does
    # not fit (and `kvtier node serve` refuses such a config: test_node_cli.py).
    explicit = node_of(make_plan(req("llama-3-8b", node_engines=8, host_ram_bytes=1024 * GIB,
                                     cpu_tier_bytes=int(76.8 * GIB), nvme_bytes=0)))
    assert explicit.ram_tier_bytes == explicit.ram_tier_pooled_bytes == int(614.4 * GIB)
    assert any("do not fit the node's /dev/shm" in n for n in explicit.notes)


def test_the_printed_configs_are_what_the_node_and_the_engines_accept(tmp_path):
    plan = make_plan(req("llama-3-8b", node_engines=2, host_ram_bytes=512 * GIB,
                         nvme_bytes=2 * 10**12, tokens_per_chunk=512,
                         node_socket="/run/kv/n.sock", model_ref="meta-llama/Llama-3.1-8B"))
    node = node_of(plan)
    # The node's config: RAM first (what `kvtier node serve` requires), then the disk tier,
    # 90% of the 2 TB drive for the one layout.
    NodeConfig(StoreConfig.parse(node.node_config), tmp_path / "node.sock")
    assert node.node_config["tiers"][1] == {"kind": "disk", "path": "/mnt/nvme/kvtier",
                                            "capacity": "1676.38GiB"}  # 1.8e12 B in GiB
    assert node.node_command == ("kvtier node serve --config node.yaml --socket "
                                 "/run/kv/n.sock --metrics-port 9400")
    assert node.engine_transfer_config is not None
    extra = node.engine_transfer_config["kv_connector_extra_config"]
    assert extra == {"node": "/run/kv/n.sock", "tokens_per_chunk": 512}
    assert ConnectorConfig.parse(extra).node == "/run/kv/n.sock"
    words = shlex.split(node.engine_command)
    assert words[:3] == ["vllm", "serve", "meta-llama/Llama-3.1-8B"]
    assert json.loads(words[words.index("--kv-transfer-config") + 1]) == \
        node.engine_transfer_config
    assert words[words.index("--tensor-parallel-size") + 1] == "1"
    assert words.count("--enable-prefix-caching") == 1
    assert node.tokens_per_chunk == 512 and node.chunk_bytes == 512 * LLAMA_8B_TOKEN_BYTES


@pytest.mark.parametrize("tp, layout_note", [(2, None), (4, "all 4 of the node's layouts"),
                                             (8, "its command sets --max-layouts 8")])
def test_each_tp_rank_is_a_layout_and_the_node_holds_four(tp, layout_note):
    # Llama-3-70B, 2 engines on a 2 TiB node: each engine's share 1 TiB, its tier 614.4 GiB
    # (all its ranks); pooled, 1228.8 GiB over `tp` layouts.
    plan = make_plan(req("llama-3-70b", tp=tp, node_engines=2, host_ram_bytes=2048 * GIB,
                         node_shm_bytes=2048 * GIB, nvme_bytes=0))
    node = node_of(plan)
    assert node.layouts == tp and node.gpus == 2 * tp
    capacity = 1228.8 / tp
    assert node.node_config["tiers"][0]["capacity"] == f"{capacity:g}GiB"
    assert node.shm_bytes == tp * node.slab_file_bytes
    notes = " ".join(node.notes)
    if layout_note is None:
        assert "layouts" not in notes
    else:
        assert layout_note in notes
    # The node it prints holds every rank's layout.
    assert ("--max-layouts" in node.node_command) == (tp > 4)
    if tp > 4:
        assert node.node_command.split()[-2:] == ["--max-layouts", str(tp)]


def test_dev_shm_checks_the_slabs_and_a_warm_restart():
    def notes(**kw) -> str:  # each engine's tier given (kept: the default is held to shm)
        plan = make_plan(req("llama-3-8b", node_engines=4, host_ram_bytes=512 * GIB,
                             cpu_tier_bytes=int(76.8 * GIB), nvme_bytes=0, **kw))
        return " ".join(node_of(plan).notes)

    shm = node_of(make_plan(req("llama-3-8b", node_engines=4, host_ram_bytes=512 * GIB,
                                node_shm_bytes=512 * GIB,
                                nvme_bytes=0))).shm_bytes  # 4 x 76.8 GiB and records
    assert "do not fit" in notes(node_shm_bytes=shm - 1)
    # Room for the slabs, not for a restarted node's new ones beside its predecessor's.
    between = notes(node_shm_bytes=shm)
    assert "do not fit" not in between and "warm restart needs" in between
    assert notes(node_shm_bytes=2 * shm) == ""
    assert "this machine's /dev/shm" in notes(node_shm_bytes=2 * shm, local_shm_bytes=shm - 1)
    assert notes(node_shm_bytes=2 * shm, local_shm_bytes=shm) == ""


def test_default_host_ram_is_the_nodes_gpus_and_each_engine_keeps_its_share():
    # 4 engines x TP 2 = 8 GPUs: 8 x 256 GiB; an engine's share is what a lone TP-2 plan
    # assumes, so its in-process tier is unchanged.
    alone = make_plan(req("llama-3-8b", tp=2))
    plan = make_plan(req("llama-3-8b", tp=2, node_engines=4))
    assert plan.host_ram_bytes == 8 * 256 * GIB == 4 * alone.host_ram_bytes
    assert plan.cpu_tier_bytes == alone.cpu_tier_bytes
    assert node_of(plan).ram_tier_pooled_bytes == pytest.approx(4 * alone.cpu_tier_bytes,
                                                                abs=GIB)
    assert any("x 4 engines x TP 2" in a for a in plan.assumptions)
    assert any("4 engines on the node" in n for n in plan.notes)
    assert alone.node is None


def test_a_model_kvtier_refuses_gets_no_node_commands():
    node = node_of(make_plan(req("nemotron-h-8b", node_engines=2)))
    assert node.refused and "kvtier refuses this model" in node.refused
    assert node.engine_command == "" and node.engine_transfer_config is None
    assert node.notes[0].startswith("no node for this model")


def test_state_layers_size_the_slots_by_their_chunks():
    # Qwen3-Next's chunks carry the states (chunkplan.py): a slot holds one such chunk.
    plan = make_plan(req("qwen3-next-80b-a3b", tp=4, node_engines=2, context_tokens=32768))
    node, chunks = node_of(plan), plan.chunks
    assert chunks is not None
    assert node.tokens_per_chunk == chunks.tokens_per_chunk
    assert node.chunk_bytes == chunks.chunk_bytes
    assert node.slot_bytes == -(-chunks.chunk_bytes // 4096) * 4096
    per_session = -(-32768 // chunks.tokens_per_chunk)
    assert node.pooled_sessions == node.slab_capacity_bytes // node.slot_bytes // per_session


@pytest.mark.parametrize("kw, option", [
    ({"node_engines": -1}, "--node-engines"),
    ({"node_engines": 2, "node_socket": "node.sock"}, "--node-socket"),
    ({"node_engines": 2, "node_shm_bytes": -1}, "--node-shm"),
])
def test_bad_node_values_name_the_option(kw, option):
    with pytest.raises(ConfigError, match=option):
        make_plan(req("llama-3-8b", **kw))


def test_cli_json_and_table(capsys):
    model = str(CONFIGS / "llama-3-8b.json")
    assert main(["plan", model, "--node-engines", "8", "--host-ram", "1TiB", "--node-shm",
                 "800GiB", "--vllm-version", "0.21.0", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)["node"]
    assert out["engines"] == 8 and out["max_layouts"] == 4 and out["node_shm_given"]
    assert out["node_shm_bytes"] == 800 * GIB
    assert out["ram_tier_bytes"] == int(614.4 * GIB)
    assert out["engine_kv_transfer_config"]["kv_connector_extra_config"] == {
        "node": "/run/kvtier/node.sock"}
    assert out["gain_upper_bound"] == pytest.approx(out["pooled_tokens"]
                                                    / out["private_tokens"])
    assert main(["plan", model, "--node-engines", "2", "--vllm-version", "0.21.0"]) == 0
    text = capsys.readouterr().out
    assert "kvtier node: 2 engine(s) x TP 1" in text
    assert "kvtier node serve --config node.yaml --socket /run/kvtier/node.sock" in text
    assert '"kv_connector_extra_config":{"node":"/run/kvtier/node.sock"}' in text


@pytest.mark.parametrize("argv, named", [
    (["--node-shm", "1GiB"], "--node-shm"),
    (["--node-socket", "/run/n.sock"], "--node-socket"),
    (["--node-engines", "2", "--node-shm", "lots"], "--node-shm"),
    (["--node-engines", "2", "--node-shm", "0"], "--node-shm"),
])
def test_cli_bad_node_options_exit_2_naming_them(capsys, argv, named):
    assert main(["plan", str(CONFIGS / "llama-3-8b.json"), *argv]) == 2
    err = capsys.readouterr().err
    assert named in err and err.count("\n") == 1


def test_cli_zero_engines_is_refused_by_the_parser(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["plan", str(CONFIGS / "llama-3-8b.json"), "--node-engines", "0"])
    assert exited.value.code == 2
    assert "argument --node-engines: '0': must be at least 1" in capsys.readouterr().err


def _flag(plan: Plan, alternative: str, name: str) -> str:
    flags = plan.alternative(alternative).flags
    return flags[flags.index(name) + 1]
