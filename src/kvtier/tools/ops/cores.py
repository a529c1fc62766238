"""Which cores the CPU backend's engines take when kvtier starts several on one host.

vLLM's CPU backend binds a worker's compute threads itself (`VLLM_CPU_OMP_THREADS_BIND`,
"auto" by default: the first NUMA node's cores, one logical CPU per physical core, the last
one left to the engine core and the API server). Every process makes the same choice, so
engines started side by side (`kvtier demo --node`, `kvtier bench pooling`) computed on the
same cores while the others idled: on 2 cores, both workers on core 0. `bind_apart` gives
each engine's worker its own share of the cores instead, through that variable.

Primitives:
    bind_apart(commands, cores=None, cpu=None) -- the commands, each with its own cores
    physical_cpus(cpus)                        -- one logical CPU per physical core
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable, Sequence
from pathlib import Path

from kvtier.tools.ops.serving import ServeCommand, is_cpu_backend, local_workers

BIND = "VLLM_CPU_OMP_THREADS_BIND"
TOPOLOGY = Path("/sys/devices/system/cpu")  # sysfs: each CPU's hyperthread siblings


def bind_apart(commands: Sequence[ServeCommand], cores: Sequence[int] | None = None,
               cpu: bool | None = None) -> list[ServeCommand]:
    """`commands`, servers started together on this host, each binding its worker to its own
    share of `cores`: with C cores for N servers, the i-th C // N of them, less the last (left
    to its engine core and API server, as vLLM's own binding leaves one) where that leaves at
    least one. With fewer cores than servers, one each is impossible: the commands are
    returned as given (vLLM's default binding).

    Also returned as given: a GPU backend (`cpu` False; None: `is_cpu_backend()`), a single
    command, a command with more than one worker (tensor or pipeline parallel: one core list
    per worker would be needed), or a binding already chosen (in `os.environ` or a command's
    env): the operator's choice wins.

    Args:
        cores: the logical CPUs to share, one per physical core; None: those this process
            may run on (`physical_cpus`).
    """
    cpu = is_cpu_backend() if cpu is None else cpu
    if not cpu or len(commands) < 2 or BIND in os.environ \
            or any(BIND in c.env or local_workers(c.argv) != 1 for c in commands):
        return list(commands)
    cores = physical_cpus(os.sched_getaffinity(0)) if cores is None else sorted(cores)
    share = len(cores) // len(commands)
    if share == 0:
        return list(commands)
    bound = []
    for i, command in enumerate(commands):
        mine = cores[i * share:(i + 1) * share]
        worker = mine[:-1] if len(mine) > 1 else mine
        cores_text = ",".join(map(str, worker))
        note = (f"{BIND}={cores_text}: {len(commands)} servers started together, each its "
                f"own {share} of this host's {len(cores)} cores (vLLM's default binds every "
                "server's worker to the same ones)")
        bound.append(dataclasses.replace(command, env={**command.env, BIND: cores_text},
                                         notes=(*command.notes, note)))
    return bound


def physical_cpus(cpus: Iterable[int], topology: Path = TOPOLOGY) -> list[int]:
    """`cpus`, sorted, keeping one logical CPU per physical core: the last of its hyperthread
    siblings, as vLLM's automatic binding does on x86 (each OpenMP thread a whole core). A
    CPU whose topology cannot be read counts as a core of its own.

    Args:
        topology: sysfs' CPU folder (cpuN/topology/thread_siblings_list).
    """
    chosen: dict[str, int] = {}
    for cpu in sorted(cpus):
        try:
            siblings = (topology / f"cpu{cpu}" / "topology" / "thread_siblings_list").read_text()
        except OSError:
            siblings = f"cpu{cpu}"
        chosen[siblings.strip()] = cpu
    return sorted(chosen.values())
