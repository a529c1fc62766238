"""Parsing `vllm serve` deployments: shell lines, scripts, argv, Kubernetes YAML."""

from __future__ import annotations

import pytest

from kvtier.errors import ConfigError
from kvtier.tools.ops.audit import load_deployment, parse_argv, parse_command_line, parse_kubernetes


def test_equals_and_space_forms_and_underscores_are_the_same_flag():
    a = parse_command_line("vllm serve m --kv-offloading-size=64 --max_model_len 8192")
    b = parse_argv(["vllm", "serve", "m", "--kv_offloading_size", "64",
                    "--max-model-len=8192"])
    assert a.flags == b.flags == {"--kv-offloading-size": "64", "--max-model-len": "8192"}
    assert a.model == b.model == "m"


def test_boolean_flag_does_not_eat_the_model_and_short_tp():
    cmd = parse_argv(["vllm", "serve", "--enforce-eager", "meta-llama/Llama-3-8B", "-tp", "4"])
    assert cmd.model == "meta-llama/Llama-3-8B"
    assert cmd.flags == {"--enforce-eager": None, "--tensor-parallel-size": "4"}
    assert cmd.tp == 4


def test_kv_transfer_config_json_and_multiconnector_children():
    cfg = ('{"kv_connector":"MultiConnector","kv_role":"kv_both","kv_connector_extra_config":'
           '{"connectors":[{"kv_connector":"NixlConnector","kv_role":"kv_both"},'
           '{"kv_connector":"OffloadingConnector","kv_role":"kv_both"}]}}')
    cmd = parse_command_line(f"vllm serve m --kv-transfer-config '{cfg}'")
    assert cmd.connectors == ("MultiConnector", "NixlConnector", "OffloadingConnector")
    assert cmd.offloads and not cmd.uses_lmcache


def test_script_with_exports_continuations_comments_and_env_prefix():
    script = """#!/bin/bash
set -e
export LMCACHE_MAX_LOCAL_CPU_SIZE=50  # per rank
PYTHONHASHSEED=0 vllm serve Qwen/Qwen3-32B \\
    --tensor-parallel-size 2 \\
    --kv-offloading-backend lmcache --kv-offloading-size 100
echo started
"""
    cmd = parse_command_line(script, env={"EXTRA": "1"})
    assert cmd.model == "Qwen/Qwen3-32B" and cmd.tp == 2
    assert cmd.env == {"LMCACHE_MAX_LOCAL_CPU_SIZE": "50", "PYTHONHASHSEED": "0", "EXTRA": "1"}
    assert cmd.connectors == ("LMCacheMPConnector",)


def test_python_module_entrypoint_and_docker_image_version():
    cmd = parse_command_line("python3 -m vllm.entrypoints.openai.api_server --model m -tp 2")
    assert cmd.model == "m" and cmd.tp == 2
    docker = parse_command_line("docker run --gpus all vllm/vllm-openai:v0.19.1 --model m "
                                "--kv-offloading-size 10")
    assert docker.vllm_version == (0, 19, 1) and docker.model == "m"
    assert docker.flags == {"--kv-offloading-size": "10"}


K8S = """
apiVersion: apps/v1
kind: Deployment
spec:
  template:
    spec:
      containers:
      - name: sidecar
        image: busybox
        args: ["sleep", "infinity"]
      - name: vllm
        image: vllm/vllm-openai:v0.20.1
        args:
        - "--model=Qwen/Qwen3-32B"
        - "--tensor-parallel-size=2"
        - "--kv-offloading-backend=native"
        - "--kv-offloading-size=100"
        - "--kv-transfer-config"
        - |
          {"kv_connector": "OffloadingConnector", "kv_role": "kv_both"}
        env:
        - {name: PYTHONHASHSEED, value: "0"}
        - name: HF_TOKEN
          valueFrom: {secretKeyRef: {name: hf, key: token}}
"""


def test_kubernetes_deployment_picks_vllm_container_env_and_image_version():
    cmd = parse_kubernetes(K8S, env={"EXTRA": "x"})
    assert cmd.model == "Qwen/Qwen3-32B" and cmd.tp == 2
    assert cmd.vllm_version == (0, 20, 1)
    assert cmd.env == {"PYTHONHASHSEED": "0", "HF_TOKEN": "<valueFrom>", "EXTRA": "x"}
    assert cmd.transfer_config == {"kv_connector": "OffloadingConnector", "kv_role": "kv_both"}
    assert parse_kubernetes(K8S, vllm_version=(0, 21, 0)).vllm_version == (0, 21, 0)


NODE_DAEMONSET = """
spec:
  template:
    spec:
      initContainers:
        - name: dirs
          image: registry.example.com/kvtier-vllm:v0.32.0
          command: ["sh", "-c"]
          args: ["chown 2000:2000 /run/kvtier && chmod 0750 /run/kvtier"]
      containers:
        - name: node
          image: registry.example.com/kvtier-vllm:v0.32.0
          command: ["kvtier", "node", "serve"]
          args: ["--config", "/etc/kvtier/node.yaml"]
"""


def test_a_container_with_its_own_command_is_not_read_as_the_images_vllm():
    """A `command` replaces the image's entrypoint: the init container's `chown` was read as
    `vllm serve chown ...` (model 'chown', "words after the model"), because its image is a
    vLLM one; kvtier's node DaemonSet (deploy/kubernetes-node) starts no vLLM at all."""
    cmd = parse_kubernetes(NODE_DAEMONSET)
    assert cmd.entrypoint is None and cmd.model is None
    # the container that starts vLLM wins over one before it that only mentions it
    serving = NODE_DAEMONSET.replace('["kvtier", "node", "serve"]', '["vllm", "serve"]').replace(
        '["--config", "/etc/kvtier/node.yaml"]', '["meta-llama/Llama-3.1-8B-Instruct", "-tp", "2"]')
    cmd = parse_kubernetes(serving)
    assert cmd.model == "meta-llama/Llama-3.1-8B-Instruct" and cmd.tp == 2
    assert cmd.vllm_version == (0, 32, 0)


def test_bare_args_list_and_sh_dash_c(tmp_path):
    bare = load_deployment("args:\n- --model\n- m\n- --enforce-eager\n")
    assert bare.model == "m" and bare.has("--enforce-eager")
    shell = parse_kubernetes('command: ["/bin/sh", "-c"]\n'
                             'args: ["vllm serve m --max-model-len 4096"]\n')
    assert shell.model == "m" and shell.number("--max-model-len") == 4096
    path = tmp_path / "serve.sh"
    path.write_text("vllm serve m --block-size 32\n")
    assert load_deployment(str(path)).value("--block-size") == "32"


def test_bad_inputs_raise_config_error():
    with pytest.raises(ConfigError):
        parse_command_line("vllm serve m --kv-transfer-config '{unterminated")
    with pytest.raises(ConfigError):
        parse_kubernetes("kind: Service\nspec: {ports: [80]}\n")
    with pytest.raises(ConfigError):
        parse_kubernetes("args: [unclosed\n")


def test_a_mistyped_file_name_is_an_error_not_a_model_name(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        load_deployment(str(tmp_path / "deploy.yml"))
    with pytest.raises(ConfigError, match="no such file"):
        load_deployment("serve.sh")
    assert load_deployment("vllm serve m").model == "m"  # a command line stays one


def test_non_utf8_file_is_a_config_error(tmp_path):
    path = tmp_path / "serve.sh"
    path.write_bytes(b"vllm serve m \xff\xfe\n")
    with pytest.raises(ConfigError, match="UTF-8"):
        load_deployment(str(path))


def test_a_yaml_file_is_read_as_yaml_even_when_it_does_not_look_like_it(tmp_path):
    path = tmp_path / "deploy.yaml"
    path.write_text("metadata: {name: x}\nspec: {containers: [{args: [--model, m]\n")
    with pytest.raises(ConfigError, match="valid YAML"):
        load_deployment(str(path))


def test_odd_manifest_shapes_parse_or_raise_config_error():
    # a string where a list belongs, dates (not JSON-serialisable), bad sh -c quoting
    cmd = parse_kubernetes("command: vllm\nargs: serve\nimage: x\nenv: 2024-01-01\n")
    assert cmd.model is None or isinstance(cmd.model, str)
    with pytest.raises(ConfigError):
        parse_kubernetes('command: ["sh", "-c"]\nargs: ["vllm serve \'m"]\n')


def test_human_readable_token_counts_and_bad_tp_fall_back():
    cmd = parse_command_line("vllm serve m --max-model-len 32k -tp 0")
    assert cmd.number("--max-model-len") == 32_000 and cmd.tp == 1
    assert parse_command_line("vllm serve m --max-model-len 32K").number("--max-model-len") == \
        32 * 1024
