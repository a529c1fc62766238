"""A `vllm serve` deployment as the audit rules see it, parsed from what operators have.

Primitives:
    ServeCommand                      -- flags, env, model, version (frozen)
    parse_command_line(text, env, version)  -- a shell line or script ("A=B vllm serve ...")
    parse_argv(argv, env, version)    -- an already-split argument list
    parse_kubernetes(text, env, version)    -- a Pod/Deployment/container YAML
    load_deployment(path_or_text, ...) -- any of the above, guessed from the content

Flags are read as vLLM's own parser reads them (vllm_flags.py, from a table generated from
that parser): `--flag=value` and `--flag value` are the same, `_` and `-` in flag names are
the same, `-tp 8` is `--tensor-parallel-size 8`, a unique prefix is its flag, a flag takes
as many words as vLLM's parser gives it (none for `--enable-sleep-mode`), and
`--no-enable-prefix-caching` is kept as written. A name vLLM does not know is kept as
written, for the `unrecognized-vllm-argument` rule. A repeated flag keeps its last value, as
argparse does. `--kv-transfer-config.KEY VALUE` words make the object vLLM builds of them,
which replaces the JSON form (`ServeCommand.transfer_config`). Input with no vLLM server
command in it parses to a ServeCommand whose
`entrypoint` is None, for the `not-a-vllm-command` rule.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import math
import re
import shlex
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from kvtier.errors import ConfigError
from kvtier.tools.ops.audit.vllm_flags import read_arguments
from kvtier.tools.ops.vllm_versions import (
    LMCACHE_CONNECTORS,
    NATIVE_CONNECTORS,
    Version,
    offload_flags_connector,
    parse_version,
)

# What comes before `serve`: the `vllm` command, or `python -m vllm.entrypoints.cli.main`.
_SERVE_PROGRAMS = ("vllm", "vllm.entrypoints.cli.main")
_ENV_ASSIGN = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
_IMAGE_TAG = re.compile(r"vllm[-/\w.]*:v?(\d+\.\d+(?:\.\d+)?)")
# vLLM's human-readable integers ("32k" = 32,000, "32K" = 32,768), for token-count flags.
_HUMAN_INT = re.compile(r"^\s*(\d+(?:\.\d+)?)([kKmMgGtT])\s*$")
_HUMAN_MULT = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
               "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
# A source that names a file rather than holding a command (checked when no such file).
_FILE_LIKE = re.compile(r"^[\w./~-]+\.(ya?ml|json|sh|bash|txt|conf|cfg|env)$|^[.~]?/\S+$")
# Kubernetes volume kinds whose files other pods (and nodes) see.
_SHARED_VOLUMES = ("nfs", "cephfs", "glusterfs", "azureFile", "csi")


@dataclass(frozen=True, slots=True)
class ServeCommand:
    """One vLLM server's configuration."""

    model: str | None  # positional model or --model
    flags: Mapping[str, str | None] = field(default_factory=dict)  # "--flag" -> value/None
    env: Mapping[str, str] = field(default_factory=dict)  # environment variables
    vllm_version: Version | None = None  # from --vllm-version or the image tag
    model_config: Mapping[str, Any] | None = None  # the model's config.json, when given
    replicas: int | None = None  # a Kubernetes Deployment/StatefulSet's replicas, when given
    # Mount paths of volumes that other pods see (NFS, CephFS, ...), from a manifest.
    shared_mounts: tuple[str, ...] = ()
    # How the input starts vLLM: "vllm serve", "api_server", the image of `docker run IMAGE`
    # or of a container, "arguments" (a bare argument list: a vLLM image's container args);
    # None when the input holds no vLLM server command (then `model` and `flags` are empty)
    entrypoint: str | None = "vllm serve"
    argv: tuple[str, ...] = ()  # the words of the command the audit read, environment aside
    extra_words: tuple[str, ...] = ()  # positional words after the model: vLLM refuses them
    # a flag of `flags` -> its name as written, where that was an alias or a prefix of it
    # (`--disable-prefix-caching` for `--no-enable-prefix-caching`)
    spellings: Mapping[str, str] = field(default_factory=dict)

    def has(self, flag: str) -> bool:
        return flag in self.flags

    def value(self, flag: str) -> str | None:
        return self.flags.get(flag)

    def number(self, flag: str) -> float | None:
        """The flag's value as a finite number ("32k" and "32K" as vLLM reads them), None
        when absent or not numeric."""
        raw = self.flags.get(flag)
        if raw is None:
            return None
        match = _HUMAN_INT.match(raw)
        try:
            value = float(match.group(1)) * _HUMAN_MULT[match.group(2)] if match else float(raw)
        except ValueError:
            return None
        return value if math.isfinite(value) else None

    @property
    def tp(self) -> int:
        """The tensor-parallel size; 1 when absent or not a positive integer (the
        `malformed-flag-value` rule reports the latter)."""
        value = self.number("--tensor-parallel-size")
        return int(value) if value is not None and value >= 1 and value == int(value) else 1

    def dotted_object(self, flag: str) -> dict[str, Any] | None:
        """The object vLLM builds from `flag.KEY VALUE` words (`--kv-transfer-config.kv_role
        kv_both`), each value read as vLLM reads it; None when there are none."""
        prefix, built = flag + ".", None
        for name, raw in self.flags.items():
            if not name.startswith(prefix) or raw is None:
                continue
            path = name[len(prefix):]
            value = json.dumps(raw.split(",")) if path.endswith("+") else raw
            nested: Any = _dotted_value(value)
            for key in reversed(path.removesuffix("+").split(".")):
                nested = {key: nested}
            built = _merge(built or {}, nested)
        return built

    @property
    def transfer_config(self) -> dict[str, Any] | None:
        """The KV transfer config vLLM reads: the object of `--kv-transfer-config.KEY` words
        when there are any (vLLM passes it after the JSON form, and argparse keeps the last),
        else the parsed `--kv-transfer-config` JSON (None when absent or not a JSON object)."""
        dotted = self.dotted_object("--kv-transfer-config")
        if dotted is not None:
            return dotted
        raw = self.value("--kv-transfer-config")
        if not raw:
            return None
        try:
            parsed = json.loads(raw)
        except json.JSONDecodeError:
            return None
        return parsed if isinstance(parsed, dict) else None

    @property
    def transfer_config_problem(self) -> str | None:
        """What is wrong with `--kv-transfer-config`, None when absent or a JSON object."""
        if not self.has("--kv-transfer-config"):
            return None
        raw = self.value("--kv-transfer-config")
        if not raw or not raw.strip():
            return "no value (it takes a JSON object)"
        try:
            parsed = json.loads(raw)
        except json.JSONDecodeError as exc:
            return _json_problem(raw, exc)
        except RecursionError:
            return "JSON nested too deeply"
        if not isinstance(parsed, dict):
            return f"{_json_kind(parsed)}, not an object ({{\"kv_connector\": ...}})"
        return None

    @property
    def flags_connector(self) -> str | None:
        """The connector `--kv-offloading-size` (and `--kv-offloading-backend`) makes, as the
        audited release names it; None without those flags."""
        if not self.has("--kv-offloading-size"):
            return None
        return offload_flags_connector(self.vllm_version,
                                       self.value("--kv-offloading-backend") or "native")

    @property
    def connectors(self) -> tuple[str, ...]:
        """Every KV connector in effect (MultiConnector children included)."""
        names: list[str] = [] if self.flags_connector is None else [self.flags_connector]
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
    entrypoint, start = _entrypoint(tokens)
    if entrypoint is None:
        return ServeCommand(model=None, env=env_out, vllm_version=version,
                            model_config=model_config, entrypoint=None, argv=tuple(tokens))
    args = read_arguments(tokens[start:])
    flags = dict(args.flags)
    model = flags.pop("--model", None) or args.model
    return ServeCommand(model=model, flags=flags, env=env_out, vllm_version=version,
                        model_config=model_config, entrypoint=entrypoint, argv=tuple(tokens),
                        extra_words=args.extra_words, spellings=args.spellings)


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
    lines = joined.splitlines()
    while lines:
        line = lines.pop(0)
        while True:
            try:
                words = shlex.split(line, comments=True)
                break
            except ValueError as exc:
                # A quoted string may span lines, as the README's --kv-transfer-config JSON
                # does: the shell reads on, and so does this.
                if lines and "closing quotation" in str(exc):
                    line += "\n" + lines.pop(0)
                    continue
                raise ConfigError("command", line.strip()[:80],
                                  f"valid shell quoting ({exc})") from exc
        if words[:1] == ["export"]:
            script_env.update(w.split("=", 1) for w in words[1:] if "=" in w)  # type: ignore
        elif words and (not command or _entrypoint(words)[0] not in (None, "arguments")):
            command = words  # the vLLM line wins over anything before it
    merged = {**script_env, **(env or {})}
    return parse_argv(command, merged, vllm_version, model_config)


def parse_kubernetes(
    text: str, env: Mapping[str, str] | None = None, vllm_version: Version | None = None,
    model_config: Mapping[str, Any] | None = None,
) -> ServeCommand:
    """Parse a Kubernetes manifest (any nesting), a container, or a bare `args` list.

    The container whose command and args start vLLM is used, else the first that mentions
    vLLM, else the first one with args; its `args` go to a vLLM image's own entrypoint only
    when it sets no `command` (as Kubernetes runs it).
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
    # The container that starts vLLM; else the first that mentions it (an init container of
    # a vLLM image that runs `sh -c "chown ..."` does not start it: kvtier's node DaemonSet).
    argvs = [_container_argv(c) for c in containers]
    chosen, argv = next(((c, a) for c, a in zip(containers, argvs)
                         if _entrypoint(a)[0] not in (None, "arguments")), (None, []))
    if chosen is None:
        chosen = next((c for c in containers
                       if "vllm" in json.dumps(c, default=str).lower()), containers[0])
        argv = argvs[containers.index(chosen)]
    image = str(chosen.get("image", ""))
    if _is_vllm_image(image) and not chosen.get("command") and _entrypoint(argv)[0] is None:
        # Kubernetes hands `args` to the image's own entrypoint (`vllm serve`) only when the
        # container sets no `command`: a `command` replaces that entrypoint.
        argv = [image, *argv]
    pod_env = {str(e["name"]): str(e["value"]) if "value" in e else "<valueFrom>"
               for e in _as_list(chosen.get("env")) if isinstance(e, dict) and "name" in e}
    version = vllm_version or _version_from_tokens([image])
    cmd = parse_argv(argv, {**pod_env, **(env or {})}, version, model_config)
    return dataclasses.replace(cmd, replicas=_replicas(docs),
                               shared_mounts=_shared_mounts(docs, chosen))


def load_deployment(
    source: str, env: Mapping[str, str] | None = None, vllm_version: Version | None = None,
    model_config: Mapping[str, Any] | None = None,
) -> ServeCommand:
    """Read `source` (a file path or the text itself) as YAML or a shell command line.

    A file named *.yaml/*.yml/*.json is always read as YAML.

    Raises:
        ConfigError: naming `source` when it names a directory, a file that does not exist or
            cannot be read as UTF-8 text, or when its content is not valid shell or YAML.
    """
    is_path = bool(source.strip()) and len(source) < 4096 and "\n" not in source
    suffix = ""
    if is_path and _is_path(source, Path.is_dir):
        raise ConfigError("source", source, "a file holding a command line or manifest, not "
                          "a directory")
    if is_path and _is_path(source, Path.is_file):
        text, suffix = read_text_file(source, "source"), Path(source).suffix.lower()
    elif is_path and _FILE_LIKE.match(source.strip()) and _entrypoint(source.split())[0] is None:
        raise ConfigError("source", source, "an existing file (no such file) or a quoted "
                          "`vllm serve ...` command line")
    else:
        text = source
    stripped = text.lstrip()
    looks_yaml = stripped.startswith(("apiVersion", "kind:", "args:", "containers:", "- ")) \
        or re.search(r"^\s*(args|containers|command):", text, re.MULTILINE) is not None \
        or suffix in (".yaml", ".yml", ".json")
    if looks_yaml:
        return parse_kubernetes(text, env, vllm_version, model_config)
    return parse_command_line(text, env, vllm_version, model_config)


def _is_path(source: str, test: Callable[[Path], bool]) -> bool:
    """Whether `source` names a path that passes `test` (Path.is_file, Path.is_dir); False
    for text no path could be named (a NUL byte, a component longer than the OS allows: a
    long command line often has one)."""
    try:
        return test(Path(source))
    except (OSError, ValueError):
        return False


def read_text_file(path: str | Path, argument: str) -> str:
    """The UTF-8 text of `path`.

    Raises:
        ConfigError: naming `argument` when the file cannot be read or is not UTF-8 text.
    """
    try:
        return Path(path).read_bytes().decode("utf-8")
    except OSError as exc:
        raise ConfigError(argument, str(path), f"a readable file ({exc.strerror or exc})") \
            from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(argument, str(path), f"UTF-8 text (byte {exc.start} is not)") \
            from exc


def _dotted_value(raw: str) -> Any:
    """A `--flag.key` word's value as vLLM's FlexibleArgumentParser reads it: JSON, else a
    human-readable integer ("8k" 8,000, "8K" 8,192; no decimals with a binary suffix), else
    the text."""
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, RecursionError):
        pass
    match = _HUMAN_INT.match(raw)
    if match and (match.group(2).islower() or "." not in match.group(1)):
        return int(float(match.group(1)) * _HUMAN_MULT[match.group(2)])
    try:
        return int(raw)
    except ValueError:
        return raw


def _merge(into: dict[str, Any], update: Mapping[str, Any]) -> dict[str, Any]:
    """`update` merged into `into` as vLLM merges dotted keys: objects key by key, lists
    joined, anything else replaced."""
    for key, value in update.items():
        if isinstance(value, Mapping) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        elif isinstance(value, list) and isinstance(into.get(key), list):
            into[key] = into[key] + value
        else:
            into[key] = value
    return into


def _json_problem(raw: str, exc: json.JSONDecodeError) -> str:
    """Say what is wrong with text that is not JSON, in an operator's words."""
    try:
        literal = ast.literal_eval(raw)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        literal = None
    if isinstance(literal, dict):
        return "a Python dict, not JSON (JSON needs double quotes, true/false/null)"
    if exc.pos >= len(raw.rstrip()):
        return f"truncated JSON ({exc.msg} at the end: a closing brace or quote is missing)"
    return f"not valid JSON ({exc.msg} at character {exc.pos})"


def _json_kind(value: Any) -> str:
    if value is None:
        return "JSON null"
    if isinstance(value, bool):
        return "a JSON boolean"
    if isinstance(value, list):
        return "a JSON array"
    if isinstance(value, str):
        return "a JSON string"
    return "a JSON number"


def _as_list(value: Any) -> list[Any]:
    """A manifest field that should be a list: a lone string or number is one item."""
    if value is None:
        return []
    return list(value) if isinstance(value, list) else [value]


def _replicas(docs: Sequence[Any]) -> int | None:
    """The largest `spec.replicas` among the documents, None when none states it."""
    counts = [d["spec"]["replicas"] for d in docs if isinstance(d, dict)
              and isinstance(d.get("spec"), dict)
              and isinstance(d["spec"].get("replicas"), int)
              and not isinstance(d["spec"].get("replicas"), bool)]
    return max(counts) if counts else None


def _shared_mounts(docs: Sequence[Any], container: Mapping[str, Any]) -> tuple[str, ...]:
    """Mount paths of `container` whose volume is a network file system."""
    shared_names = {str(v.get("name")) for v in _volumes(docs)
                    if any(kind in v for kind in _SHARED_VOLUMES)}
    mounts = container.get("volumeMounts") or []
    return tuple(str(m.get("mountPath")) for m in mounts if isinstance(m, dict)
                 and str(m.get("name")) in shared_names and m.get("mountPath"))


def _volumes(node: Any) -> Iterable[dict[str, Any]]:
    if isinstance(node, list):
        for item in node:
            yield from _volumes(item)
    elif isinstance(node, dict):
        volumes = node.get("volumes")
        if isinstance(volumes, list):
            yield from (v for v in volumes if isinstance(v, dict))
        for value in node.values():
            if isinstance(value, (dict, list)):
                yield from _volumes(value)


def _container_argv(container: Mapping[str, Any]) -> list[str]:
    """A container's command and args as words (`sh -c "vllm serve ..."`: the script's).

    Raises:
        ConfigError: a `sh -c` script that is not valid shell quoting.
    """
    argv = [str(a) for a in _as_list(container.get("command")) + _as_list(container.get("args"))]
    if len(argv) >= 2 and argv[-2] == "-c":  # sh -c "vllm serve ..."
        try:
            argv = shlex.split(argv[-1])
        except ValueError as exc:
            raise ConfigError("deployment", argv[-1][:80], f"valid shell quoting ({exc})") \
                from exc
    return argv


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


def _entrypoint(tokens: Sequence[str]) -> tuple[str | None, int]:
    """How `tokens` start a vLLM server, and the index where vLLM's arguments begin: see
    `ServeCommand.entrypoint`; (None, len(tokens)) when they do not start one."""
    for i, tok in enumerate(tokens):
        if tok == "serve" and i > 0 and tokens[i - 1].endswith(_SERVE_PROGRAMS):
            return "vllm serve", i + 1
        if "vllm" in tok and tok.endswith(("api_server", "api_server.py")):
            return "api_server", i + 1
    # `docker run ... vllm/vllm-openai:TAG --flags`: flags start after the image.
    for i, tok in enumerate(tokens):
        if _is_vllm_image(tok):
            return tok, i + 1
    if tokens and tokens[0].startswith("-"):
        return "arguments", 0
    return None, len(tokens)


def _is_vllm_image(word: str) -> bool:
    return bool(_IMAGE_TAG.search(word)) or word.startswith("vllm/vllm-openai")


def _version_from_tokens(tokens: Sequence[str]) -> Version | None:
    for tok in tokens:
        match = _IMAGE_TAG.search(tok)
        if match:
            return parse_version(match.group(1))
    return None


def _connector_names(cfg: Mapping[str, Any]) -> list[str]:
    names = [str(cfg.get("kv_connector", ""))]
    extra = cfg.get("kv_connector_extra_config") or {}
    children = extra.get("connectors") if isinstance(extra, dict) else None
    for child in children if isinstance(children, list) else []:
        if isinstance(child, dict):
            names.extend(_connector_names(child))
    return [n for n in names if n]
