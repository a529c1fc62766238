"""`kvtier serve MODEL [-- extra vllm args]`: vLLM's OpenAI server with kvtier configured.

Prints the exact command first (so nothing is magic), then runs it in the foreground until
Ctrl-C, and stops vLLM's whole process group on the way out, its temp dir with it (a folder
of the host's temp dir, as `kvtier.tools.ops.server` gives it; `needs_host_temp_dir` says
when the host's own is kept). Before vLLM starts, a disk
directory that a running engine of the model owns is refused in one line (vLLM's own refusal
came once the model was loaded: `refuse_owned_disks`). Thin layer over
kvtier.tools.ops.serving
and kvtier.tools.ops.server.

    kvtier serve ./my-model                      # tiers sized from free RAM and disk
    kvtier serve ./my-model --memory 8GiB --disk-path /nvme/kv --disk 200GiB
    kvtier serve ./my-model --config store.yaml -- --max-model-len 8192
    kvtier serve ./my-model --tokens-per-chunk 64 -- --block-size 32
    kvtier serve ./my-model --no-kvtier          # the same server without kvtier (baseline)
    kvtier serve ./my-model --config shared.yaml --kv-role kv_producer   # prefill instance
    kvtier serve ./my-model --node /run/kvtier/node.sock   # the node's cache (kvtier node)
    kvtier serve ./my-model --served-model-name my-model   # the name clients send
    kvtier serve ./my-model --dry-run            # print the command only

A model `kvtier.testing.tinymodel` generated (`kvtier demo`'s, the tests') is served under
a short name by default, "kvtier-tiny" or "kvtier-bench", its directory kept as a second
name.

With kvtier, the server takes clients' `cache_control` markers (Anthropic's prompt caching,
as agent SDKs and Dynamo's `nvext` send them): the prompt up to a marker is pinned in kvtier
for its TTL ("5m" by default, "1h"), through vLLM's `--middleware`
(kvtier.integrations.vllm.cachecontrol; docs/retention.md).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from kvtier.errors import ConfigError, DirectoryInUse, ServerError
from kvtier.integrations.vllm.config import ConnectorConfig
from kvtier.redaction import redact_value
from kvtier.testing.tinymodel import (
    default_model_root,
    make_preset_model,
    preset_named,
    served_name,
)
from kvtier.tiers import refuse_owned
from kvtier.tools.cli.argtypes import (
    any_path,
    listen_host,
    port_number,
    positive_int,
    tier_size,
    tier_size_or_zero,
)
from kvtier.tools.ops.audit.vllm_flags import read_arguments
from kvtier.tools.ops.server import VllmServer
from kvtier.tools.ops.serving import (
    KV_ROLES,
    ServeCommand,
    ServeConfig,
    build_command,
    connector_config,
    default_tiers,
    is_cpu_backend,
    load_connector_config,
)
from kvtier.units import parse_size


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "serve", help="start vLLM's OpenAI-compatible server with kvtier",
        description=__doc__.split("\n\n")[0],
        epilog="Arguments after `--` go to vLLM verbatim; refused there: --model, --host "
               "and --port (MODEL, --host and --port set them), a KV cache size beside "
               "--engine-kv, --served-model-name beside kvtier serve's, and with kvtier "
               "--kv-transfer-config, which kvtier sets, and --kv-offloading-size, with which "
               "vLLM replaces kvtier (--config FILE takes its settings). "
               "With kvtier, requests' "
               "cache_control markers ({\"type\": \"ephemeral\", \"ttl\": \"5m\"} on a "
               "message, content part or the request) pin the prompt up to them in kvtier "
               "for the TTL, within the tiers' max_pinned_share (docs/retention.md).")
    p.add_argument("model", help="model name or local directory (vLLM's --model); "
                                 "kvtier-tiny or kvtier-bench: kvtier's generated model, "
                                 "written into ~/.cache/kvtier/models on first use")
    p.add_argument("--host", type=listen_host, default="127.0.0.1",
                   help="listen address (default 127.0.0.1)")
    p.add_argument("--port", type=port_number, default=8000,
                   help="listen port, 1-65535 (default 8000)")
    p.add_argument("--memory", type=tier_size_or_zero,
                   help="kvtier memory tier size, e.g. 8GiB (default: a share of the "
                        "available RAM; 0: no memory tier)")
    p.add_argument("--disk-path", type=any_path, help="kvtier disk tier directory "
                                                  "(default ~/.cache/kvtier/kv)")
    p.add_argument("--disk", type=tier_size_or_zero,
                   help="kvtier disk tier size (default: half the free space, at most "
                        "100GiB; 0: no disk tier)")
    p.add_argument("--config", type=any_path, help="a kvtier store config file (YAML/JSON); "
                                               "replaces --memory/--disk/--disk-path")
    p.add_argument("--node", help="the socket of `kvtier node serve`: every tier is the "
                   "node's, shared with the node's other engines and kept across restarts")
    p.add_argument("--tokens-per-chunk", type=positive_int,
                   help="tokens per stored chunk, a multiple of vLLM's --block-size "
                        "(default: the connector's, 256 or the first multiple of the engine's "
                        "block above it; smaller chunks recompute less of a returning "
                        "prompt's tail, at more chunks per prompt: docs/performance.md). CPU "
                        "backend without --block-size: a multiple of 32; one 128 does not "
                        "divide gets a --block-size that divides it")
    p.add_argument("--engine-kv", type=tier_size,
                   help="the engine's own KV cache size (vLLM's --kv-cache-memory-bytes; "
                        "default: vLLM's, on the CPU backend a share of RAM)")
    p.add_argument("--kv-role", choices=KV_ROLES,
                   help="vLLM's kv_role: kv_producer (a disaggregated prefill instance: "
                        "only stores), kv_consumer (its decode instance: only loads); see "
                        "`kvtier proxy` (default kv_both)")
    p.add_argument("--no-kvtier", action="store_true",
                   help="start the same server without kvtier (a baseline; kvtier's own "
                        "options, tiers, --tokens-per-chunk, --kv-role, are refused)")
    p.add_argument("--served-model-name", metavar="NAME",
                   help="the model's name in the API (vLLM's --served-model-name; default: "
                        "MODEL, or for a generated kvtier model a short name such as "
                        "kvtier-bench, MODEL still accepted)")
    p.add_argument("--dry-run", action="store_true", help="print the command and exit")
    # REMAINDER swallows every argument after MODEL, kvtier's options included; `run` splits
    # it at `--` and parses the part before it again (argparse cannot do this in one pass).
    p.add_argument("vllm_args", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    p.set_defaults(func=run, parser=p)


def split_args(args: argparse.Namespace) -> argparse.Namespace:
    """Parse the kvtier options given after MODEL; leave what follows `--` in vllm_args."""
    rest = list(args.vllm_args)
    mine, theirs = (rest[:rest.index("--")], rest[rest.index("--") + 1:]) if "--" in rest \
        else (rest, [])
    if mine:
        args.parser.parse_args([*mine, args.model], namespace=args)
    args.vllm_args = theirs
    return args


# The options only kvtier reads (dests): the baseline server, --no-kvtier, refuses them.
KVTIER_ONLY = ("memory", "disk", "disk_path", "config", "node", "tokens_per_chunk", "kv_role")


def config_from_args(args: argparse.Namespace) -> ServeConfig:
    """The ServeConfig the arguments describe. Raises ConfigError."""
    if args.no_kvtier:  # the baseline dropped them: a server with no tier, or no kv_role
        given = next((name for name in KVTIER_ONLY if getattr(args, name) is not None), None)
        if given is not None:
            raise ConfigError("--" + given.replace("_", "-"), str(getattr(args, given)),
                              "not with --no-kvtier: the server without kvtier reads no "
                              "tier, chunk or kv_role option")
    vllm_args = list(args.vllm_args)
    if args.served_model_name is not None and \
            "--served-model-name" in read_arguments(vllm_args).flags:  # vLLM keeps the last
        raise ConfigError("--served-model-name", args.served_model_name, "either kvtier "
                          "serve's --served-model-name or vLLM's after `--`, not both")
    cpu = is_cpu_backend()
    extra = None
    if not args.no_kvtier:
        if args.node is not None:
            if args.config is not None or args.memory or args.disk or args.disk_path:
                raise ConfigError("node", args.node, "either --node (the tiers are the "
                                  "node's) or --config/--memory/--disk/--disk-path, not both")
            extra = {"node": str(Path(args.node).absolute())}
        elif args.config is not None:
            if args.memory or args.disk or args.disk_path:
                raise ConfigError("config", str(args.config),
                                  "either --config or --memory/--disk/--disk-path, not both")
            extra = load_connector_config(args.config)
        else:
            extra = connector_config(default_tiers(
                cpu=cpu,
                memory_bytes=None if args.memory is None else parse_size(args.memory, "memory"),
                disk_path=args.disk_path,
                disk_bytes=None if args.disk is None else parse_size(args.disk, "disk")))
    if extra is not None and args.tokens_per_chunk is not None:
        if args.tokens_per_chunk < 1:
            raise ConfigError("tokens_per_chunk", args.tokens_per_chunk, "a positive integer")
        extra["tokens_per_chunk"] = args.tokens_per_chunk
    engine_kv = None if args.engine_kv is None else parse_size(args.engine_kv, "engine_kv")
    model = embedded_model(args.model)
    return ServeConfig(model=model, kvtier=not args.no_kvtier, extra_config=extra,
                       host=args.host, port=args.port, cpu=cpu, engine_kv_bytes=engine_kv,
                       vllm_args=tuple(vllm_args), kv_role=args.kv_role or "kv_both",
                       served_model_name=served_names(model, args.served_model_name))


def embedded_model(model: str) -> str:
    """MODEL; for the served name of an embedded model (kvtier-tiny, kvtier-bench, ...) that
    is no path here, the directory of that generated model (written now, or before)."""
    preset = preset_named(model)
    if preset is None or Path(model).exists():
        return model
    print(f"# kvtier serve: {model} is kvtier's generated model ({preset!r} preset)",
          flush=True)
    return str(make_preset_model(preset, default_model_root()))


def served_names(model: str, name: str | None) -> tuple[str, ...]:
    """The --served-model-name values: `name` when given; for a model kvtier generated, its
    short name and then MODEL (so clients that send the directory still work); else none
    (vLLM serves MODEL under its own name)."""
    if name is not None:
        if not name.strip():
            raise ConfigError("served_model_name", name, "a non-empty name")
        return (name,)
    short = served_name(model)
    return (short, model) if short is not None else ()


# How long vLLM has to stop after `kvtier serve` is told to (then it is killed): well inside
# what whoever stops kvtier serve waits before killing it (Kubernetes' 30 s grace, a test
# harness's 20 s), or vLLM, in a process group of its own, would outlive it.
STOP_GRACE_S = 10.0


def run(args: argparse.Namespace) -> int:
    """Entry point of `kvtier serve`; returns the exit code."""
    cfg = config_from_args(split_args(args))
    command = build_command(cfg)
    print("# kvtier serve runs:")
    for note in command.notes:
        print(f"#   {note}")
    if command.kv_transfer_config is not None:
        print("#   kv_connector_extra_config: " + json.dumps(
            redact_value(command.kv_transfer_config["kv_connector_extra_config"])))
    print(command.display(), flush=True)
    if args.dry_run:
        return 0
    try:
        refuse_owned_disks(cfg, command)
    except DirectoryInUse as exc:
        print(f"kvtier: {exc}", file=sys.stderr)
        return 1
    # A temp dir of its own, removed at the stop (vLLM leaves its rendezvous file there at
    # each one), unless the server needs the host's (`needs_host_temp_dir`).
    server = VllmServer(command, own_temp_dir=not needs_host_temp_dir(command))
    # vLLM runs in its own process group (so that stop() reaches its engine processes); a
    # SIGTERM/SIGHUP to `kvtier serve` stops it through `finally` (main.ENDING_SIGNALS).
    try:
        server.start()
        server.wait_ready()
        argv = command.argv
        model = argv[argv.index("--served-model-name") + 1] \
            if "--served-model-name" in argv[:len(argv) - len(cfg.vllm_args)] else cfg.model
        print(f"\nkvtier: serving {model!r} at {server.url}/v1 — try:  kvtier bench "
              f"multi-round --url {server.url}", flush=True)
        assert server.proc is not None
        server.proc.wait()
    except ServerError as exc:
        print(f"kvtier: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        pass
    finally:
        code = server.stop(grace_s=STOP_GRACE_S)
    return 0 if code in (0, -15, None) else int(code)


def needs_host_temp_dir(command: ServeCommand) -> bool:
    """Whether the server must share the host's temp dir: its weights come from vLLM's
    weight cache daemon (load format `ipc_cache`, for the model or a draft), whose socket vLLM
    looks for in `<temp dir>/vllm_weight_cache_<uid>` and refuses through a symlink. Then
    vLLM's rendezvous file stays in the host's temp dir at the stop, as before."""
    return any("ipc_cache" in word for word in command.argv)


def refuse_owned_disks(cfg: ServeConfig, command: ServeCommand) -> None:
    """Refuse, before vLLM starts, a disk tier whose directory for this model another engine
    owns: vLLM opens the tiers only once the model is loaded (tiers/files/owner.py), so the
    refusal came a whole start-up later. A directory whose manifest names another model is
    another engine's to share the path with.

    Raises:
        DirectoryInUse: the directory, its owner's pid and the remedy, in one line.
    """
    if command.kv_transfer_config is None:
        return
    extra = command.kv_transfer_config["kv_connector_extra_config"]
    refuse_owned(ConnectorConfig.parse(extra).store, namespace_models(cfg, command.argv))


def namespace_models(cfg: ServeConfig, argv: Sequence[str]) -> set[str]:
    """The names that a manifest of this server's model may hold (the connector names a
    namespace by the first served name, else --model): MODEL and the first value of each
    --served-model-name in `argv`."""
    names = {cfg.model}
    for i, arg in enumerate(argv):
        if arg == "--served-model-name" and i + 1 < len(argv):
            names.add(argv[i + 1])
        elif arg.startswith("--served-model-name="):
            names.add(arg.split("=", 1)[1])
    return names

