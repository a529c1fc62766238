"""`kvtier plan --node-engines N`: one `kvtier node` for N engines of the planned model.

The node pools the RAM that N engines would each hold as a private CPU tier: the same bytes,
in a slab per KV layout in /dev/shm (one layout per TP rank of the model: each rank's
workers of every engine share it), so a prefix several engines see is held once, not once
per engine; at most what the node's /dev/shm holds, a tenth of it left free (a slab that
does not fit is never created: the node refuses its engines). This module says what the
node needs (the slabs' bytes, the room in /dev/shm and in the host's RAM, the layouts against
`NodeConfig.max_layouts`), what it gains (unique tokens and sessions, pooled against private:
an upper bound, reached when every engine sees every prefix), and how to run it (its config,
`kvtier node serve`, the engines' node-mode `--kv-transfer-config`).

Primitives:
    NodePlan                       -- the node's sizing, commands and warnings (frozen)
    plan_node(...)                 -- compute it (sizing.make_plan calls it)
"""

from __future__ import annotations

import json
import math
import shlex
from dataclasses import dataclass, fields, replace
from typing import Any

from kvtier.core.chunkformat import ALIGN_BYTES
from kvtier.integrations.vllm.config import TOKENS_PER_CHUNK, kvtier_transfer_config
from kvtier.node.config import NodeConfig
from kvtier.tiers.shmslab import SHM_DIR, slab_file_bytes
from kvtier.tiers.storeconfig import StoreConfig
from kvtier.tools.ops.alternatives import Alternative, command_line
from kvtier.tools.ops.chunkplan import CPU_BLOCK, CUDA_BLOCK, ChunkPlan
from kvtier.tools.ops.flags import gib_number
from kvtier.tools.ops.plan_request import PlanRequest
from kvtier.units import format_size

_GIB = 1024**3
# The layouts a node holds at once by default (NodeConfig's; `kvtier node serve --max-layouts`):
# one more engine layout is refused, and its engines miss.
def _max_layouts() -> int:
    default = next(f.default for f in fields(NodeConfig) if f.name == "max_layouts")
    assert isinstance(default, int)  # NodeConfig declares it an int
    return default


MAX_LAYOUTS = _max_layouts()
# The node's own memory beside its slabs (spares, write-behind queue, index): the margin
# deploy/kubernetes-node/kvtier-node.yaml's memory request adds to the RAM tier.
NODE_OVERHEAD_BYTES = 16 * _GIB
# The share of the node's /dev/shm its default RAM tier leaves free: vLLM's shared-memory
# queues (a few per engine) and torch's shared tensors live there too.
SHM_HEADROOM = 0.1
# The metrics port of the printed `kvtier node serve` (deploy/kubernetes-node's).
METRICS_PORT = 9400
# The node's config file in the printed commands.
CONFIG_FILE = "node.yaml"


@dataclass(frozen=True, slots=True)
class NodePlan:
    """One node's RAM tier for `engines` engines of one model (bytes unless said)."""

    engines: int  # engines of this model on the node
    layouts: int  # KV layouts they bring: one per TP rank
    gpus: int  # engines x TP
    host_ram_bytes: int  # the node's RAM (given, or assumed per GPU)
    private_tier_bytes: int  # one engine's private CPU tier, all its ranks (the plan's)
    slab_capacity_bytes: int  # the node's memory tier capacity: per layout, in node.yaml
    ram_tier_bytes: int  # all layouts: N private tiers' bytes, pooled, as /dev/shm holds
    ram_tier_pooled_bytes: int  # all layouts: N private tiers' bytes, pooled
    tokens_per_chunk: int  # the chunk the engines store
    chunk_bytes: int  # one chunk on one rank
    slot_bytes: int  # its slot in the slab (aligned)
    slab_file_bytes: int  # one layout's file in /dev/shm: slots, records, stamps, footer
    shm_bytes: int  # every layout's file
    shm_bytes_wanted: int  # the node's /dev/shm: given (--node-shm), else half its RAM
    shm_bytes_given: bool  # shm_bytes_wanted was given, not assumed
    local_shm_bytes: int | None  # this machine's /dev/shm, measured; None: not measured
    pod_memory_bytes: int  # the node's Kubernetes memory request and limit
    pooled_tokens: int  # unique tokens the node's RAM holds; any engine hits any of them
    private_tokens: int  # unique tokens one private tier holds (all of them, if shared)
    pooled_sessions: int  # sessions of the plan's context the node's RAM holds
    private_sessions: int  # the same in one private tier
    socket_path: str  # the node's socket
    node_config: dict[str, Any]  # node.yaml (validated as `kvtier node serve` reads it)
    node_command: str  # `kvtier node serve ...`
    engine_transfer_config: dict[str, Any] | None  # each engine's; None when refused
    engine_command: str  # `vllm serve ...` in node mode; "" when refused
    refused: str | None  # why kvtier (and so its node) cannot serve this model
    notes: tuple[str, ...]  # warnings, most important first

    @property
    def gain(self) -> float:
        """Unique tokens pooled / private: the most the node's RAM holds more (every
        prefix seen by every engine); about 1 when no prefix is shared."""
        return self.pooled_tokens / self.private_tokens if self.private_tokens else math.inf

    @property
    def shm_restart_bytes(self) -> int:
        """/dev/shm a warm restart takes: a restarted node creates each layout's new slab
        while its predecessor's is still there to recover from (tiers/shmslab.py)."""
        return 2 * self.shm_bytes


def plan_node(req: PlanRequest, ctx: int, host_ram: int, cpu_gib: float, nvme_gib: float,
              kvtier: Alternative, shared: tuple[str, ...], chunks: ChunkPlan | None
              ) -> NodePlan:
    """The node for `req.node_engines` engines of `req`'s model, each of which would hold a
    private CPU tier of `cpu_gib` (total of its ranks); `kvtier` is the plan's kvtier
    alternative (its flags and refusal), `shared` the flags every command shares. The node's
    RAM tier pools those tiers, held to what the node's /dev/shm holds (SHM_HEADROOM of it
    left free) unless the operator gave the tiers' size (`req.cpu_tier_bytes`).

    Raises:
        ConfigError: a node config or transfer config kvtier would refuse.
    """
    engines, tp = req.node_engines, req.tp
    tpc, chunk = _chunk(req, chunks, kvtier, shared)
    slot = -(-chunk // ALIGN_BYTES) * ALIGN_BYTES
    shm_wanted = req.node_shm_bytes or host_ram // 2
    pooled_gib = cpu_gib * engines / tp
    # A private tier's size the operator gave (--from-sglang) is kept, and the notes say
    # when it does not fit; the default, a share of RAM, is held to what /dev/shm holds.
    slab_gib = gib_number(pooled_gib if req.cpu_tier_bytes is not None
                          else min(pooled_gib, _slab_room(shm_wanted, tp, slot) / _GIB))
    slab = int(float(slab_gib) * _GIB)
    pooled = int(float(gib_number(pooled_gib)) * _GIB)
    slots = slab // slot
    private_slots = int(cpu_gib * _GIB) // tp // slot
    per_session = -(-ctx // tpc)
    file_bytes = slab_file_bytes(slot, slots)
    tiers: list[dict[str, Any]] = [{"kind": "memory", "capacity": f"{slab_gib}GiB"}]
    if nvme_gib:
        tiers.append({"kind": "disk", "path": req.nvme_path,
                      "capacity": f"{gib_number(nvme_gib / tp)}GiB"})
    node_config = {"tiers": tiers}
    StoreConfig.parse(node_config, where=CONFIG_FILE)
    command = (f"kvtier node serve --config {CONFIG_FILE} --socket "
               f"{shlex.quote(req.node_socket)} --metrics-port {METRICS_PORT}")
    if tp > MAX_LAYOUTS:
        command += f" --max-layouts {tp}"
    transfer, engine_command = _engine(req, kvtier, shared)
    plan = NodePlan(
        engines=engines, layouts=tp, gpus=engines * tp, host_ram_bytes=host_ram,
        private_tier_bytes=int(cpu_gib * _GIB), slab_capacity_bytes=slab,
        ram_tier_bytes=slab * tp, ram_tier_pooled_bytes=pooled * tp,
        tokens_per_chunk=tpc, chunk_bytes=chunk, slot_bytes=slot,
        slab_file_bytes=file_bytes, shm_bytes=file_bytes * tp, shm_bytes_wanted=shm_wanted,
        shm_bytes_given=bool(req.node_shm_bytes), local_shm_bytes=req.local_shm_bytes,
        pod_memory_bytes=file_bytes * tp + NODE_OVERHEAD_BYTES,
        pooled_tokens=slots * tpc, private_tokens=private_slots * tpc,
        pooled_sessions=slots // per_session, private_sessions=private_slots // per_session,
        socket_path=req.node_socket, node_config=node_config, node_command=command,
        engine_transfer_config=transfer, engine_command=engine_command,
        refused=kvtier.refused, notes=())
    return replace(plan, notes=tuple(node_notes(plan)))


def _slab_room(shm_bytes: int, layouts: int, slot_bytes: int) -> int:
    """The largest capacity of each of `layouts` slabs whose files fit in `shm_bytes` of
    /dev/shm with SHM_HEADROOM of it left free (whole slots)."""
    room = int(shm_bytes * (1 - SHM_HEADROOM)) // layouts - slab_file_bytes(slot_bytes, 0)
    per_slot = slab_file_bytes(slot_bytes, 1) - slab_file_bytes(slot_bytes, 0)
    return max(0, room) // per_slot * slot_bytes


def _chunk(req: PlanRequest, chunks: ChunkPlan | None, kvtier: Alternative,
           shared: tuple[str, ...]) -> tuple[int, int]:
    """(tokens per chunk, bytes of a chunk on one rank) as the connector will store them:
    the operator's tokens_per_chunk, else TOKENS_PER_CHUNK raised to a multiple of vLLM's
    block (ConnectorConfig.for_block_size); a model with state layers: its ChunkPlan."""
    if chunks is not None:
        return chunks.tokens_per_chunk, chunks.chunk_bytes
    if req.tokens_per_chunk is not None:
        tpc = req.tokens_per_chunk
    else:
        block = (int(shared[shared.index("--block-size") + 1]) if "--block-size" in shared
                 else CPU_BLOCK if req.gpu.pcie_gen == 0 else CUDA_BLOCK)
        tpc = -(-TOKENS_PER_CHUNK // block) * block
    return tpc, kvtier.bytes_per_token_rank * tpc


def _engine(req: PlanRequest, kvtier: Alternative, shared: tuple[str, ...]
            ) -> tuple[dict[str, Any] | None, str]:
    """Each engine's node-mode transfer config and `vllm serve` line: the kvtier
    alternative's, its tiers replaced by the node's socket."""
    if kvtier.refused is not None:
        return None, ""
    extra: dict[str, Any] = {"node": req.node_socket}
    if req.tokens_per_chunk is not None:
        extra["tokens_per_chunk"] = req.tokens_per_chunk
    transfer = kvtier_transfer_config(extra)
    flags = list(kvtier.flags)
    flags[flags.index("--kv-transfer-config") + 1] = json.dumps(transfer,
                                                                separators=(",", ":"))
    return transfer, command_line(req.model_ref, list(shared), flags, {})


def node_notes(node: NodePlan) -> list[str]:
    """What stops the node, or costs it, most important first."""
    notes = []
    if node.refused is not None:
        notes.append(f"no node for this model: {node.refused}")
    if node.layouts > MAX_LAYOUTS:
        notes.append(f"TP {node.layouts} brings {node.layouts} KV layouts (one per rank), past "
                     f"a node's default {MAX_LAYOUTS}: its command sets --max-layouts "
                     f"{node.layouts}, and another model (or TP size) on this node is refused "
                     "and misses")
    elif node.layouts == MAX_LAYOUTS:
        notes.append(f"these engines take all {MAX_LAYOUTS} of the node's layouts: "
                     "another model (or TP size) on this node is refused and misses")
    where = "given" if node.shm_bytes_given else "half its RAM: a tmpfs's default"
    if node.ram_tier_bytes < node.ram_tier_pooled_bytes:
        notes.append(f"the node's RAM tier is held to {gib_number(node.ram_tier_bytes / _GIB)}"
                     f" GiB, not the {gib_number(node.ram_tier_pooled_bytes / _GIB)} GiB of the "
                     "engines' private tiers: its slabs live in /dev/shm, "
                     f"{format_size(node.shm_bytes_wanted)} ({where}), {SHM_HEADROOM:.0%} of it "
                     "left free; grow /dev/shm (--node-shm) for more")
    if node.shm_bytes > node.shm_bytes_wanted:
        notes.append(f"the slabs ({format_size(node.shm_bytes)}) do not fit the node's "
                     f"/dev/shm ({format_size(node.shm_bytes_wanted)}, {where}): grow it "
                     "(mount -o remount,size=...; in Kubernetes the node and its engines "
                     "mount the host's /dev/shm, whose size is the limit) or lower --host-ram "
                     "or --host-kv-fraction")
    elif node.shm_restart_bytes > node.shm_bytes_wanted:
        restart = format_size(node.shm_restart_bytes)
        notes.append(f"a restarted node creates its new slabs before it recovers and removes "
                     f"its predecessor's: a warm restart needs {restart} of /dev/shm, more "
                     f"than the node's {format_size(node.shm_bytes_wanted)} "
                     f"({where}); give /dev/shm room for both, or restart with --drop-ram "
                     "first (cold)")
    if node.local_shm_bytes is not None and node.shm_bytes > node.local_shm_bytes:
        notes.append(f"this machine's {SHM_DIR} is {format_size(node.local_shm_bytes)}: too "
                     f"small for the slabs ({format_size(node.shm_bytes)}) if the node runs "
                     "here")
    if node.pooled_sessions == 0 and node.refused is None:
        notes.append("the node's RAM holds no whole session at this context: a longer "
                     "--context than RAM, or too little --host-ram")
    return notes
