"""Servers kvtier starts together on one host (CPU backend) bind their workers to cores of
their own: vLLM's default binding ("auto") chose the same cores in every process, so two
engines computed on one core (of 2 here: both workers on core 0) while the other idled.
Each server gets its share through VLLM_CPU_OMP_THREADS_BIND; what cannot be split (fewer
cores than servers, tensor parallelism) or was chosen by the operator is left as it was.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest

from kvtier.tools.bench.demo import PLANS
from kvtier.tools.bench.demo_node import node_commands
from kvtier.tools.ops.cores import BIND, bind_apart, physical_cpus
from kvtier.tools.ops.server import VllmServer
from kvtier.tools.ops.serving import ServeCommand, ServeConfig, build_command, is_cpu_backend


@pytest.fixture(autouse=True)
def _no_binding_of_the_callers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(BIND, raising=False)


def servers(n: int, *args: str) -> list[ServeCommand]:
    return [build_command(ServeConfig("m", kvtier=False, cpu=True, vllm_args=args))
            for _ in range(n)]


def binds(commands: list[ServeCommand]) -> list[str | None]:
    return [c.env.get(BIND) for c in commands]


def on_cpu(commands: list[ServeCommand], cores: Sequence[int]) -> list[ServeCommand]:
    """`bind_apart` for the CPU backend, whatever this host has: left to `is_cpu_backend()`,
    a host with an NVIDIA device (and no vllm-cpu) returned every command as given."""
    return bind_apart(commands, cores=cores, cpu=True)


def test_each_server_gets_its_share_less_one_for_its_other_processes():
    assert binds(on_cpu(servers(2), range(8))) == ["0,1,2", "4,5,6"]
    assert binds(on_cpu(servers(3), range(8))) == ["0", "2", "4"]  # 2 each
    bound = on_cpu(servers(2), [3, 1, 7, 5])
    assert binds(bound) == ["1", "5"]
    assert all(any(n.startswith(f"{BIND}=") for n in c.notes) for c in bound)
    assert all(c.display().startswith(f"{BIND}=") for c in bound)  # the printed command


def test_two_servers_on_two_cores_get_one_each():
    # This machine's case: vLLM's own binding put both workers on core 0 (core 1 reserved
    # for the engine cores and API servers); now each worker computes on a core of its own,
    # the other processes wherever the scheduler puts them.
    assert binds(on_cpu(servers(2), [0, 1])) == ["0", "1"]


@pytest.mark.parametrize("commands, cores", [
    (servers(3), [0, 1]),  # fewer cores than servers: vLLM's default
    (servers(1), [0, 1]),  # one server: nothing to share
    (servers(2, "--tensor-parallel-size", "2"), range(8)),  # a core list per worker needed
])
def test_what_cannot_be_split_is_left_to_vllm(commands: list[ServeCommand],
                                              cores: list[int]):
    assert on_cpu(commands, cores) == commands


def test_the_operators_binding_wins(monkeypatch: pytest.MonkeyPatch):
    own = [ServeCommand(c.argv, {BIND: "0-3"}, c.url, None) for c in servers(2)]
    assert on_cpu(own, range(8)) == own
    assert bind_apart(servers(2), cores=range(8), cpu=False) == servers(2)  # GPUs: no-op
    monkeypatch.setenv(BIND, "0-3")
    assert binds(on_cpu(servers(2), range(8))) == [None, None]


def test_one_logical_cpu_per_physical_core(tmp_path: Path):
    # Two cores with two hyperthreads each (0 and 2, 1 and 3), as sysfs lists them: the last
    # sibling of each, as vLLM's auto binding picks; cpu 9's topology is unreadable.
    for cpu, siblings in ((0, "0,2"), (1, "1,3"), (2, "0,2"), (3, "1,3")):
        topology = tmp_path / f"cpu{cpu}" / "topology"
        topology.mkdir(parents=True)
        (topology / "thread_siblings_list").write_text(siblings + "\n")
    assert physical_cpus([3, 0, 1, 2, 9], topology=tmp_path) == [2, 3, 9]
    assert physical_cpus([0, 1], topology=tmp_path) == [0, 1]  # siblings not ours


def test_each_server_process_gets_its_own_binding(tmp_path: Path):
    # The environment each started process sees (VllmServer adds a command's env to this
    # process's): a stand-in server that writes its binding down and exits.
    bound = on_cpu(servers(2), [0, 1])
    for i, command in enumerate(bound):
        out = tmp_path / f"bind-{i}"
        argv = (sys.executable, "-c",
                f"import os; open({str(out)!r}, 'w').write(os.environ[{BIND!r}])")
        server = VllmServer(ServeCommand(argv, command.env, command.url, None))
        server.start()
        assert server.proc is not None and server.proc.wait(timeout=60) == 0
        server.stop()
    assert [(tmp_path / f"bind-{i}").read_text() for i in range(2)] == ["0", "1"]


def test_the_node_demos_two_servers_bind_apart_where_the_host_allows(tmp_path: Path):
    commands = node_commands(PLANS["quick"], tmp_path / "model", "/run/kvtier/n.sock",
                             tmp_path)
    cores = physical_cpus(os.sched_getaffinity(0))
    if is_cpu_backend() and len(cores) >= 2:
        a, b = ({int(c) for c in cmd.env[BIND].split(",")} for cmd in commands)
        assert a and b and not a & b and a | b <= set(cores)
    else:
        assert binds(commands) == [None, None]
