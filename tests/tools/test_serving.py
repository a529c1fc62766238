"""`kvtier serve`'s command line, tier sizing, config files, and the server subprocess helper.

The subprocess tests run a stand-in server (a Python script that answers /health on
127.0.0.1 and starts a child process, as vLLM starts its engine core), so that "stop kills
the whole process group" is checked on real processes without starting vLLM.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
import textwrap
import time
from pathlib import Path

import pytest

from kvtier.errors import ConfigError, ServerError
from kvtier.integrations.vllm.config import ConnectorConfig
from kvtier.tools.cli.main import build_parser, main
from kvtier.tools.ops.server import free_port, running_server
from kvtier.tools.ops.serving import (
    GIB,
    ServeCommand,
    ServeConfig,
    build_command,
    connector_config,
    default_tiers,
    is_cpu_backend,
    load_connector_config,
)

CONFIGS = Path(__file__).parents[1] / "data" / "configs"
TIERS = [{"kind": "memory", "capacity": "2GiB"},
         {"kind": "disk", "path": "/tmp/kv", "capacity": "10GiB"}]


def flag(argv: tuple[str, ...], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


def test_kvtier_command_carries_the_exact_connector_schema():
    cmd = build_command(ServeConfig("m", extra_config=connector_config(TIERS), cpu=False,
                                    port=9000, vllm_args=("--max-model-len", "4096")))
    assert cmd.argv[1:5] == ("-m", "vllm.entrypoints.openai.api_server", "--model", "m")
    assert flag(cmd.argv, "--host") == "127.0.0.1" and flag(cmd.argv, "--port") == "9000"
    assert json.loads(flag(cmd.argv, "--kv-transfer-config")) == {
        "kv_connector": "KVTierConnector", "kv_connector_module_path": "kvtier.integrations.vllm",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"tiers": TIERS}}  # tokens_per_chunk: the connector's
    assert cmd.argv[-2:] == ("--max-model-len", "4096")  # user's args last, verbatim
    assert "--kv-cache-memory-bytes" not in cmd.argv  # GPU: vLLM's own default is fine
    assert cmd.url == "http://127.0.0.1:9000" and "--kv-transfer-config" in cmd.display()
    # Clients' cache_control markers become pins (tests/tools/test_cache_control_e2e.py).
    assert flag(cmd.argv, "--middleware") == \
        "kvtier.integrations.vllm.cachecontrol.CacheControlMiddleware"


def test_baseline_is_the_same_server_without_the_connector():
    cmd = build_command(ServeConfig("m", kvtier=False, cpu=True, engine_kv_bytes=64 << 20))
    assert "--kv-transfer-config" not in cmd.argv and cmd.kv_transfer_config is None
    assert "--middleware" not in cmd.argv
    # CPU backend: the default gpu_memory_utilization fails, so the KV cache is sized.
    assert flag(cmd.argv, "--kv-cache-memory-bytes") == str(64 << 20)
    assert any("CPU backend" in note for note in cmd.notes)


def test_engine_kv_sizes_the_engines_cache_on_cuda_too():
    """`kvtier serve --engine-kv 8GiB` on a GPU machine started vLLM with its default (0.92 of
    the GPU) and said nothing of the size asked."""
    cmd = build_command(ServeConfig("m", kvtier=False, cpu=False, engine_kv_bytes=8 << 30))
    assert flag(cmd.argv, "--kv-cache-memory-bytes") == str(8 << 30)
    assert not any("CPU backend" in note for note in cmd.notes)
    assert "--kv-cache-memory-bytes" not in build_command(
        ServeConfig("m", kvtier=False, cpu=False)).argv


def test_engine_kv_beside_the_cpu_backends_kv_cache_variable_is_refused(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM would take one of the two sizes: which one, nothing said."""
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "4")
    with pytest.raises(ConfigError, match="VLLM_CPU_KVCACHE_SPACE") as refused:
        build_command(ServeConfig("m", kvtier=False, cpu=True, engine_kv_bytes=64 << 20))
    assert refused.value.field == "--engine-kv"
    assert "--kv-cache-memory-bytes" not in build_command(
        ServeConfig("m", kvtier=False, cpu=True)).argv  # the variable alone sizes it


def test_a_users_kv_cache_size_flag_wins_on_cpu():
    cmd = build_command(ServeConfig("m", kvtier=False, cpu=True,
                                    vllm_args=("--gpu-memory-utilization=0.3",)))
    assert "--kv-cache-memory-bytes" not in cmd.argv


def test_cpu_kvtier_server_keeps_the_baselines_core_binding(monkeypatch):
    # vLLM's CPU backend reserves an extra core whenever a KV connector is configured; on a
    # 2-core machine that unbound the worker and slowed every step (docs/performance.md).
    monkeypatch.delenv("VLLM_CPU_NUM_OF_RESERVED_CPU", raising=False)
    cmd = build_command(ServeConfig("m", extra_config=connector_config(TIERS), cpu=True))
    assert cmd.env == {"VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}
    assert cmd.display().startswith("VLLM_CPU_NUM_OF_RESERVED_CPU=1 ")
    tp2 = build_command(ServeConfig("m", extra_config=connector_config(TIERS), cpu=True,
                                    vllm_args=("-tp", "2")))
    assert tp2.env == {"VLLM_CPU_NUM_OF_RESERVED_CPU": "2"}
    assert build_command(ServeConfig("m", kvtier=False, cpu=True)).env == {}
    assert build_command(ServeConfig("m", extra_config=connector_config(TIERS),
                                     cpu=False)).env == {}
    monkeypatch.setenv("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")  # the user's choice wins
    assert build_command(ServeConfig("m", extra_config=connector_config(TIERS), cpu=True)).env == {}


def test_tokens_per_chunk_follows_an_unusual_block_size():
    cmd = build_command(ServeConfig("m", extra_config=connector_config(TIERS, 256), cpu=False,
                                    vllm_args=("--block-size", "48")))
    extra = cmd.kv_transfer_config["kv_connector_extra_config"]  # type: ignore[index]
    assert extra["tokens_per_chunk"] == 288  # the first multiple of 48 >= 256
    # Left unset, it stays the connector's to pick from the engine's real block size.
    unset = build_command(ServeConfig("m", extra_config=connector_config(TIERS), cpu=False,
                                      vllm_args=("--block-size", "48")))
    extra = unset.kv_transfer_config["kv_connector_extra_config"]  # type: ignore[index]
    assert "tokens_per_chunk" not in extra
    assert ConnectorConfig.parse(extra).for_block_size(48).tokens_per_chunk == 288
    assert any("--block-size 48 >= 256 (288)" in note for note in unset.notes)


def test_serve_leaves_the_chunk_of_a_state_layer_model_to_the_connector():
    """vLLM's align mode gives a model with state layers blocks of hundreds of tokens (640
    for the generated Qwen3-Next on the CPU backend): serve's tokens_per_chunk 256, always
    set, was refused there at start-up ("a multiple of vLLM's block_size (640)"), where the
    connector left to itself takes a multiple of the block."""
    default = build_command(ServeConfig("m", extra_config=None, cpu=True))
    extra = default.kv_transfer_config["kv_connector_extra_config"]  # type: ignore[index]
    assert ConnectorConfig.parse(extra).for_block_size(640).tokens_per_chunk == 640
    assert ConnectorConfig.parse(connector_config(TIERS)).for_block_size(640).tokens_per_chunk \
        == 640


def test_a_cpu_chunk_size_128_does_not_divide_gets_a_block_that_divides_it(tmp_path):
    # vLLM's CPU backend picks 128-token blocks; a tokens_per_chunk of 64 the operator set
    # made the connector refuse the engine at its start ("a multiple of vLLM's block_size
    # (128)", in the worker's log ~50 s later). The block vLLM's CPU attention takes: a
    # multiple of 32.
    def command(tokens_per_chunk: int, model: str = "m", *args: str) -> ServeCommand:
        extra = {**connector_config(TIERS), "tokens_per_chunk": tokens_per_chunk}
        return build_command(ServeConfig(model, extra_config=extra, cpu=True,
                                         vllm_args=args))

    for tpc, block in ((64, "64"), (96, "96"), (160, "32"), (192, "96"), (320, "64")):
        cmd = command(tpc)
        assert flag(cmd.argv, "--block-size") == block, tpc
        assert any(n.startswith(f"--block-size {block}: ") for n in cmd.notes)
        extra = cmd.kv_transfer_config["kv_connector_extra_config"]  # type: ignore[index]
        assert extra["tokens_per_chunk"] == tpc  # the operator's, untouched
    assert flag(command(256).argv, "--block-size") is None  # 128 divides it
    assert flag(command(64, "m", "--block-size", "32").argv, "--block-size") == "32"  # theirs
    assert command(64, "m", "--block-size", "32").argv.count("--block-size") == 1
    # No CPU block divides 100: refused up front, naming the value and what is allowed.
    with pytest.raises(ConfigError, match=r"tokens_per_chunk=100: a multiple of 32 .*"
                                          r"--block-size"):
        command(100)
    # The connector's own default (not the operator's) is left to the connector.
    assert flag(build_command(ServeConfig("m", extra_config={"tiers": TIERS}, cpu=True)).argv,
                "--block-size") is None
    # A GPU's blocks are the attention backend's: left to vLLM, as before.
    assert flag(build_command(ServeConfig("m", extra_config={**connector_config(TIERS),
                                                             "tokens_per_chunk": 64},
                                          cpu=False)).argv, "--block-size") is None
    # A model with state layers: vLLM sets its block ("align" mode); none is added.
    hybrid = tmp_path / "qwen3-next"
    hybrid.mkdir()
    (hybrid / "config.json").write_bytes((CONFIGS / "qwen3-next-80b-a3b.json").read_bytes())
    assert flag(command(64, str(hybrid)).argv, "--block-size") is None


@pytest.mark.skipif(not is_cpu_backend(), reason="kvtier serve adds the block on vllm-cpu")
def test_serve_passes_a_cpu_block_for_its_chunk_size(capsys):
    assert main(["serve", "./model", "--dry-run", "--memory", "1GiB", "--disk", "0",
                 "--tokens-per-chunk", "64"]) == 0
    out = capsys.readouterr().out
    assert "--block-size 64" in out and '"tokens_per_chunk":64' in out
    assert main(["serve", "./model", "--dry-run", "--memory", "1GiB", "--disk", "0",
                 "--tokens-per-chunk", "48"]) == 2
    assert "tokens_per_chunk=48: a multiple of 32" in capsys.readouterr().err


def test_the_block_size_is_read_as_vllm_reads_it_and_a_bad_one_is_named():
    """`--block_size 48` is vLLM's --block-size too: the chunk stayed 256, which the
    connector refuses on blocks of 48. `--block-size=abc` was a bare int() ValueError."""
    cmd = build_command(ServeConfig("m", extra_config=connector_config(TIERS, 256), cpu=False,
                                    vllm_args=("--block_size", "48")))
    assert cmd.kv_transfer_config["kv_connector_extra_config"][  # type: ignore[index]
        "tokens_per_chunk"] == 288
    with pytest.raises(ConfigError) as refused:
        build_command(ServeConfig("m", extra_config=connector_config(TIERS), cpu=False,
                                  vllm_args=("--block-size=abc",)))
    assert refused.value.field == "--block-size" and refused.value.value == "abc"


@pytest.mark.parametrize("theirs", [
    ("--kv-transfer-config", '{"kv_connector":"OffloadingConnector","kv_role":"kv_both"}'),
    ("--kv_transfer_config.kv_connector_extra_config.tokens_per_chunk", "512"),
    ("--kv-offloading-size", "8"),  # vLLM overwrites kv_connector with OffloadingConnector
])
def test_a_kv_transfer_config_after_the_dashes_is_refused_with_kvtier(theirs):
    """vLLM keeps the last --kv-transfer-config: one after `--` replaced kvtier's while the
    printed notes still showed kvtier's tiers. Without kvtier it is the user's to give."""
    with pytest.raises(ConfigError) as refused:
        build_command(ServeConfig("m", extra_config=connector_config(TIERS), cpu=False,
                                  vllm_args=theirs))
    assert refused.value.field.startswith(("--kv-transfer-config", "--kv-offloading-size"))
    assert "--no-kvtier" in refused.value.allowed
    baseline = build_command(ServeConfig("m", kvtier=False, cpu=False, vllm_args=theirs))
    assert baseline.argv[-2:] == theirs


@pytest.mark.parametrize("argv", [
    ["serve", "--host", "", "m"],
    ["serve", "--host", "  ", "m"],
    ["proxy", "--prefill", "http://127.0.0.1:8100", "--decode", "http://127.0.0.1:8200",
     "--host", ""],
])
def test_an_empty_listen_address_is_refused(argv, capsys):
    """vLLM binds `args.host or ""` and aiohttp "" too: every interface. `--host "$HOST"`
    with the variable unset served the OpenAI API to the network instead of 127.0.0.1."""
    with pytest.raises(SystemExit) as refused:
        build_parser().parse_args(argv)
    assert refused.value.code == 2
    assert "argument --host" in capsys.readouterr().err


@pytest.mark.parametrize("argv, option", [
    (["serve", "--memory", "64", "m"], "--memory"),  # 64 B: "64GiB" was meant
    (["serve", "--disk", "4096", "m"], "--disk"),
    (["serve", "--engine-kv", "1", "m"], "--engine-kv"),
    (["doctor", "--memory", "64"], "--memory"),
    (["doctor", "--disk", "/mnt/nvme/kvtier:500"], "--disk"),
    (["doctor", "--shared", "/mnt/shared/kvtier:10"], "--shared"),
])
def test_a_tier_sized_in_bytes_by_a_unit_left_out_is_refused(argv, option, capsys):
    """A bare number is bytes: `--memory 64` was a memory tier of 64 B (it stores nothing,
    and kvtier doctor said ok)."""
    with pytest.raises(SystemExit) as refused:
        build_parser().parse_args(argv)
    assert refused.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {option}" in err and "a bare number is bytes" in err


def test_tier_sizes_a_machine_takes_and_none_are_kept():
    parser = build_parser()
    served = parser.parse_args(["serve", "--memory", "0", "--disk", "64MiB", "--engine-kv",
                                "8MiB", "m"])
    assert (served.memory, served.disk, served.engine_kv) == ("0", "64MiB", "8MiB")
    doctor = parser.parse_args(["doctor", "--memory", "1MiB", "--disk", "/mnt/kv:1TiB"])
    assert (doctor.memory, doctor.disk) == ("1MiB", ["/mnt/kv:1TiB"])


def test_a_disaggregated_instance_carries_its_kv_role(capsys):
    cmd = build_command(ServeConfig("m", extra_config=connector_config(TIERS), cpu=False,
                                    kv_role="kv_producer"))
    transfer = json.loads(flag(cmd.argv, "--kv-transfer-config"))
    assert transfer["kv_role"] == cmd.kv_transfer_config["kv_role"] == "kv_producer"
    assert transfer["kv_connector_extra_config"]["tiers"] == TIERS
    with pytest.raises(ConfigError, match="kv_role"):
        build_command(ServeConfig("m", extra_config=connector_config(TIERS), kv_role="both"))
    assert main(["serve", "./model", "--dry-run", "--memory", "1GiB", "--disk", "0",
                 "--kv-role", "kv_consumer"]) == 0
    assert '"kv_role":"kv_consumer"' in capsys.readouterr().out


def test_serve_takes_a_chunk_size_and_rounds_it_to_the_block_size(capsys):
    assert main(["serve", "./model", "--dry-run", "--memory", "1GiB", "--disk", "0",
                 "--tokens-per-chunk", "64", "--", "--block-size", "32"]) == 0
    assert '"tokens_per_chunk":64' in capsys.readouterr().out
    assert main(["serve", "./model", "--dry-run", "--memory", "1GiB", "--disk", "0",
                 "--tokens-per-chunk", "100", "--", "--block-size", "32"]) == 0
    out = capsys.readouterr().out
    assert '"tokens_per_chunk":128' in out and "multiple of --block-size 32 >= 100" in out
    with pytest.raises(SystemExit) as refused:
        main(["serve", "./model", "--dry-run", "--tokens-per-chunk", "0"])
    assert refused.value.code == 2
    captured = capsys.readouterr()
    assert "argument --tokens-per-chunk" in captured.err


def test_default_tiers_take_sizes_from_flags_or_the_machine(tmp_path):
    assert default_tiers(cpu=True, memory_bytes=GIB, disk_path=tmp_path, disk_bytes=3 * GIB) == [
        {"kind": "memory", "capacity": "1GiB"},
        {"kind": "disk", "path": str(tmp_path), "capacity": "3GiB"}]
    assert default_tiers(cpu=False, memory_bytes=0, disk_path=tmp_path / "new" / "dir",
                         disk_bytes=100 << 20) == [
        {"kind": "disk", "path": str(tmp_path / "new" / "dir"), "capacity": "100MiB"}]
    sized = default_tiers(cpu=True, disk_path=tmp_path)
    assert [t["kind"] for t in sized] == ["memory", "disk"]
    with pytest.raises(ConfigError):
        default_tiers(cpu=True, memory_bytes=0, disk_bytes=0)


def test_the_default_memory_tier_fits_in_the_containers_memory_limit(tmp_path, monkeypatch):
    """In a pod /proc/meminfo shows the host's RAM: the memory tier and a CPU engine's KV
    cache were sized from it, and the pod OOM-killed by its own limit. A cgroup v2 tree of
    real files whose pod leaves 1 GiB is pointed at."""
    from kvtier.tiers import prefault

    pod = tmp_path / "cgroup" / "pod"
    pod.mkdir(parents=True)
    (pod / "memory.max").write_text(f"{2 * GIB}\n")
    (pod / "memory.current").write_text(f"{GIB}\n")
    self_cgroup = tmp_path / "self-cgroup"
    self_cgroup.write_text("0::/pod\n")
    monkeypatch.setattr(prefault, "CGROUP_ROOT", tmp_path / "cgroup")
    monkeypatch.setattr(prefault, "SELF_CGROUP", self_cgroup)
    sized = default_tiers(cpu=False, disk_path=tmp_path, disk_bytes=0)
    assert sized == [{"kind": "memory", "capacity": "512MiB"}]  # GPU_MEMORY_TIER_SHARE of 1 GiB


def test_config_file_is_validated_and_becomes_the_extra_config(tmp_path):
    good = tmp_path / "store.yaml"
    good.write_text("tiers:\n  - {kind: memory, capacity: 1GiB}\nio_threads: 2\n")
    assert load_connector_config(good) == {  # no tokens_per_chunk: the connector's to pick
        "tiers": [{"kind": "memory", "capacity": "1GiB"}], "io_threads": 2}
    bad = tmp_path / "bad.yaml"
    bad.write_text("tiers:\n  - {kind: tape, capacity: 1GiB}\n")
    with pytest.raises(ConfigError):
        load_connector_config(bad)
    unknown = tmp_path / "unknown.json"
    unknown.write_text('{"tiers": [], "colour": "blue"}')
    with pytest.raises(ConfigError, match="colour"):
        load_connector_config(unknown)


def test_serve_config_file_takes_every_key_the_connector_takes(capsys, tmp_path):
    # `serve` once kept its own key list and refused index_max_keys, which the connector
    # accepts (issue 10); both now read ConnectorConfig.
    every = {"tokens_per_chunk": 128, "index_max_keys": 5000, "write_queue_depth": 32,
             "read_timeout_s": 2.5, "lookup_timeout_s": 0.5, "load_mode": "async",
             "store_mode": "sync", "load_when": "always", "io_threads": 4,
             "io_cores": "inherit", "event_block_size": 16, "tail_chunks": False,
             "pool_events": {"endpoint": "tcp://epp:5558", "pool": "fleet", "model": "m"},
             "tiers": [{"kind": "memory", "capacity": "1GiB"}]}
    # a new key needs a value here ("node" replaces "tiers": its own case below)
    assert set(every) | {"node"} == ConnectorConfig.known_keys()
    path = tmp_path / "connector.json"
    path.write_text(json.dumps(every))
    assert main(["serve", "./model", "--config", str(path), "--dry-run"]) == 0
    printed = capsys.readouterr().out.split("kv_connector_extra_config: ", 1)[1]
    assert json.loads(printed.splitlines()[0]) == every

    path.write_text(json.dumps({**every, "index_max_key": 5000}))
    with pytest.raises(ConfigError, match="index_max_key") as refused:
        load_connector_config(path)
    assert refused.value.field == f"{path}.index_max_key"
    assert main(["serve", "./model", "--config", str(path), "--dry-run"]) == 2
    assert "index_max_key" in capsys.readouterr().err

    # Node mode: the tiers are the node's, and both is an error naming `tiers` (the node
    # publishes its tiers' events: no pool_events either; its write queues and I/O threads
    # are its own).
    node = {key: value for key, value in every.items()
            if key not in ("tiers", "pool_events", "write_queue_depth", "io_cores")}
    path.write_text(json.dumps({**node, "node": "/run/kvtier/node.sock"}))
    assert main(["serve", "./model", "--config", str(path), "--dry-run"]) == 0
    printed = capsys.readouterr().out.split("kv_connector_extra_config: ", 1)[1]
    assert json.loads(printed.splitlines()[0]) == {**node, "node": "/run/kvtier/node.sock"}
    path.write_text(json.dumps({**every, "node": "/run/kvtier/node.sock"}))
    assert main(["serve", "./model", "--config", str(path), "--dry-run"]) == 2
    assert "tiers" in capsys.readouterr().err


def test_serve_dry_run_prints_the_command_and_passes_args_after_the_dashes(capsys, tmp_path):
    code = main(["serve", "./model", "--dry-run", "--memory", "1GiB", "--disk", "0",
                 "--", "--enforce-eager", "--max-model-len", "2048"])
    out = capsys.readouterr().out
    assert code == 0
    line = out.strip().splitlines()[-1]
    assert "vllm.entrypoints.openai.api_server --model ./model" in line
    assert line.endswith("--enforce-eager --max-model-len 2048")
    assert '"tiers":[{"kind":"memory","capacity":"1GiB"}]' in line


# --- the subprocess helper ---------------------------------------------------------------------

STAND_IN = textwrap.dedent("""\
    import http.server, os, subprocess, sys, time
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    open(sys.argv[2], "w").write(str(child.pid))
    # As vLLM's processes do: a socket file where VLLM_RPC_BASE_PATH says, left when killed.
    rpc = os.path.join(os.environ["VLLM_RPC_BASE_PATH"], "engine-core")
    open(rpc, "w").close()
    open(sys.argv[2] + ".rpc", "w").write(rpc)
    if sys.argv[3] == "crash":
        print("stand-in: failing on purpose", flush=True)
        sys.exit(3)
    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if sys.argv[3] == "ok" else 503)
            self.end_headers()
        def log_message(self, *args):
            pass
    http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Health).serve_forever()
    """)


def stand_in(tmp_path: Path, mode: str) -> tuple[ServeCommand, Path]:
    script = tmp_path / "server.py"
    script.write_text(STAND_IN)
    port, child_pid = free_port(), tmp_path / "child.pid"
    argv = (sys.executable, str(script), str(port), str(child_pid), mode)
    return ServeCommand(argv, {}, f"http://127.0.0.1:{port}", None), child_pid


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); it has exited all the same.
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split(")")[-1].split()[0] != "Z"


def test_running_server_waits_for_health_and_kills_the_whole_group(tmp_path):
    cmd, child_pid = stand_in(tmp_path, "ok")
    with running_server(cmd, log_path=tmp_path / "log", startup_timeout_s=30) as server:
        assert server.proc is not None and server.proc.poll() is None
        child = int(child_pid.read_text())
        assert alive(child)
        rpc = Path(Path(f"{child_pid}.rpc").read_text())
        assert rpc.exists() and rpc.parent.name.startswith("kvtier-rpc-")
    assert server.proc is None
    assert not alive(child)  # the "engine core" went with it
    assert not rpc.parent.exists()  # its socket files' folder too


def state(pid: int) -> str:
    """The process's state letter (R, S, T: stopped, Z...)."""
    return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]


def test_a_paused_server_is_stopped_whole_resumes_and_still_stops(tmp_path):
    """`pause` stops every process of the server (the bench's other servers must not poll
    the cores while one is measured), `resume` continues them, and `stop` ends a paused
    one (its SIGTERM would otherwise wait for a SIGCONT)."""
    cmd, child_pid = stand_in(tmp_path, "ok")
    with running_server(cmd, log_path=tmp_path / "log", startup_timeout_s=30) as server:
        assert server.proc is not None
        pids = (server.proc.pid, int(child_pid.read_text()))
        server.pause()
        for pid in pids:
            deadline = time.monotonic() + 10
            while state(pid) != "T" and time.monotonic() < deadline:
                time.sleep(0.01)
            assert state(pid) == "T"
        server.resume()
        assert all(state(pid) != "T" for pid in pids)
        server.wait_ready(10)  # it answers again
        server.pause()
    assert server.proc is None and not any(alive(pid) for pid in pids)


def test_a_server_that_exits_early_raises_with_its_log(tmp_path):
    cmd, child_pid = stand_in(tmp_path, "crash")
    with pytest.raises(ServerError, match="failing on purpose"), \
            running_server(cmd, log_path=tmp_path / "log", startup_timeout_s=30):
        pass
    assert not alive(int(child_pid.read_text()))  # its orphaned child was killed too


def test_a_server_that_never_gets_healthy_times_out_and_is_stopped(tmp_path):
    cmd, child_pid = stand_in(tmp_path, "unhealthy")
    with pytest.raises(ServerError, match="not healthy"), \
            running_server(cmd, log_path=tmp_path / "log", startup_timeout_s=1.5):
        pass
    assert not alive(int(child_pid.read_text()))


def test_a_tp_server_says_what_each_rank_holds():
    """Capacities are per engine (issue 11, item 4): at -tp 4 the command's notes say each
    rank holds a quarter of the memory and disk tiers, and a shared quota stays whole."""
    tiers = [*TIERS, {"kind": "shared", "path": "/tmp/kv-shared", "capacity": "1TiB"}]
    cmd = build_command(ServeConfig("m", extra_config=connector_config(tiers), cpu=False,
                                    vllm_args=("--tensor-parallel-size", "4")))
    [note] = [n for n in cmd.notes if "per engine" in n]
    assert "4 TP ranks" in note and "memory 512.0 MiB, disk 2.5 GiB, shared 1.0 TiB" in note
    assert "shared: one quota for the whole directory" in note
    # The command still carries the totals: the connector splits them itself.
    extra = json.loads(flag(cmd.argv, "--kv-transfer-config"))["kv_connector_extra_config"]
    assert extra["tiers"][0]["capacity"] == "2GiB"
    single = build_command(ServeConfig("m", extra_config=connector_config(TIERS), cpu=False))
    assert not any("per engine" in n for n in single.notes)


def test_a_generated_model_is_served_under_a_short_name(capsys, tmp_path):
    from dataclasses import asdict

    from kvtier.testing.tinymodel import PRESETS

    model = tmp_path / "tiny-llama-0123"
    model.mkdir()  # only the generator's marker is read
    (model / "kvtier-tiny-model.json").write_text(json.dumps({"spec": asdict(PRESETS["bench"])}))
    base = ["serve", str(model), "--dry-run", "--memory", "1GiB", "--disk", "0"]
    assert main(base) == 0
    argv = shlex.split(capsys.readouterr().out.splitlines()[-1])
    i = argv.index("--served-model-name")
    assert argv[i + 1:i + 3] == ["kvtier-bench", str(model)]  # the directory still accepted
    assert main([*base, "--served-model-name", "mine"]) == 0
    argv = shlex.split(capsys.readouterr().out.splitlines()[-1])
    assert flag(tuple(argv), "--served-model-name") == "mine"
    assert str(model) not in argv[argv.index("--served-model-name"):]
    assert main([*base, "--", "--served-model-name", "theirs"]) == 0  # vLLM's own flag wins
    argv = shlex.split(capsys.readouterr().out.splitlines()[-1])
    assert argv.count("--served-model-name") == 1 and flag(tuple(argv), "--served-model-name") \
        == "theirs"


def test_another_model_keeps_vllms_name_unless_given_one(capsys):
    assert main(["serve", "./model", "--dry-run", "--memory", "1GiB", "--disk", "0"]) == 0
    assert "--served-model-name" not in capsys.readouterr().out
    command = build_command(ServeConfig("./model", cpu=True, served_model_name=("a", "b")))
    assert command.argv[command.argv.index("--served-model-name"):][:3] == (
        "--served-model-name", "a", "b")
