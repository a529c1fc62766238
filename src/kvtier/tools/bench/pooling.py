"""`kvtier bench pooling`: two vLLM engines behind a round-robin router, with one `kvtier node`
holding the RAM tier for both, against a RAM tier each: the same bytes in all.

Engines on one node that keep their RAM tiers in process hold a tier each, with its share of
the node's memory; a router that does not pin conversations to engines sends a user's next
turn to the engine that did not compute the last one, whose tier lacks it. One node's tier is
every engine's. The bench serves one multi-round chat (the demo's: `DemoPlan`, its generated
model, its small engine KV cache, so that vLLM's own prefix cache has evicted a user's history
by the time the user returns) under both configurations, one after the other:
  - `private`: two engines, each with a memory tier of `ram_bytes / 2` in its process;
  - `node`: one `kvtier node` with a memory tier of `ram_bytes` (shared memory), and two
    engines in node mode.
Turn t of user u goes to engine (u + t) % 2 (round robin across turns: the returning user
lands on the other engine). A turn's requests are sent to each engine in turn (never both at
once: the TTFTs are the engines', not the 2 cores' contention), every user's turn t before
any turn t + 1. Per configuration, over the returning turns (t >= 1): the prompt tokens
kvtier served (vLLM's `external_prefix_cache_hits`), those vLLM's own cache served, and the
median TTFT; and the node's ratios to the private tiers'.

Primitives: `PoolingConfig`, `PooledRun`, `PoolingResult`, `run_pooling_bench`, `CONFIGS`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvtier.errors import ConfigError
from kvtier.testing.tinymodel import make_preset_model, served_name
from kvtier.tools.bench.demo import DemoPlan, server_config, warm_up
from kvtier.tools.bench.headroom import MemoryNeed, require_memory
from kvtier.tools.bench.node import node_process
from kvtier.tools.bench.serving.arrivals import machine
from kvtier.tools.bench.serving.client import ClientConfig
from kvtier.tools.bench.serving.runner import BenchRun, bench_endpoint
from kvtier.tools.bench.serving.workloads import Turn, Workload
from kvtier.tools.ops.cores import bind_apart
from kvtier.tools.ops.server import VllmServer
from kvtier.tools.ops.serving import build_command, connector_config
from kvtier.units import format_size

CONFIGS = ("private", "node")
ENGINES = 2


@dataclass(frozen=True, slots=True)
class PoolingConfig:
    """What one `kvtier bench pooling` run does. Validated by `validate`."""

    plan: DemoPlan  # model, chat workload and engine sizes
    ram_bytes: int  # kvtier's RAM in all: the node's tier, or split evenly between engines
    work_dir: Path  # server logs, the node's socket and config
    model_root: Path  # where the generated model is cached
    configs: tuple[str, ...] = CONFIGS

    def validate(self) -> None:
        """Raises ConfigError naming the first bad field; NotEnoughMemory where --ram does not
        fit in the RAM available."""
        if self.plan.turns < 2:
            raise ConfigError("turns", self.plan.turns, "an integer >= 2 (returning turns)")
        if self.ram_bytes < ENGINES * (1 << 20):
            raise ConfigError("ram_bytes", self.ram_bytes, f">= {ENGINES} MiB")
        require_memory(MemoryNeed("--ram", format_size(self.ram_bytes), self.ram_bytes, 0,
                                  "kvtier's memory tiers, the node's or the engines'"))
        for name in self.configs:
            if name not in CONFIGS:
                raise ConfigError("configs", name, f"some of {CONFIGS}")


@dataclass(frozen=True, slots=True)
class PooledRun:
    """One configuration's returning turns."""

    name: str  # one of CONFIGS
    requests: int  # every turn's, sent
    failures: list[str]  # why failed requests failed
    returning_prompt_tokens: int  # of the completed returning turns
    kvtier_hit_tokens: int  # of them, served by kvtier (vLLM's external prefix-cache hits)
    engine_hit_tokens: int  # of them, served by vLLM's own prefix cache
    returning_ttft_s: list[float] = field(default_factory=list)  # each returning turn's

    @property
    def kvtier_hit_share(self) -> float:
        return self.kvtier_hit_tokens / max(self.returning_prompt_tokens, 1)

    @property
    def ttft_p50_s(self) -> float | None:
        return statistics.median(self.returning_ttft_s) if self.returning_ttft_s else None


@dataclass(frozen=True, slots=True)
class PoolingResult:
    config: PoolingConfig
    runs: tuple[PooledRun, ...]
    commands: dict[str, list[str]]  # configuration -> its engines' command lines
    wall_s: float
    machine: dict[str, Any]

    def by_name(self) -> dict[str, PooledRun]:
        return {run.name: run for run in self.runs}

    def ratios(self) -> dict[str, float | None]:
        """node / private: kvtier's hit share, and returning turns' median TTFT."""
        runs = self.by_name()
        node, private = runs.get("node"), runs.get("private")
        if node is None or private is None:
            return {}
        share = node.kvtier_hit_share / private.kvtier_hit_share \
            if private.kvtier_hit_share else None
        ttft = node.ttft_p50_s / private.ttft_p50_s \
            if node.ttft_p50_s and private.ttft_p50_s else None
        return {"kvtier_hit_share": share, "returning_ttft_p50": ttft}

    def write_json(self, path: Path, command: str) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({
            "command": command, "plan": dataclasses.asdict(self.config.plan),
            "ram_bytes": self.config.ram_bytes, "wall_s": self.wall_s,
            "machine": self.machine, "engine_commands": self.commands,
            "runs": [dict(dataclasses.asdict(run), kvtier_hit_share=run.kvtier_hit_share,
                          ttft_p50_s=run.ttft_p50_s) for run in self.runs],
            "node_vs_private": self.ratios()}, indent=2) + "\n")


def run_pooling_bench(config: PoolingConfig,
                      progress: Callable[[str], None] = lambda _text: None) -> PoolingResult:
    """Run each configuration in turn; see the module docstring.

    Raises:
        ConfigError: a bad setting.
        kvtier.errors.ServerError: a server did not start (the message has its log's tail).
        RuntimeError: the node did not start.
    """
    config.validate()
    started, load_before = time.perf_counter(), os.getloadavg()
    model = make_preset_model(config.plan.preset, config.model_root)
    runs, commands = [], {}
    for name in config.configs:
        progress(f"{name}: starting {ENGINES} engines")
        with _engines(config, name, model) as engines:
            commands[name] = [server.command.display() for server in engines]
            runs.append(_serve_chat(config, name, model, engines, progress))
    return PoolingResult(config, tuple(runs), commands, time.perf_counter() - started,
                         machine(load_before))


@contextlib.contextmanager
def _engines(config: PoolingConfig, name: str, model: Path) -> Iterator[list[VllmServer]]:
    """The configuration's engines, started side by side, ready; stopped on exit (and the
    node, for "node", after them)."""
    work = config.work_dir / name
    work.mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as stack:
        if name == "node":
            socket_path = stack.enter_context(node_process(work / "node", config.ram_bytes))
            extra: dict[str, Any] = {"node": socket_path}
        else:
            extra = connector_config([{"kind": "memory",
                                       "capacity": config.ram_bytes // ENGINES}])
        servers = []
        commands = bind_apart([build_command(dataclasses.replace(
            server_config(config.plan, model, False, work), kvtier=True, extra_config=extra))
            for _ in range(ENGINES)])  # each its own cores (ops/cores.py)
        for i, command in enumerate(commands):
            server = VllmServer(command, work / f"engine-{i}.log")
            stack.callback(server.stop)
            server.start()
            servers.append(server)
        for i, server in enumerate(servers):
            server.wait_ready(config.plan.startup_timeout_s)
            # Each its own warm-up prompt: one engine's would be a hit for the other.
            bench_endpoint(warm_up(config.plan, seed=2_000_003 + i),
                           _client(config.plan, server, model), "warm-up")
        yield servers


def _serve_chat(config: PoolingConfig, name: str, model: Path, engines: Sequence[VllmServer],
                progress: Callable[[str], None]) -> PooledRun:
    """Every turn of the chat, turn by turn, each user's on engine (user + turn) % 2."""
    plan = config.plan
    chat = plan.workload()
    prompts = {(t.session, t.turn): p for t, p in zip(chat.turns, chat.static_prompts())}
    runs: list[tuple[int, BenchRun]] = []
    for turn in range(plan.turns):
        for e, server in enumerate(engines):
            users = [u for u in range(plan.users) if (u + turn) % len(engines) == e]
            progress(f"{name}: turn {turn + 1}/{plan.turns}, engine {e}: {len(users)} users")
            workload = Workload(chat.name, tuple(
                Turn(session=u, turn=turn, tokens=prompts[u, turn], max_tokens=plan.output_len)
                for u in users), chained=False, params=chat.params)
            runs.append((turn, bench_endpoint(workload, _client(plan, server, model),
                                              f"{name} turn {turn} engine {e}")))
    returning = [run for turn, run in runs if turn >= 1]
    done = [r for run in returning for r in run.results if r.ok]
    return PooledRun(
        name=name, requests=sum(run.summary.requests for _, run in runs),
        failures=[r.error or "" for _, run in runs for r in run.results if not r.ok],
        returning_prompt_tokens=sum(r.prompt_tokens for r in done),
        kvtier_hit_tokens=int(sum(_counter(run, "vllm:external_prefix_cache_hits_total")
                                  for run in returning)),
        engine_hit_tokens=int(sum(_counter(run, "vllm:prefix_cache_hits_total")
                                  for run in returning)),
        returning_ttft_s=[r.ttft_s for r in done if r.ttft_s is not None])


def _counter(run: BenchRun, name: str) -> float:
    return (run.metrics or {}).get(name, 0.0)


def _client(plan: DemoPlan, server: VllmServer, model: Path) -> ClientConfig:
    return ClientConfig(server.url, served_name(model) or str(model),
                        concurrency=plan.concurrency, warmup_requests=0)
