"""Offline vLLM engines on the CPU backend, for the engine tests and the benchmarks that time
prefills in-process (ttft, sharing).

vLLM's processes put their ZeroMQ socket files where `VLLM_RPC_BASE_PATH` says, /tmp by
default, and leave some behind at every shutdown (`kvtier bench ttft --quick`: 42 files): the
first engine of a process gives it a folder of its own, removed at its exit
(`own_rpc_folder`), unless its environment names one already. The shared memory files
vLLM leaves in /dev/shm (a tensor parallel engine's ranks', every engine core's RPC queue to
its worker) are removed once its processes have ended (`kvtier.testing.vllmshm`), and the
files it leaves in the temp dir (its rendezvous file) with a temp dir of its own
(`kvtier.testing.vllmtmp`).

Primitives: `offline_engine` (an `LLM` with small CPU settings, shut down on exit), `counter`
(one of vLLM's counters, summed over labels), `kvtier_counter` / `kvtier_gauge` (one of
kvtier's, from this process's Prometheus registry), `quiet_engine_logs`, `own_rpc_folder`,
`BLOCK_SIZE`, `NUM_BLOCKS`.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kvtier.testing.vllmshm import remove_when_gone, vllm_shm_maps
from kvtier.testing.vllmtmp import own_temp_dir, temp_dir_named

BLOCK_SIZE = 128  # tokens per vLLM block (the CPU backend's default)
NUM_BLOCKS = 384  # the engine's own KV cache, in blocks
RPC_PATH = "VLLM_RPC_BASE_PATH"


def own_rpc_folder() -> str:
    """The folder of vLLM's socket files for this process: the one its environment names, or
    else a new one, named there (engines started later and their processes use it) and
    removed when this process exits. Kept for the process's life, as vLLM's processes may
    cache their environment."""
    folder = os.environ.get(RPC_PATH)
    if folder is None:
        folder = os.environ[RPC_PATH] = tempfile.mkdtemp(prefix="kvtier-rpc-")
        atexit.register(shutil.rmtree, folder, True)
    return folder


@contextlib.contextmanager
def offline_engine(model_dir: Path, max_model_len: int, **overrides: Any) -> Iterator[Any]:
    """An offline `vllm.LLM` (eager, seeded, stats on); its processes are shut down on exit.

    `overrides` are any other `LLM(...)` arguments (kv_transfer_config, enable_prefix_caching).
    """
    import psutil

    # vLLM's lock folder for downloads is the temp dir its module finds at import, before
    # the engine's own (removed with it) is named: imported here, it keeps the host's.
    import vllm.model_executor.model_loader.weight_utils  # noqa: F401
    from vllm import LLM

    own_rpc_folder()
    kwargs: dict[str, Any] = dict(
        model=str(model_dir), enforce_eager=True, gpu_memory_utilization=0.3, seed=0,
        block_size=BLOCK_SIZE, max_model_len=max_model_len, max_num_batched_tokens=max_model_len,
        num_gpu_blocks_override=NUM_BLOCKS, disable_log_stats=False)
    kwargs.update(overrides)
    with own_temp_dir() as temp:  # its rendezvous file, removed after it (vllmtmp.py)
        before = _descendants()
        with temp_dir_named(temp):
            llm = LLM(**kwargs)
        engine_pids = _descendants() - before  # its EngineCore and workers (none in process)
        shm = vllm_shm_maps(engine_pids)  # its TP ranks' files, which vLLM leaves (vllmshm.py)
        try:
            yield llm
        finally:
            for pid, files in vllm_shm_maps(engine_pids).items():
                shm.setdefault(pid, set()).update(files)
            try:
                llm.llm_engine.engine_core.shutdown()
            except psutil.NoSuchProcess:
                # vLLM force-kills an EngineCore slow to exit by naming each of its children
                # first, and one that exits meanwhile raises (vllm/utils/system_utils.py,
                # kill_process_tree) before the rest are killed: kill what is left of them.
                _kill(engine_pids)
            del llm
            gc.collect()
            if shm:
                remove_when_gone(shm)


def _descendants() -> set[int]:
    """Pids of this process's children, theirs, and so on."""
    import psutil

    return {child.pid for child in psutil.Process().children(recursive=True)}


def _kill(pids: set[int]) -> None:
    """SIGKILL those of `pids` still running (a pid gone, or reused by another process,
    is left alone)."""
    import psutil

    for pid in pids & _descendants():
        with contextlib.suppress(psutil.NoSuchProcess):
            psutil.Process(pid).kill()


def counter(llm: Any, name: str) -> float:
    """One of vLLM's counters (e.g. "vllm:kvtier_loaded_tokens"), summed over its labels."""
    return float(sum(m.value for m in llm.get_metrics()
                     if m.name == name and isinstance(getattr(m, "value", None), (int, float))))


def kvtier_counter(name: str, tier: str | None = None, **labels: str) -> float:
    """kvtier's counter `name` (summed over engines, and over tiers unless `tier`, and over
    other labels unless given: `reason="loaded"`).

    Read from this process's Prometheus registry, where vLLM's stat logger feeds the
    connector's stats (the same numbers a server shows on /metrics).
    """
    return _kvtier_samples(name, "_total", tier, labels)


def kvtier_gauge(name: str, tier: str | None = None) -> float:
    """kvtier's gauge `name` (summed over engines, and over tiers unless `tier`)."""
    return _kvtier_samples(name, "", tier, {})


def _kvtier_samples(name: str, suffix: str, tier: str | None, labels: dict[str, str]) -> float:
    from prometheus_client import REGISTRY

    from kvtier.integrations.vllm.metrics import PREFIX

    if tier is not None:
        labels = {**labels, "tier": tier}
    total = 0.0
    for family in REGISTRY.collect():
        if family.name != PREFIX + name:
            continue
        for sample in family.samples:
            if sample.name == PREFIX + name + suffix and all(
                    sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


def quiet_engine_logs() -> None:
    """Keep engine start-up logs from burying a bench's tables."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    for name in ("vllm", "kvtier"):
        logging.getLogger(name).setLevel(logging.WARNING)
