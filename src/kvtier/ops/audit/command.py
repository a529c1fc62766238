"""A `vllm serve` deployment as the audit rules see it, parsed from what operators have.

Primitives:
    ServeCommand                      -- flags, env, model, version (frozen)
    parse_command_line(text, env, version)  -- a shell line or script ("A=B vllm serve ...")
    parse_argv(argv, env, version)    -- an already-split argument list
    parse_kubernetes(text, env, version)    -- a Pod/Deployment/container YAML
    load_deployment(path_or_text, ...) -- any of the above, guessed from the content

Flags are normalised: `--flag=value` and `--flag value` are the same, `_` and `-` in flag
names are the same (vLLM accepts both), `-tp 8` is `--tensor-parallel-size 8`, and
`--no-enable-prefix-caching` is kept as written. A repeated flag keeps its last value, as
argparse does.
"""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from kvtier.errors import ConfigError
from kvtier.ops.vllm_versions import (
    LMCACHE_CONNECTORS,
    NATIVE_CONNECTORS,
    Version,
    parse_version,
)

# vLLM flags that take no value (so the next token is not theirs).
BOOLEAN_FLAGS = frozenset({
    "--enable-prefix-caching", "--no-enable-prefix-caching", "--enforce-eager",
    "--disable-hybrid-kv-cache-manager", "--calculate-kv-scales", "--trust-remote-code",
    "--enable-expert-parallel", "--disable-log-requests", "--disable-log-stats",
    "--enable-chunked-prefill", "--no-enable-chunked-prefill", "--enable-lora",
    "--enable-auto-tool-choice", "--disable-custom-all-reduce", "--async-scheduling",
    "--enable-log-requests", "--no-enable-expert-parallel", "--enable-eplb",
})
_SHORT_FLAGS = {"-tp": "--tensor-parallel-size", "-pp": "--pipeline-parallel-size",
                "-dp": "--data-parallel-size", "-ep": "--enable-expert-parallel"}
_ENV_ASSIGN = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
_IMAGE_TAG = re.compile(r"vllm[-/\w.]*:v?(\d+\.\d+(?:\.\d+)?)")


@dataclass(frozen=True, slots=True)
class ServeCommand:
    """One vLLM server's configuration."""

    model: str | None  # positional model or --model
    flags: Mapping[str, str | None] = field(default_factory=dict)  # "--flag" -> value/None
    env: Mapping[str, str] = field(default_factory=dict)  # environment variables
    vllm_version: Version | None = None  # from --vllm-version or the image tag
    model_config: Mapping[str, Any] | None = None  # the model's config.json, when given

    def has(self, flag: str) -> bool:
        return flag in self.flags

    def value(self, flag: str) -> str | None:
        return self.flags.get(flag)

    def number(self, flag: str) -> float | None:
        """The flag's value as a number, None when absent or not numeric."""
        try:
            return float(self.flags[flag])  # type: ignore[arg-type]
        except (KeyError, TypeError, ValueError):
            return None

    @property
    def tp(self) -> int:
        return int(self.number("--tensor-parallel-size") or 1)

    @property
    def transfer_config(self) -> dict[str, Any] | None:
        """The parsed `--kv-transfer-config` JSON (None when absent or not JSON)."""
        raw = self.value("--kv-transfer-config")
        if not raw:
            return None
        try:
            parsed = json.loads(raw)
        except json.JSONDecodeError:
            return None
        return parsed if isinstance(parsed, dict) else None

    @property
    def connectors(self) -> tuple[str, ...]:
        """Every KV connector in effect (MultiConnector children included)."""
        names: list[str] = []
        if self.has("--kv-offloading-size"):
            backend = (self.value("--kv-offloading-backend") or "native").lower()
            names.append("LMCacheMPConnector" if backend == "lmcache" else "OffloadingConnector")
        cfg = self.transfer_config
        if cfg:
            names.extend(_connector_names(cfg))
        return tuple(dict.fromkeys(names))

    @property
    def offloads(self) -> bool:
        """Whether any KV offload connector (native, LMCache, kvtier) is configured."""
        return any(c in NATIVE_CONNECTORS or c in LMCACHE_CONNECTORS or c == "KVTierConnector"
                   for c in self.connectors)

    @property
    def uses_lmcache(self) -> bool:
        return any(c in LMCACHE_CONNECTORS for c in self.connectors)


def parse_argv(
    argv: Sequence[str], env: Mapping[str, str] | None = None,
    vllm_version: Version | None = None, model_config: Mapping[str, Any] | None = None,
) -> ServeCommand:
    """Parse a split command line; leading `K=V` words and `vllm serve` are understood."""
    env_out = dict(env or {})
    tokens = list(argv)
    if tokens[:1] == ["env"]:
        tokens.pop(0)
    while tokens and _ENV_ASSIGN.match(tokens[0]):
        key, _, val = tokens.pop(0).partition("=")
        env_out.setdefault(key, val)
    version = vllm_version or _version_from_tokens(tokens)
    tokens = _after_entrypoint(tokens)
    model, flags = _parse_flags(tokens)
    model = flags.pop("--model", None) or model
    return ServeCommand(model=model, flags=flags, env=env_out, vllm_version=version,
                        model_config=model_config)


def parse_command_line(
    text: str, env: Mapping[str, str] | None = None, vllm_version: Version | None = None,
    model_config: Mapping[str, Any] | None = None,
) -> ServeCommand:
    """Parse a shell command or script: continuations, comments and `export K=V` lines.

    Raises:
        ConfigError: when the text is not valid shell quoting.
    """
    joined = re.sub(r"\\\r?\n", " ", text)
    script_env: dict[str, str] = {}
    command: list[str] = []
    for line in joined.splitlines():
        try:
            words = shlex.split(line, comments=True)
        except ValueError as exc:
            raise ConfigError("command", line.strip()[:80], f"valid shell quoting ({exc})")
        if words[:1] == ["export"]:
            script_env.update(w.split("=", 1) for w in words[1:] if "=" in w)  # type: ignore
        elif words and (not command or _is_entrypoint(words)):
            command = words  # the vLLM line wins over anything before it
    merged = {**script_env, **(env or {})}
    return parse_argv(command, merged, vllm_version, model_config)


def parse_kubernetes(
    text: str, env: Mapping[str, str] | None = None, vllm_version: Version | None = None,
    model_config: Mapping[str, Any] | None = None,
) -> ServeCommand:
    """Parse a Kubernetes manifest (any nesting), a container, or a bare `args` list.

    The container whose command or args mention vLLM is used, else the first one with args.
    Env entries with `valueFrom` are recorded as "<valueFrom>".

    Raises:
        ConfigError: when the YAML is invalid or holds no container args.
    """
    try:
        docs = [d for d in yaml.safe_load_all(text) if d is not None]
    except yaml.YAMLError as exc:
        raise ConfigError("deployment", "YAML", f"valid YAML ({exc})") from exc
    containers = [c for d in docs for c in (
        [{"args": d}] if _is_arg_list(d) else _containers(d))]
    if not containers:
        raise ConfigError("deployment", "YAML", "a container with `args` or `command`")
    chosen = next((c for c in containers if "vllm" in json.dumps(c).lower()), containers[0])
    argv = [str(a) for a in (chosen.get("command") or []) + (chosen.get("args") or [])]
    if len(argv) >= 2 and argv[-2] == "-c":  # sh -c "vllm serve ..."
        argv = shlex.split(argv[-1])
    pod_env = {str(e["name"]): str(e["value"]) if "value" in e else "<valueFrom>"
               for e in chosen.get("env") or [] if isinstance(e, dict) and "name" in e}
    version = vllm_version or _version_from_tokens([str(chosen.get("image", ""))])
    return parse_argv(argv, {**pod_env, **(env or {})}, version, model_config)


def load_deployment(
    source: str, env: Mapping[str, str] | None = None, vllm_version: Version | None = None,
    model_config: Mapping[str, Any] | None = None,
) -> ServeCommand:
    """Read `source` (a file path or the text itself) as YAML or a shell command line."""
    path = Path(source)
    text = path.read_text() if len(source) < 4096 and "\n" not in source and path.is_file() \
        else source
    stripped = text.lstrip()
    looks_yaml = stripped.startswith(("apiVersion", "kind:", "args:", "containers:", "- ")) \
        or re.search(r"^\s*(args|containers|command):", text, re.MULTILINE) is not None
    if looks_yaml:
        return parse_kubernetes(text, env, vllm_version, model_config)
    return parse_command_line(text, env, vllm_version, model_config)


def _is_arg_list(node: Any) -> bool:
    """A document that is just a list of arguments."""
    return isinstance(node, list) and bool(node) and all(
        isinstance(a, (str, int, float)) for a in node)


def _containers(node: Any) -> Iterable[dict[str, Any]]:
    if isinstance(node, list):
        for item in node:
            yield from _containers(item)
    elif isinstance(node, dict):
        if "args" in node or "command" in node:
            yield node
            return
        for value in node.values():
            yield from _containers(value)


def _is_entrypoint(words: Sequence[str]) -> bool:
    text = " ".join(words)
    return "vllm serve" in text or "api_server" in text or "vllm.entrypoints" in text


def _after_entrypoint(tokens: list[str]) -> list[str]:
    for i, tok in enumerate(tokens):
        if tok == "serve" and i > 0 and tokens[i - 1].endswith("vllm"):
            return tokens[i + 1:]
        if tok.endswith("api_server") or tok.endswith("api_server.py"):
            return tokens[i + 1:]
    # `docker run ... vllm/vllm-openai:TAG --flags`: flags start after the image.
    for i, tok in enumerate(tokens):
        if _IMAGE_TAG.search(tok) or tok.startswith("vllm/vllm-openai"):
            return tokens[i + 1:]
    return tokens


def _parse_flags(tokens: list[str]) -> tuple[str | None, dict[str, str | None]]:
    model: str | None = None
    flags: dict[str, str | None] = {}
    i = 0
    while i < len(tokens):
        tok = tokens[i]
        i += 1
        if not tok.startswith("-") or _is_number(tok):
            model = model or tok
            continue
        name, eq, value = tok.partition("=")
        name = _SHORT_FLAGS.get(name, name)
        name = "--" + name.lstrip("-").replace("_", "-") if name.startswith("--") else name
        if eq:
            flags[name] = value
        elif name in BOOLEAN_FLAGS or i >= len(tokens) or (
                tokens[i].startswith("-") and not _is_number(tokens[i])):
            flags[name] = None
        else:
            flags[name] = tokens[i]
            i += 1
    return model, flags


def _is_number(tok: str) -> bool:
    try:
        float(tok)
    except ValueError:
        return False
    return True


def _version_from_tokens(tokens: Sequence[str]) -> Version | None:
    for tok in tokens:
        match = _IMAGE_TAG.search(tok)
        if match:
            return parse_version(match.group(1))
    return None


def _connector_names(cfg: Mapping[str, Any]) -> list[str]:
    names = [str(cfg.get("kv_connector", ""))]
    extra = cfg.get("kv_connector_extra_config") or {}
    for child in extra.get("connectors", []) if isinstance(extra, dict) else []:
        if isinstance(child, dict):
            names.extend(_connector_names(child))
    return [n for n in names if n]
