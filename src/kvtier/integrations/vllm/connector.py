"""`KVTierConnector`: kvtier as a vLLM v1 KV connector (a thin shell).

vLLM builds one instance per role: SCHEDULER (in the engine-core process) delegates to
`scheduler.ConnectorScheduler`; WORKER (in each worker process) delegates to
`worker.ConnectorWorker`, which owns the worker's `TieredStore`. Synchronous loads run in
`start_load_kv` before the forward pass (the scheduler marks the step as having sync loads),
asynchronous ones on the worker's load thread until `get_finished` reports them. Stores are
handed to the worker's store thread in `wait_for_save` (or run there, store_mode "sync"); a
request whose store may still read its blocks is held (`request_finished` returns True) until
`get_finished` reports it, and `handle_preemptions` lets stores finish before a preempted
request's blocks can be written. Slower tiers are written behind, off the engine's thread. It
supports vLLM's hybrid KV cache manager (`SupportsHMA`): a chunk holds every attention group's
layers (groups.py).

Enable with
    kv_transfer_config={"kv_connector": "KVTierConnector",
                        "kv_connector_module_path": "kvtier.integrations.vllm",
                        "kv_role": "kv_both", "kv_connector_extra_config": {...}}
kv_role "kv_producer" (a disaggregated prefill instance) only stores, and waits for its
writes to reach the shared tier; "kv_consumer" (a decode instance) only loads.

Primitives: `KVTierConnector`.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvtier.core.fingerprint import ModelFingerprint, cached_model_fingerprint
from kvtier.core.layout import KVLayout
from kvtier.core.locator import ChunkLocator
from kvtier.core.tier import Probe
from kvtier.integrations.vllm.config import ConnectorConfig
from kvtier.integrations.vllm.groups import NULL_BLOCK, ChunkGroups, chunk_groups
from kvtier.integrations.vllm.kvformat import AttentionFormat, attention_format, chunk_layouts
from kvtier.integrations.vllm.kvsettings import kv_settings, loaded_weights
from kvtier.integrations.vllm.logs import adopt_vllm_logging
from kvtier.integrations.vllm.messages import KVTierMetadata, WorkerIdentity
from kvtier.integrations.vllm.metrics import KVTierConnectorStats, KVTierPromMetrics
from kvtier.integrations.vllm.models import (
    HMA_ALTERNATIVE,
    check_supported,
    model_traits,
    refuse,
)
from kvtier.integrations.vllm.scheduler.connector_scheduler import ConnectorScheduler
from kvtier.integrations.vllm.versions import log_engine_version
from kvtier.integrations.vllm.worker.chunkstore import ChunkStore
from kvtier.integrations.vllm.worker.connector_worker import (
    ConnectorWorker,
    PagedKV,
    load_batch_for,
)
from kvtier.node.client import NodeClient
from kvtier.node.nodestore import NodeStore
from kvtier.node.probe import NodeProbe
from kvtier.node.protocol import BELOW_TIER as NODE_BELOW_TIER
from kvtier.node.protocol import RAM_TIER as NODE_TIER
from kvtier.tiers import build_probe, open_store
from kvtier.tiers.manifest import NamespaceInfo

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    from vllm.config import KVTransferConfig, VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request


def engine_layouts(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig,
                   groups: ChunkGroups, tokens_per_chunk: int, fingerprint: str
                   ) -> tuple[AttentionFormat, list[KVLayout]]:
    """The attention layers' format and the chunk layout of every tensor-parallel rank, from
    vLLM's spec: the scheduler (keys, probes) and every worker (its rank's layout, and the
    format its tensors must hold) call this one function, so their digests agree.
    `groups`: `chunk_groups` of `kv_cache_config` (which refuses groups kvtier cannot store);
    `fingerprint`: the model's, which names the storage namespace too (`kvtier inspect`,
    `kvtier gc --fingerprint`): the workers' (`KVTierConnector.set_xfer_handshake_metadata`).

    Raises:
        ConfigError: for a format kvtier cannot store (kvformat.attention_format).
    """
    model = str(vllm_config.model_config.model)
    cache_dtype = str(vllm_config.cache_config.cache_dtype)
    formats = {attention_format(kv_cache_config.kv_cache_groups[g].kv_cache_spec, model,
                                cache_dtype) for g in groups.attention_group_ids or (0,)}
    if len(formats) > 1:
        raise refuse(model, f"attention groups of different formats {sorted(map(str, formats))}",
                     HMA_ALTERNATIVE)
    fmt = formats.pop()
    return fmt, chunk_layouts(fmt, num_layers=groups.num_layers,
                              tokens_per_chunk=tokens_per_chunk,
                              tp_world_size=vllm_config.parallel_config.tensor_parallel_size,
                              model_fingerprint=fingerprint, state_bytes=groups.state_bytes)


def backend_content(vllm_config: VllmConfig, layer_name: str, device: torch.device) -> str:
    """How the attention backend of `layer_name` holds K and V in a token's content
    (paged.CONTENTS): "rows" for vLLM's CPU backend, "halves" for the others (vLLM 0.33:
    FlashAttention, FlashInfer, Triton, ...), "latent" is the format's (MLA)."""
    layer = vllm_config.compilation_config.static_forward_context.get(layer_name)
    backend = getattr(layer, "attn_backend", None)
    name = backend.get_name() if backend is not None else ""
    if name:
        return "rows" if name == "CPU_ATTN" else "halves"
    return "rows" if device.type == "cpu" else "halves"


def namespace_info(vllm_config: VllmConfig, fingerprint: ModelFingerprint) -> NamespaceInfo:
    """The namespace's manifest: which model its chunks are."""
    served = vllm_config.model_config.served_model_name
    return NamespaceInfo(
        model=str((served[0] if isinstance(served, list) and served else served)
                  or vllm_config.model_config.model),
        fingerprint=fingerprint.digest, weight_files=fingerprint.weight_files)


def scheduler_model_identity(vllm_config: VllmConfig) -> tuple[str, ModelFingerprint]:
    """(model id, fingerprint) of the served model for the keys' namespace. Only the
    scheduler computes keys: workers store and load them as given; both sides put the
    fingerprint in the storage namespace (the layouts). Computed once per process (and again
    after an update in place: core/fingerprint.py), logged when computed.

    A checkpoint on disk (a directory, or a hub model in the local HF cache) is fingerprinted
    by content, and its path is left out of the namespace, so that copies at other paths (other
    nodes) share; otherwise the model's name stays in it, with what is known (config, revision).
    """
    model = vllm_config.model_config
    model_dir = model.model if os.path.exists(model.model) else _hub_snapshot(vllm_config)

    def log_it(fingerprint: ModelFingerprint) -> None:
        if fingerprint.weight_files:
            logger.info("kvtier: model fingerprint %s (config, dtype, revision and %d weight "
                        "files)", fingerprint.digest[:12], fingerprint.weight_files)
        else:
            logger.warning("kvtier: model fingerprint %s covers config, dtype and revision "
                           "only: no checkpoint files found for %s, weights are not "
                           "fingerprinted (an update under the same name and revision would "
                           "reuse old KV)", fingerprint.digest[:12], model.model)

    fingerprint = cached_model_fingerprint(
        model_dir, model.hf_config.to_dict(), revision=model.revision,
        code_revision=model.code_revision, quantization=model.quantization,
        dtype=str(model.dtype).removeprefix("torch."), settings=kv_settings(vllm_config),
        weight_globs=loaded_weights(vllm_config), on_computed=log_it)
    return model_id_for(vllm_config, fingerprint), fingerprint


def model_id_for(vllm_config: VllmConfig, fingerprint: ModelFingerprint) -> str:
    """The model's name in the keys' namespace: none for a checkpoint fingerprinted by its
    files (copies at other paths share), the name it was served by otherwise."""
    return "" if fingerprint.weight_files else str(vllm_config.model_config.model)


def _hub_snapshot(vllm_config: VllmConfig) -> str | None:
    """The local snapshot directory of a hub model vLLM downloaded, or None."""
    try:
        from huggingface_hub import snapshot_download

        return str(snapshot_download(vllm_config.model_config.model,
                                     revision=vllm_config.model_config.revision,
                                     cache_dir=vllm_config.load_config.download_dir,
                                     local_files_only=True))
    except Exception:  # not a hub model, or not in the local cache: not fingerprinted
        return None


def _state_tensors(entry: torch.Tensor | list[torch.Tensor] | tuple[torch.Tensor, ...]
                   ) -> list[torch.Tensor]:
    """A state layer's tensors as register_kv_caches gives them (one, or one per state)."""
    return [entry] if isinstance(entry, torch.Tensor) else list(entry)


def tp_any(flags: list[bool]) -> list[bool]:
    """OR each flag across the tensor-parallel ranks (a collective on the TP group's CPU
    group: every rank calls it in the same step with as many flags)."""
    import torch.distributed as dist
    from vllm.distributed.parallel_state import get_tp_group

    votes = torch.tensor(flags, dtype=torch.int32)
    dist.all_reduce(votes, op=dist.ReduceOp.MAX, group=get_tp_group().cpu_group)
    return [bool(v) for v in votes.tolist()]


class KVTierConnector(KVConnectorBase_V1, SupportsHMA):
    """vLLM KV connector backed by kvtier's tiered store."""

    _cache_hit_source = CacheHitSource.HOST

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        adopt_vllm_logging()  # in every process vLLM builds a connector in
        if role == KVConnectorRole.SCHEDULER:  # once per engine, not once per worker
            log_engine_version(logger)
        check_supported(model_traits(vllm_config))
        self._config = ConnectorConfig.parse(self._kv_transfer_config.kv_connector_extra_config)
        # A failed load (a corrupt or vanished chunk) must cost recomputation only, but
        # vLLM's default kv_load_failure_policy "fail" ends the request with an error
        # (tests/engine/test_kvtier_restart.py, damaged chunk files), and vLLM (0.32, 0.33)
        # has no hook for a connector to state its policy. Its scheduler reads the policy
        # right after building this scheduler-role connector, so the write takes effect
        # (tests/vllm_api/test_load_failure_policy.py fails if a release stops doing so).
        if getattr(self._kv_transfer_config, "kv_load_failure_policy", None) == "fail":
            logger.info("kvtier: kv_load_failure_policy 'fail' -> 'recompute' (a failed "
                        "kvtier load is recomputed, never an error)")
            self._kv_transfer_config.kv_load_failure_policy = "recompute"
        self._block_size = vllm_config.cache_config.block_size
        parsed, self._config = self._config, self._config.for_block_size(self._block_size)
        if self._config is not parsed and role == KVConnectorRole.SCHEDULER:
            logger.info("kvtier: tokens_per_chunk %d (not set: the smallest multiple of vLLM's "
                        "%d-token blocks from %d)", self._config.tokens_per_chunk,
                        self._block_size, parsed.tokens_per_chunk)
        self._scheduler: ConnectorScheduler | None = None
        self._worker: ConnectorWorker | None = None
        self._identity: ModelFingerprint | None = None  # the namespace's (both roles)
        if role == KVConnectorRole.SCHEDULER:
            model_id, self._identity = scheduler_model_identity(vllm_config)
            self._scheduler = self._build_scheduler(model_id, self._identity)

    def _build_scheduler(self, model_id: str, fingerprint: ModelFingerprint
                         ) -> ConnectorScheduler:
        """The scheduler side, its keys and probes in `fingerprint`'s namespace."""
        vllm_config, kv_cache_config = self._vllm_config, self._kv_cache_config
        groups = chunk_groups(str(vllm_config.model_config.model), kv_cache_config)
        _fmt, layouts = engine_layouts(vllm_config, kv_cache_config, groups,
                                       self._config.tokens_per_chunk, fingerprint.digest)
        node: NodeProbe | None = None
        if self._config.node:  # a chunk counts when the node holds every rank's shard
            info = namespace_info(vllm_config, fingerprint)
            clients = [self._node_client(layout, info) for layout in layouts]
            node = NodeProbe(clients)  # its RAM, asked inline
            probes: dict[str, Probe | None] = {NODE_TIER: node}
            if node.below_ram():  # the rest off the scheduler's thread, as in process
                probes[NODE_BELOW_TIER] = NodeProbe(clients, ram_only=False)
        else:
            probes = {tier.tier_name: build_probe(tier, layouts,
                                                  self._config.store.lookup_timeout_s)
                      for tier in self._config.store.tiers}
        # A key stands for one shard per rank: the index bound counts whole chunks.
        locator = ChunkLocator({name: p for name, p in probes.items() if p is not None},
                               self._config.index_keys(
                                   sum(layout.bytes_per_chunk for layout in layouts)),
                               timeout_s=self._config.store.lookup_timeout_s,
                               # the node's RAM first: other engines evict from it
                               index_first=not self._config.node)
        events = vllm_config.kv_events_config
        return ConnectorScheduler(
            self._config, block_size=self._block_size,
            groups=groups,
            model_id=model_id, layout_digest=layouts[0].digest(),
            weights_fingerprint=fingerprint.digest, locator=locator,
            tier_kinds={NODE_TIER: "memory"} if self._config.node else
            {t.tier_name: t.kind for t in self._config.store.tiers},
            emit_events=bool(events and events.enable_kv_cache_events),
            kv_role=self._kv_transfer_config.kv_role, node=node)

    def _node_client(self, layout: KVLayout, info: NamespaceInfo) -> NodeClient:
        """A client of the node for `layout`'s chunks: its deadline is the store's lookup
        timeout (a node stopped costs a step at most that, then misses for a while)."""
        assert self._config.node is not None
        return NodeClient(self._config.node, layout, info,
                          timeout_s=self._config.store.lookup_timeout_s)

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        """None (vLLM's own choice). vLLM asks this in the engine-core process after loading
        the model and before profiling memory and building the KV cache groups: the first
        point where the connector sees the model, so a model kvtier cannot serve is refused
        here, by kvtier, in one line (models.py), rather than by vLLM's "Failed to promote
        local KV cache specs" later.

        Raises:
            ConfigError: naming the model, the reason and the alternative.
        """
        check_supported(model_traits(vllm_config))
        return None

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: KVTransferConfig) -> bool:
        """False (vLLM 0.33 asks, and refuses `--enable-sleep-mode` then): the workers' load
        and store threads hold views of the KV cache, which sleep mode frees and remaps."""
        return False

    @property
    def requires_kv_delivery(self) -> bool:
        # A cache: a dropped store is a future miss, never a lost hand-off.
        return False

    # -- scheduler side -------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        assert self._scheduler is not None
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self._scheduler is not None
        return self._scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        assert self._scheduler is not None
        self._scheduler.update_connector_output(connector_output)

    def request_finished(self, request: Request,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        return self._scheduler.request_finished(request), None

    def request_finished_all_groups(self, request: Request, block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        """`request_finished` with the hybrid KV cache manager on (`SupportsHMA`)."""
        return self.request_finished(request, block_ids[0] if block_ids else [])

    def has_pending_block_frees(self) -> bool:
        """vLLM (0.32 on) asks this when no block is left for a running request: True while
        blocks kvtier keeps for ended requests' stores are about to come back, and the
        scheduler then waits a step for them rather than preempt a request
        (scheduler.has_pending_block_frees)."""
        return self._scheduler is not None and self._scheduler.has_pending_block_frees()

    def reset_cache(self) -> bool:
        """vLLM's reset_prefix_cache(reset_connector=True), e.g. after a weight update in
        place: no chunk stored before is offered to this engine again (scheduler.reset_cache;
        the workers retire their tiers' chunks with the next plan). Always True: vLLM's own
        reset may still fail while requests hold blocks (it then returns False; retry)."""
        assert self._scheduler is not None
        return self._scheduler.reset_cache()

    def set_xfer_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata]
                                    ) -> None:
        """Each worker's `WorkerIdentity`, once, as the engine starts (after the workers
        registered their KV caches, before any request).

        The workers' fingerprint names the namespace: vLLM's model code edits the model's
        config as a worker builds it (PaliGemma's text_config.architectures, TeleChat2's
        hidden_act, Isaac's M-RoPE sections, Llava's Pixtral case), in that worker's copy
        only. A tensor-parallel engine's scheduler, which builds no model, fingerprinted the
        config unedited: its probes named another namespace than the workers' tiers, so a
        restart never found what was stored before (tests/engine/test_worker_namespace.py).
        It takes the workers' namespace (logged). Workers that disagree among themselves are
        logged as an error and left as they are (their chunks are then found only by the
        scheduler's index of what they report stored, until a restart)."""
        assert self._scheduler is not None and self._identity is not None
        built = {(m.fingerprint, m.weight_files) for m in metadata.values()
                 if isinstance(m, WorkerIdentity)}
        if not built or built == {(self._identity.digest, self._identity.weight_files)}:
            return
        if len(built) > 1:
            logger.error("kvtier: the workers fingerprint the model differently (%s; the "
                         "scheduler %s): their chunks are in other namespaces, which a restart "
                         "does not look up", ", ".join(sorted(d[:12] for d, _ in built)),
                         self._identity.digest[:12])
            return
        digest, weight_files = built.pop()
        logger.warning("kvtier: the workers built the model from a config the scheduler did "
                       "not see (vLLM's model code edits it as it builds): namespace %s, "
                       "the workers' fingerprint, not %s", digest[:12],
                       self._identity.digest[:12])
        # The old side closed first: it holds what only one may (a pool_events PUB socket
        # bound to its endpoint: the new side's bind failed, EADDRINUSE, and the engine with
        # it), and its probes' connections (redis, s3, the node's: left open beside the new
        # side's, every engine start; tests/connector/test_handshake_rebuild.py).
        self._scheduler.close()
        self._identity = ModelFingerprint(digest, weight_files)
        self._scheduler = self._build_scheduler(
            model_id_for(self._vllm_config, self._identity), self._identity)

    def set_xfer_handshake_metadata_pp_aware(
            self, metadata: dict[tuple[int, int], KVConnectorHandshakeMetadata]) -> None:
        """`set_xfer_handshake_metadata` over every (pipeline, tensor) rank's identity."""
        self.set_xfer_handshake_metadata(dict(enumerate(metadata.values())))

    # -- worker side ----------------------------------------------------------------------

    def get_handshake_metadata(self) -> WorkerIdentity | None:
        """This worker's `WorkerIdentity` (vLLM collects it once its KV caches are
        registered; `set_xfer_handshake_metadata`)."""
        if self._worker is None or self._identity is None:
            return None
        return WorkerIdentity(self._identity.digest, self._identity.weight_files)


    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Build the worker over vLLM's tensors (model runner thread).

        State layers' states (groups.py) move with the KV wherever it lives: through the CPU
        mover (cpu.py) for host tensors, the device mover (streams.py) for CUDA ones, in the
        same staging buffers and stream order as the KV. Refused: state tensors whose bytes a
        block differ from what the spec says (`ChunkGroups.state_bytes`), or that live on
        another device than the KV (no stream orders a copy between them).

        Raises:
            ConfigError: a model kvtier does not serve (models.refuse), in one line.
        """
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank


        groups = chunk_groups(str(self._vllm_config.model_config.model),
                              self._kv_cache_config)
        _model_id, self._identity = scheduler_model_identity(self._vllm_config)
        fmt, layouts = engine_layouts(self._vllm_config, self._kv_cache_config, groups,
                                      self._config.tokens_per_chunk, self._identity.digest)
        # Chunk order: group by group (groups.py); state layers' states after the KV.
        # Layers that share another layer's KV (vLLM's KV sharing) are in no group: their
        # bytes are their target's, stored once.
        states = [[_state_tensors(kv_caches[name]) for name in names]
                  for names in groups.state_layer_names]
        first = groups.layer_order[0]
        paged = PagedKV({name: kv_caches[name] for name in groups.layer_order},
                        self._block_size, fmt,
                        content=None if fmt.kv_factor == 1 else backend_content(
                            self._vllm_config, first, kv_caches[first].device),
                        group_sizes=tuple(map(len, groups.layer_names)),
                        null_block=NULL_BLOCK if groups.count > 1 or states else None,
                        states=states)
        state_devices = {t.device for layers in states for layer in layers for t in layer}
        if paged.state_bytes != groups.state_bytes or state_devices - {paged.device}:
            raise refuse(str(self._vllm_config.model_config.model),
                         f"state layers of {paged.state_bytes} bytes a block on "
                         f"{sorted(map(str, state_devices))} (kvtier stores states of "
                         f"{groups.state_bytes} bytes on the KV's device {paged.device})",
                         HMA_ALTERNATIVE)
        world = self._vllm_config.parallel_config.tensor_parallel_size
        rank = get_tensor_model_parallel_rank()
        # The scheduler's layouts, this rank's: probes and stores agree by construction.
        layout = layouts[rank]
        if paged.kernel_split > 1:
            logger.info("kvtier: vLLM splits each %d-token block into %d kernel blocks",
                        self._block_size, paged.kernel_split)
        info = namespace_info(self._vllm_config, self._identity)
        store, io_cores = self._worker_store(layout, info, world, rank)
        # A prefill instance hands its KV over through the lower tiers: its steps wait for
        # their writes (a stalled tier is abandoned after read_timeout_s, like a read).
        handoff = self._kv_transfer_config.kv_role == "kv_producer"
        self._worker = ConnectorWorker(paged, layout, store,
                                       load_batch=load_batch_for(self._config.store.io_threads,
                                                                 layout.bytes_per_chunk),
                                       agree=tp_any if world > 1 else None,
                                       handoff_timeout_s=self._config.store.read_timeout_s
                                       if handoff else None, io_cores=io_cores)

    def _worker_store(self, layout: KVLayout, info: NamespaceInfo, world: int, rank: int
                      ) -> tuple[ChunkStore, frozenset[int] | None]:
        """This rank's store, and the cores its I/O threads run on (None: unbound): the
        node's (node mode: nothing below RAM runs here) or the tiers' in this process."""
        if self._config.node:
            logger.info("kvtier: node mode: the cache of the node at %s", self._config.node)
            return NodeStore(self._node_client(layout, info), layout.bytes_per_chunk), None
        # Capacities are per engine, like vLLM's cpu_bytes_to_use: each rank holds its share.
        store_config = self._config.store.per_rank(world)
        if world > 1:
            logger.info("kvtier: TP rank %d of %d: %s", rank, world, ", ".join(
                f"{t.tier_name} {t.capacity} B" for t in store_config.tiers))
        store = open_store(store_config, layout, info, engine_bound=True)
        io_cores = store.settings.io_cores
        if io_cores is not None:
            logger.info("kvtier: I/O threads on cores %s (the model runner's: %s)",
                        sorted(io_cores), sorted(os.sched_getaffinity(0)))
        return store, io_cores

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """The step's plan, before its forward (vLLM calls start_load_kv after the forward in
        a step without synchronous loads): the worker takes it in, loaded states go where the
        forward reads them (models with state layers) and, on the CPU, asynchronous loads
        start here, so that they run beside this forward rather than the next."""
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None and isinstance(connector_metadata, KVTierMetadata):
            self._worker.begin_step(connector_metadata)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if self._worker is not None and isinstance(meta, KVTierMetadata):
            if meta.loads:
                self._worker.load(meta)
            self._worker.start_async(meta)  # those begin_step did not start
            self._worker.prefetch(meta.prefetch)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads complete in start_load_kv

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor,
                      attn_metadata: AttentionMetadata, **kwargs: Any) -> None:
        return  # stores run in wait_for_save, once every layer is computed

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        """Before the step's forward: stores still reading a preempted request's blocks
        finish (vLLM may hand those blocks to a request this forward writes)."""
        if self._worker is not None and isinstance(kv_connector_metadata, KVTierMetadata) \
                and kv_connector_metadata.preempted:
            self._worker.finish_stores()

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        if self._worker is not None and isinstance(meta, KVTierMetadata) and meta.stores:
            self._worker.store(meta)

    def take_events(self) -> Iterable[KVCacheEvent]:
        return self._scheduler.take_events() if self._scheduler is not None else ()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """(the held requests whose stores are done, the requests whose asynchronous load
        ended). The plan names the held requests (`KVTierMetadata.held`, a subset of
        `finished_req_ids`); an ended load may have failed (see
        get_block_ids_with_load_errors, asked right after this)."""
        if self._worker is None:
            return None, None
        meta = self._connector_metadata  # bound for the step (None outside one)
        held = meta.held if isinstance(meta, KVTierMetadata) else set()
        sending = self._worker.finish_step(held)
        return sending or None, self._worker.take_finished_loads() or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """`get_finished`, and the requests whose asynchronous load failed (reported by
        request with several KV cache groups: see worker.take_failed_block_ids)."""
        sending, recving = self.get_finished(finished_req_ids)
        failed = self._worker.take_failed_requests() if self._worker is not None else set()
        return KVConnectorTransferResults(finished_sending=set(sending or ()),
                                          finished_recving=set(recving or ()),
                                          failed_recving=failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.take_failed_block_ids() if self._worker is not None else set()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return self._worker.take_report() if self._worker is not None else None

    # -- metrics (both roles) -------------------------------------------------------------

    def get_kv_connector_stats(self) -> KVTierConnectorStats | None:
        side = self._worker or self._scheduler
        return side.take_stats() if side is not None else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVTierConnectorStats:
        return KVTierConnectorStats(data=data if data is not None else {})

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict[type, type],
                           labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> KVTierPromMetrics:
        return KVTierPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        """Finish queued writes to the slower tiers and close the store (engine exit).

        vLLM gives a stopping worker VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS (5 s) before it
        signals it, then kills it: the flush stops a second before that, and the writes
        still queued are dropped and logged rather than cut off mid-way. Raise that
        variable to give a large write-behind queue more time."""
        if self._worker is not None:
            from vllm import envs

            self._worker.close(
                flush_timeout_s=max(0.5, envs.VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS - 1.0))
        if self._scheduler is not None:
            self._scheduler.close()
