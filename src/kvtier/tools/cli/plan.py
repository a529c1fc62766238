"""`kvtier plan`: size the KV tiers for a model on a machine and print the serve flags, and
the router weights a hit on each tier is worth (llm-d, NVIDIA Dynamo: restorecost.py), from
the plan's cost model and, with `--metrics URL`, from a running server's measured costs;
with `--node-engines N`, one `kvtier node` for N engines of the model (nodeplan.py)."""

from __future__ import annotations

import argparse
import json
import math
import shutil
from dataclasses import asdict
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from kvtier.errors import ConfigError
from kvtier.node.cli import DEFAULT_SOCKET
from kvtier.tiers.shmslab import SHM_DIR
from kvtier.tools.cli.argtypes import (
    fraction,
    non_negative_int,
    path_text,
    positive_float,
    positive_int,
    size_gb,
)
from kvtier.tools.cli.weights import print_router_weights
from kvtier.tools.ops.attention_kernels import BackendChoice, choose_backend, describe_choice
from kvtier.tools.ops.flags import gib_number, sglang_per_rank_to_vllm_total
from kvtier.tools.ops.hardware import gpu_profile
from kvtier.tools.ops.modelspec import load_model_spec
from kvtier.tools.ops.nodeplan import MAX_LAYOUTS, NodePlan
from kvtier.tools.ops.plan_request import PlanRequest
from kvtier.tools.ops.restorecost import (
    WEIGHT_FORMULA,
    TierWeight,
    read_measured,
    tier_weight,
)
from kvtier.tools.ops.sizing import Alternative, Plan, TierEstimate, make_plan
from kvtier.tools.ops.vllm_versions import (
    defaults_for,
    format_version,
    installed_vllm_version,
    parse_version,
)
from kvtier.units import format_size, parse_size

_GIB = 1024**3
MAX_PARAMS = 1e15  # parameters of a model, at most (the largest today: ~2e12)


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser("plan", help="size KV tiers and print vLLM/kvtier/LMCache flags")
    p.add_argument("model", help="path to the model's config.json (or its folder)")
    p.add_argument("--tp", type=positive_int, default=1, help="tensor-parallel size (default 1)")
    p.add_argument("--gpu", default="h100", help="h100, h200, a100, l40s or cpu (default h100)")
    p.add_argument("--hbm", help="override GPU memory, e.g. 94GiB")
    p.add_argument("--gpu-memory-utilization", type=fraction, default=0.9)
    p.add_argument("--host-ram", help="host RAM of the node (default 256GiB per GPU)")
    p.add_argument("--host-kv-fraction", type=fraction, default=0.6,
                   help="share of host RAM for the CPU tier (default 0.6)")
    p.add_argument("--nvme", help="NVMe space for the disk tier (default: a 4TB drive, said as "
                   "an assumption); 0 = none")
    p.add_argument("--nvme-path", type=absolute_path, default="/mnt/nvme/kvtier")
    p.add_argument("--nvme-gen", type=int, default=4, choices=(4, 5))
    p.add_argument("--pcie-gen", type=int, choices=(4, 5), help="default: the GPU's own")
    p.add_argument("--context", type=non_negative_int, default=0,
                   help="typical session length in tokens (default min(model max, 32768))")
    p.add_argument("--concurrency", type=positive_int, default=16, help="target live sessions")
    p.add_argument("--kv-dtype", default="bf16",
                   help="vLLM --kv-cache-dtype: bf16, fp8, int8_per_token_head, nvfp4, "
                        "turboquant_k8v4, ... (default bf16)")
    p.add_argument("--params", type=param_count,
                   help="override the parameter count, e.g. 70.6e9")
    p.add_argument("--vllm-version", help="target vLLM release (default: installed, if any)")
    p.add_argument("--from-sglang", type=size_gb, metavar="GB_PER_RANK",
                   help="SGLang per-rank host KV size to convert (x TP) into the CPU tier")
    p.add_argument("--served-model", metavar="NAME",
                   help="the model as `vllm serve` takes it in the printed commands (default: "
                        "the folder holding config.json, else its _name_or_path)")
    p.add_argument("--metrics", metavar="URL",
                   help="a kvtier-served vLLM's /metrics: router weights from its measured "
                        "restore and recompute costs, beside the modelled ones")
    p.add_argument("--store-config", metavar="FILE",
                   help="the server's kvtier config: its tokens_per_chunk sizes the chunks of a "
                        "model with state layers; with --metrics, each measured tier is filed "
                        "under its medium (the static guess it replaces)")
    p.add_argument("--tokens-per-chunk", type=positive_int, metavar="N",
                   help="kvtier's tokens_per_chunk in its command, which sizes the chunks of "
                        "a model with state layers (a multiple of vLLM's block size; default: "
                        "--store-config's, else kvtier's pick)")
    p.add_argument("--node-engines", type=positive_int, metavar="N",
                   help="N engines of this model (each --tp ranks) on one node: size one "
                        "`kvtier node` for them (its RAM tier in /dev/shm, the prefixes it "
                        "holds against N private tiers, its commands); --host-ram is then "
                        "the node's")
    p.add_argument("--node-socket", type=path_text, metavar="PATH",
                   help=f"the node's socket in the commands (default {DEFAULT_SOCKET}; "
                        "with --node-engines)")
    p.add_argument("--node-shm", metavar="SIZE",
                   help="the node's /dev/shm, e.g. 768GiB (default: half its RAM, a tmpfs's "
                        "default; with --node-engines)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Compute and print the plan. Raises ConfigError on bad input (exit 2)."""
    version = parse_version(args.vllm_version, "--vllm-version") \
        if args.vllm_version is not None else installed_vllm_version()
    cpu_tier = None
    if args.from_sglang is not None:
        cpu_tier = int(sglang_per_rank_to_vllm_total(args.from_sglang, args.tp) * _GIB)
    spec = load_model_spec(args.model, int(args.params) if args.params else None)
    if args.hbm is not None:
        _machine_bytes(args.hbm, "--hbm", "94GiB")
    req = PlanRequest(
        model=spec, model_ref=args.served_model or _model_ref(args.model, spec.name),
        gpu=gpu_profile(args.gpu, args.hbm), tp=args.tp,
        gpu_memory_utilization=args.gpu_memory_utilization,
        host_ram_bytes=_host_ram(args.host_ram),
        host_kv_fraction=args.host_kv_fraction,
        nvme_bytes=None if args.nvme is None else _machine_bytes(args.nvme, "--nvme", "3.5TiB",
                                                                 zero_ok=True),
        nvme_path=args.nvme_path, nvme_gen=args.nvme_gen, pcie_gen=args.pcie_gen,
        context_tokens=args.context, concurrency=args.concurrency, kv_dtype=args.kv_dtype,
        vllm_version=version, cpu_tier_bytes=cpu_tier,
        tokens_per_chunk=args.tokens_per_chunk or _store_tokens_per_chunk(args.store_config),
        **_node_request(args))
    plan = make_plan(req)
    weights = router_weights(plan, args.metrics, args.store_config)
    if args.json:
        print(json.dumps(plan_to_dict(plan) | {"router_weight_formula": WEIGHT_FORMULA,
                                                "router_weights": [asdict(w) for w in weights]},
                         indent=2))
    else:
        _print(plan)
        print_router_weights(Console(width=max(Console().width, 120)), weights)
    return 0


def absolute_path(text: str) -> str:
    """A directory's absolute path (`path_text`): the printed configs and LMCache's file://
    URI name it from wherever the server starts."""
    text = path_text(text)
    if not text.startswith("/"):
        raise argparse.ArgumentTypeError(f"{text!r}: an absolute path, e.g. /mnt/nvme/kvtier")
    return text


def param_count(text: str) -> float:
    """A model's parameter count: > 0 and at most 1e15 (a typo's digits would size weights
    no GPU holds, and say so of the GPU rather than of the count)."""
    value = positive_float(text)
    if value > MAX_PARAMS:
        raise argparse.ArgumentTypeError(f"{text!r}: at most {MAX_PARAMS:g} (e.g. 70.6e9)")
    return value


def _host_ram(text: str | None) -> int:
    """`--host-ram` in bytes; 0 when not given (the plan assumes a host's RAM)."""
    if text is None:
        return 0
    return _machine_bytes(text, "--host-ram", "512GiB")


# A machine's memory or drive below this is a unit left out: `--host-ram 64` was 64 bytes,
# planned as such (a CPU tier of 38 B, `--kv-offloading-size 0` in the commands).
MIN_MACHINE_BYTES = _GIB


def _machine_bytes(text: str, option: str, example: str, zero_ok: bool = False) -> int:
    """The size `text` of a machine's memory or drive, in bytes: at least MIN_MACHINE_BYTES
    (or 0, where `zero_ok`: none).

    Raises:
        ConfigError: naming `option`, for a size that is no size or below 1 GiB.
    """
    size = parse_size(text, option)
    if size < MIN_MACHINE_BYTES and not (zero_ok and size == 0):
        raise ConfigError(option, text, f"a size of at least 1GiB, e.g. {example} (a bare "
                          "number is bytes)" + (", or 0 for none" if zero_ok else ""))
    return size


def router_weights(plan: Plan, metrics_url: str | None = None,
                   store_config: str | None = None) -> tuple[TierWeight, ...]:
    """The plan's tiers' weights from its cost model (one session's load vs its re-prefill),
    then, with `metrics_url`, each measured tier's.

    Raises:
        ConfigError: an unreadable /metrics or store config.
    """
    per_1k = 1000 / plan.context_tokens if plan.context_tokens else 0.0
    rows = [tier_weight(t.name, "model", t.medium, t.load_s * per_1k, plan.reprefill_s * per_1k)
            for t in plan.tiers]
    # `is not None`: an empty --metrics ("$METRICS_URL", the variable unset) is refused by
    # fetch_metrics, as `kvtier inspect` refuses it, not taken for the option left out
    if metrics_url is not None:
        store = None
        if store_config is not None:
            from kvtier.tools.cli.inspect import load_store

            store = load_store(store_config)
        rows += read_measured(metrics_url, store)[1]
    return tuple(rows)


def _node_request(args: argparse.Namespace) -> dict[str, Any]:
    """PlanRequest's node fields from --node-*; this machine's /dev/shm measured.

    Raises:
        ConfigError: naming --node-socket or --node-shm given without --node-engines, or a
            --node-shm that is not a size > 0.
    """
    if not args.node_engines:
        for option, value in (("--node-socket", args.node_socket),
                              ("--node-shm", args.node_shm)):
            if value is not None:
                raise ConfigError(option, value, "only with --node-engines N")
        return {}
    shm = 0
    if args.node_shm is not None:
        shm = _machine_bytes(args.node_shm, "--node-shm", "768GiB")
    local = shutil.disk_usage(SHM_DIR).total if SHM_DIR.is_dir() else None
    return {"node_engines": args.node_engines, "node_socket": args.node_socket or DEFAULT_SOCKET,
            "node_shm_bytes": shm, "local_shm_bytes": local}


def _store_tokens_per_chunk(path: str | None) -> int | None:
    """The tokens_per_chunk a kvtier config file sets (validated later), or None.

    Raises:
        ConfigError: naming --store-config, for a file that cannot be read as a kvtier config.
    """
    if path is None:  # an empty one ("$CONFIG", the variable unset) is refused below
        return None
    from kvtier.tools.ops.doctor import read_store

    try:
        value = read_store(path).get("tokens_per_chunk")
    except ConfigError as exc:
        raise ConfigError("--store-config", path, exc.allowed) from exc
    return None if value is None else value


def _model_ref(path: str, name: str) -> str:
    """What `vllm serve` should be given for the model whose config is at `path`."""
    p = Path(path)
    if p.is_dir():
        return path
    if p.name == "config.json":
        return str(p.parent)
    return name if name and name != p.parent.name else "<model>"


def plan_to_dict(plan: Plan) -> dict[str, Any]:
    """The JSON form of a plan (sizes in bytes, times in seconds)."""
    req, spec = plan.request, plan.request.model
    return {
        "model": {"name": spec.name, "attention": spec.attention_kind,
                  "layers": {k: spec.count(k) for k in ("full", "sliding", "linear")},
                  "sliding_window": spec.sliding_window, "params": spec.param_count,
                  "active_params": spec.active_param_count},
        "hardware": {"gpu": req.gpu.name, "gpu_source": req.gpu.source, "tp": req.tp,
                     "hbm_bytes": req.gpu.hbm_bytes},
        "vllm_version": format_version(req.vllm_version) if req.vllm_version else None,
        "context_tokens": plan.context_tokens,
        "weights_bytes": plan.weights_bytes, "weights_per_gpu_bytes": plan.weights_per_gpu_bytes,
        "kv_bytes_per_token_per_rank": plan.kv_bytes_per_token_rank,
        "kv_bytes_per_token_total": plan.kv_bytes_per_token_total,
        "session_bytes_total": plan.session_bytes_total,
        "gpu_kv_bytes_per_gpu": plan.gpu_kv_bytes_per_gpu, "gpu_kv_tokens": plan.gpu_kv_tokens,
        "live_sessions": plan.live_sessions, "reprefill_s": plan.reprefill_s,
        "hybrid_kv_cache_manager": plan.hybrid_manager, "hybrid_manager_reason": plan.hma_reason,
        "attention_kernel": _kernel_dict(attention_kernel(plan)),
        "vllm_defaults": [{"setting": d.setting, "default": d.default, "control": d.control}
                          for d in defaults_for(req.vllm_version)],
        "tiers": [_tier_dict(t) for t in plan.tiers],
        "recommended": {"kv_offloading_size_gib": plan.cpu_offload_gib,
                        "cpu_tier_bytes": plan.cpu_tier_bytes,
                        "cpu_tier_wanted_bytes": plan.cpu_tier_wanted_bytes,
                        "host_ram_bytes": plan.host_ram_bytes,
                        "host_ram_exceeded": plan.host_ram_exceeded, "nvme_gib": plan.nvme_gib},
        "serve_flags": list(plan.serve_flags),
        "alternatives": [_alternative_dict(a) for a in plan.alternatives],
        "assumptions": list(plan.assumptions),
        "notes": list(plan.notes),
    } | ({} if plan.chunks is None else {"state_chunks": _chunks_dict(plan)}) | (
        {} if plan.node is None else {"node": _node_dict(plan.node)})


def _node_dict(node: NodePlan) -> dict[str, Any]:
    """The node's sizing (bytes; `gain`: pooled / private unique tokens, an upper bound)."""
    return {"engines": node.engines, "layouts": node.layouts, "max_layouts": MAX_LAYOUTS,
            "gpus": node.gpus, "host_ram_bytes": node.host_ram_bytes,
            "private_tier_bytes": node.private_tier_bytes,
            "slab_capacity_bytes": node.slab_capacity_bytes,
            "ram_tier_bytes": node.ram_tier_bytes,
            "ram_tier_pooled_bytes": node.ram_tier_pooled_bytes,
            "tokens_per_chunk": node.tokens_per_chunk,
            "chunk_bytes_per_rank": node.chunk_bytes, "slot_bytes": node.slot_bytes,
            "slab_file_bytes": node.slab_file_bytes, "shm_bytes": node.shm_bytes,
            "shm_restart_bytes": node.shm_restart_bytes,
            "node_shm_bytes": node.shm_bytes_wanted, "node_shm_given": node.shm_bytes_given,
            "local_shm_bytes": node.local_shm_bytes, "pod_memory_bytes": node.pod_memory_bytes,
            "pooled_tokens": node.pooled_tokens, "private_tokens": node.private_tokens,
            "pooled_sessions": node.pooled_sessions,
            "private_sessions": node.private_sessions,
            "gain_upper_bound": None if math.isinf(node.gain) else node.gain,
            "socket": node.socket_path, "node_config": node.node_config,
            "node_command": node.node_command,
            "engine_kv_transfer_config": node.engine_transfer_config,
            "engine_command": node.engine_command or None, "refused": node.refused,
            "notes": list(node.notes)}


def _chunks_dict(plan: Plan) -> dict[str, Any]:
    """kvtier's chunks of a model with state layers (bytes per rank unless `_total`)."""
    c, ctx = plan.chunks, plan.context_tokens
    assert c is not None  # the caller checked
    kvtier = plan.alternative("kvtier")
    return {"vllm_block_size": c.block_size, "tokens_per_chunk": c.tokens_per_chunk,
            "tokens_per_chunk_set": c.operator_set, "chosen": c.how,
            "kv_bytes_per_token_per_rank": c.kv_bytes_per_token,
            "state_bytes_per_seq_per_rank": c.state_bytes_per_seq,
            "chunk_kv_bytes_per_rank": c.chunk_kv_bytes,
            "chunk_state_bytes_per_rank": c.state_bytes_per_seq,
            "chunks_per_session": c.chunks(ctx),
            "tier_session_bytes_total": c.session_bytes(ctx) * c.tp,
            "gpu_session_bytes_total": kvtier.session_bytes_total,
            "tier_sessions": {t.name: t.warm_sessions for t in kvtier.tiers[1:]},
            "kvtier_refused": kvtier.refused}


def attention_kernel(plan: Plan) -> BackendChoice | None:
    """The attention backend vLLM 0.33 picks for the plan's model, GPU, KV dtype and block size
    (the plan's `--block-size`, else vLLM's default), and its kernel block; None off CUDA or
    on a GPU whose choice is not modelled."""
    req, flags = plan.request, plan.serve_flags
    if req.gpu.pcie_gen == 0:
        return None
    block = int(flags[flags.index("--block-size") + 1]) if "--block-size" in flags else None
    return choose_backend(req.gpu.sm_major, req.model.mla is not None, req.kv_dtype, block)


def _kernel_dict(choice: BackendChoice | None) -> dict[str, Any] | None:
    if choice is None:
        return None
    return {"backend": choice.backend.name if choice.backend else None,
            "takes": choice.backend.describe() if choice.backend else None,
            "block_size": choice.block_size, "kernel_block_size": choice.kernel_block}


def _tier_dict(t: TierEstimate) -> dict[str, Any]:
    return {"name": t.name, "capacity_bytes": t.capacity_bytes,
            "warm_sessions": t.warm_sessions, "load_s": t.load_s,
            "speedup_vs_reprefill": None if math.isinf(t.speedup) else t.speedup,
            "link": t.link.name if t.link else None,
            "link_gbps": t.link.bandwidth_gbps if t.link else None,
            "link_source": t.link.source if t.link else None}


def _alternative_dict(a: Alternative) -> dict[str, Any]:
    return {"name": a.name, "title": a.title, "refused": a.refused,
            "hybrid_kv_cache_manager": a.hybrid_manager, "hybrid_manager_reason": a.hma_reason,
            "session_bytes_total": a.session_bytes_total, "live_sessions": a.live_sessions,
            "gpu_kv_tokens": a.gpu_kv_tokens, "tiers": [_tier_dict(t) for t in a.tiers],
            "flags": list(a.flags), "env": a.env, "command": a.command or None,
            "notes": list(a.notes)} | (
                {} if a.stored_session_bytes_total is None
                else {"stored_session_bytes_total": a.stored_session_bytes_total})


def _print(plan: Plan) -> None:
    console = Console(width=max(Console().width, 120))
    req, spec = plan.request, plan.request.model
    head = Table(title=f"{spec.name} on {req.tp} x {req.gpu.name}", show_header=False)
    rows = [
        ("attention", f"{spec.attention_kind}; layers full/sliding/linear = "
         f"{spec.count('full')}/{spec.count('sliding')}/{spec.count('linear')}"),
        ("weights", f"{format_size(plan.weights_bytes)} "
         f"({format_size(plan.weights_per_gpu_bytes)} per GPU)"),
        ("KV per token", f"{plan.kv_bytes_per_token_rank:,} B per rank, "
         f"{plan.kv_bytes_per_token_total:,} B total"),
        ("one session", f"{plan.context_tokens:,} tokens = "
         f"{format_size(plan.session_bytes_total)}"),
        ("GPU KV", f"{format_size(plan.gpu_kv_bytes_per_gpu)} per GPU = "
         f"{plan.gpu_kv_tokens:,} tokens"),
        ("live sessions", str(plan.live_sessions)),
        ("re-prefill one session", f"{plan.reprefill_s:.2f} s"),
        ("hybrid KV manager", f"{'on' if plan.hybrid_manager else 'off'}: {plan.hma_reason}"),
    ]
    rows += _chunk_rows(plan)
    kernel = attention_kernel(plan)
    if kernel is not None:
        rows.append(("attention kernel (vLLM 0.33)", describe_choice(kernel)))
    defaults = defaults_for(req.vllm_version)
    if defaults:
        rows.append((f"vLLM {format_version(req.vllm_version)} defaults",  # type: ignore[arg-type]
                     "; ".join(f"{d.setting} {d.default} ({d.control})" for d in defaults)))
    for key, value in rows:
        head.add_row(key, value)
    console.print(head)
    tiers = Table(title="tiers (one session back to the GPUs)")
    for col in ("tier", "capacity", "warm sessions", "load", "vs re-prefill", "link used"):
        tiers.add_column(col)
    for t in plan.tiers:
        link = f"{t.link.name} {t.link.bandwidth_gbps:g} GB/s ({t.link.source})" if t.link \
            else "-"
        tiers.add_row(t.name, format_size(t.capacity_bytes), f"{t.warm_sessions:,}",
                      f"{t.load_s:.3f} s", "-" if math.isinf(t.speedup) else f"{t.speedup:.1f}x",
                      link)
    console.print(tiers)
    _print_alternatives(console, plan)
    if plan.node is not None:
        _print_node(console, plan.node, plan.context_tokens)


def _chunk_rows(plan: Plan) -> list[tuple[str, str]]:
    """The head table's rows for a model with state layers (none for other models)."""
    c, ctx = plan.chunks, plan.context_tokens
    if c is None:
        return []
    per = " per rank" if c.tp > 1 else ""
    return [
        ("state per sequence", f"{format_size(c.state_bytes_per_seq)}{per} (all state layers, "
         "one copy: what vLLM's GPU pool holds, whatever the context)"),
        ("kvtier chunk", f"{c.tokens_per_chunk:,} tokens = {c.how}"),
        ("bytes per chunk", f"{format_size(c.chunk_bytes)}{per} = "
         f"{format_size(c.chunk_kv_bytes)} KV + {format_size(c.state_bytes_per_seq)} state"),
        ("one session on a kvtier tier", f"{c.chunks(ctx):,} chunks = "
         f"{format_size(c.session_bytes(ctx) * c.tp)} (each chunk carries the states)"),
    ]


def _print_alternatives(console: Console, plan: Plan) -> None:
    table = Table(title="alternatives: capacity with each")
    for col in ("alternative", "hybrid KV manager", "one session", "live sessions",
                "warm sessions (CPU / NVMe)"):
        table.add_column(col)
    for a in plan.alternatives:
        warm = " / ".join(f"{t.warm_sessions:,}" for t in a.tiers[1:]) or "-"
        one = format_size(a.session_bytes_total)
        if a.stored_session_bytes_total is not None:
            one += f" ({format_size(a.stored_session_bytes_total)} in its tiers)"
        table.add_row(a.title, "on" if a.hybrid_manager else "off", one, f"{a.live_sessions:,}",
                      "refused" if a.refused else warm)
    console.print(table)
    console.print("[bold]alternatives[/bold], pick ONE (each line is a complete command):")
    usable = [a for a in plan.alternatives if a.refused is None]
    for number, a in enumerate(usable, 1):
        console.print(f"  [bold]{number}. {a.title}[/bold]: {a.live_sessions:,} live sessions")
        print(f"     {a.command}")  # plain print: no markup, no wrapping, copy-pasteable
    for a in plan.alternatives:
        if a.refused:
            console.print(f"  [red]not an option[/red]: {a.title}: {a.refused}")
    for line in plan.assumptions:
        console.print(f"[cyan]assumed[/cyan]: {line}")
    for note in plan.notes:
        console.print(f"[yellow]note[/yellow]: {note}")


def _print_node(console: Console, node: NodePlan, ctx: int) -> None:
    table = Table(title=f"kvtier node: {node.engines} engine(s) x TP {node.layouts} on one "
                  "node", show_header=False)
    share = node.ram_tier_bytes / node.host_ram_bytes
    shm = (f"{format_size(node.shm_bytes)} ({node.layouts} slab(s) of "
           f"{format_size(node.slab_file_bytes)}: {node.slab_capacity_bytes // node.slot_bytes:,}"
           f" slots of {format_size(node.slot_bytes)} and their records); the node's /dev/shm "
           f"{format_size(node.shm_bytes_wanted)} "
           f"({'given' if node.shm_bytes_given else 'half its RAM, assumed'}); a warm restart "
           f"needs {format_size(node.shm_restart_bytes)}")
    if node.local_shm_bytes is not None:
        shm += f"; this machine's {SHM_DIR}: {format_size(node.local_shm_bytes)}"
    gain = "-" if math.isinf(node.gain) else f"{node.gain:.1f}x"
    ram = f"{format_size(node.ram_tier_bytes)} ="
    if node.ram_tier_bytes < node.ram_tier_pooled_bytes:
        ram = (f"{gib_number(node.ram_tier_bytes / _GIB)} GiB, held to what the node's "
               f"/dev/shm holds: not the {gib_number(node.ram_tier_pooled_bytes / _GIB)} GiB of")
    rows = [
        ("engines", f"{node.engines} x TP {node.layouts} = {node.gpus} GPUs; {node.layouts} KV "
         f"layout(s), one per TP rank (a node holds at most {MAX_LAYOUTS})"),
        ("RAM tier", f"{ram} {node.engines} x "
         f"{format_size(node.private_tier_bytes)} (each engine's private CPU tier), pooled: "
         f"{format_size(node.slab_capacity_bytes)} per layout (node.yaml's memory capacity)"),
        ("/dev/shm", shm),
        ("host RAM", f"the slabs take {format_size(node.shm_bytes)} of the node's "
         f"{format_size(node.host_ram_bytes)} ({share:.0%})"),
        ("unique prefixes", f"pooled: {node.pooled_tokens:,} tokens ({node.pooled_sessions:,} "
         f"sessions of {ctx:,}), any engine hits any; private: {node.private_tokens:,} tokens "
         f"({node.private_sessions:,} sessions) per engine. Up to {gain} the unique tokens, "
         "when every engine sees the same prefixes (each private tier holds its own copy); "
         "about 1x when none is shared. Simulated on Mooncake's trace: 1.5x (2 engines) to "
         "2.6x (8): kvtier simulate --trace T --engines N"),
        ("Kubernetes", "deploy/kubernetes-node: node.yaml in kvtier-node-config.yaml; "
         f"kvtier-node.yaml's memory request and limit {math.ceil(node.pod_memory_bytes / _GIB)}Gi"
         " (the slabs are charged to the node's pod, + 16Gi for its own work); the slabs live "
         "in the host's /dev/shm (a hostPath, no sizeLimit), which must hold them"),
    ]
    for key, value in rows:
        table.add_row(key, value)
    console.print(table)
    console.print("[bold]the node[/bold] (node.yaml, then its command; each engine's command):")
    print(f"     {json.dumps(node.node_config)}")  # plain print: copy-pasteable
    print(f"     {node.node_command}")
    if node.engine_command:
        print(f"     {node.engine_command}")
    for note in node.notes:
        console.print(f"[yellow]note[/yellow]: {note}")
