"""`kvtier bench clients`: the field's own benchmark clients, unmodified, against vLLM's
OpenAI server without kvtier and with it (issue 44).

The clients are vLLM's multi-turn benchmark (benchmarks/multi_turn/
benchmark_serving_multi_turn.py) and LMCache's long_doc_qa (benchmarks/long_doc_qa/
long_doc_qa.py), vendored as published under vendor/ (see vendor/README.md). Each runs as a
subprocess of this Python with its own command-line flags, against the embedded "bench" model
(kvtier.testing.tinymodel: random weights, a byte-level tokenizer, a chat template) served as
`kvtier demo` serves it (`server_config` of the demo's "full" plan): the same small engine KV
cache both ways, so that a returning conversation or a repeated document has been evicted from
vLLM's own prefix cache, and kvtier's RAM and disk tiers on the kvtier side. One server per
setup; the clients run one after the other against it. What each client prints and writes is
read back by clients_results.py; the server's prefix-cache counters are scraped around each
client.

Primitives:
  - `ClientsPlan`, `PLANS` ("full", "quick"): the clients' sizes (frozen).
  - `corpus_text(words, seed)`: the text the multi-turn client cuts conversations from.
  - `multi_turn_input(plan, text_file)`: its conversation generator's JSON.
  - `multi_turn_argv(...)`, `long_doc_qa_argv(...)`: the clients' command lines.
  - `run_clients_bench(config, progress)`: the whole bench; returns a `ClientsResult`.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from kvtier.errors import ClientFailed, ConfigError
from kvtier.testing.tinymodel import make_preset_model, served_name
from kvtier.tools.bench.clients_results import (
    CLIENTS,
    KVTIER_COUNTERS,
    LONG_DOC_QA,
    MULTI_TURN,
    ClientFigures,
    equal_answers,
    long_doc_qa_answers,
    multi_turn_answers,
    parse_long_doc_qa,
    parse_multi_turn,
    ratio,
)
from kvtier.tools.bench.demo import PLANS as DEMO_PLANS
from kvtier.tools.bench.demo import server_config
from kvtier.tools.bench.serving.arrivals import machine
from kvtier.tools.bench.serving.promdiff import parse_metrics
from kvtier.tools.ops.restorecost import PREFIX  # vllm's metric prefix, without vllm
from kvtier.tools.ops.server import running_server
from kvtier.tools.ops.serving import build_command

VENDOR = Path(__file__).resolve().parent / "vendor"
MULTI_TURN_SCRIPT = VENDOR / "vllm_multi_turn" / "benchmark_serving_multi_turn.py"
LONG_DOC_QA_SCRIPT = VENDOR / "lmcache_long_doc_qa" / "long_doc_qa.py"
SETUPS = ("vLLM", "vLLM + kvtier")


@dataclass(frozen=True, slots=True)
class ClientsPlan:
    """The clients' sizes. The servers are the demo's "full" plan's (8k-token engine KV cache
    of 48 MiB, 4,096-token context, kvtier's 512 MiB RAM and 1 GiB disk tiers)."""

    name: str  # "full" or "quick"
    conversations: int  # multi-turn: conversations in all
    active: int  # multi-turn: --max-active-conversations (all clients), served round-robin
    user_turns: tuple[int, int]  # multi-turn: user turns of a conversation, uniform min..max
    first_tokens: int  # multi-turn: context of a conversation's first turn (its "prefix")
    user_tokens: tuple[int, int]  # multi-turn: tokens of each user message, uniform
    answer_tokens: tuple[int, int]  # multi-turn: tokens of each answer, uniform
    clients: int  # multi-turn: --num-clients (requests in flight)
    documents: int  # long_doc_qa: --num-documents
    document_words: int  # long_doc_qa: --document-length ("hi" words: 2 tokens each here)
    output_tokens: int  # long_doc_qa: --output-len
    inflight: int  # long_doc_qa: --max-inflight-requests
    demo_plan: str = "full"  # the servers' settings (kvtier.tools.bench.demo.PLANS)
    client_timeout_s: float = 1200.0  # a client's run, at most

    def validate(self) -> None:
        """Raises ConfigError naming the first bad field."""
        for name in ("conversations", "active", "first_tokens", "clients", "documents",
                     "document_words", "output_tokens", "inflight"):
            if getattr(self, name) < 1:
                raise ConfigError(name, getattr(self, name), "an integer >= 1")
        for name in ("user_turns", "user_tokens", "answer_tokens"):
            low, high = getattr(self, name)
            if not 1 <= low <= high:
                raise ConfigError(name, (low, high), "1 <= min <= max")
        if not self.clients <= self.active <= self.conversations:
            raise ConfigError("active", self.active,
                              f"clients ({self.clients}) <= active <= conversations "
                              f"({self.conversations})")


PLANS: dict[str, ClientsPlan] = {
    # Conversations of 4-6 turns on ~1k-token contexts (histories of up to ~2k tokens), 8 of
    # them active at a time (~12k tokens against an engine cache of 6k: a conversation's next
    # turn finds its history evicted from vLLM's cache). The client stops once its queue is
    # empty and a conversation ends, so it gets more conversations than active ones: most of
    # the 24 run to their end. 8 documents of ~2k tokens asked twice. ~3 min on 2 cores.
    "full": ClientsPlan(name="full", conversations=24, active=8, user_turns=(4, 6),
                        first_tokens=1024,
                        user_tokens=(80, 120), answer_tokens=(8, 16), clients=2,
                        documents=8, document_words=1000, output_tokens=16, inflight=2),
    # A smoke run: 4 conversations of 2-3 turns, 3 documents of ~1k tokens.
    "quick": ClientsPlan(name="quick", conversations=6, active=4, user_turns=(2, 3),
                         first_tokens=512,
                         user_tokens=(40, 60), answer_tokens=(4, 8), clients=2,
                         documents=3, document_words=500, output_tokens=8, inflight=2,
                         demo_plan="quick"),
}

# Words the multi-turn client's corpus is drawn from (its README downloads a Gutenberg book);
# one string split: 150 quoted words would read worse.
_WORDS = ("the of and to in a is that for it as was with be by on not he this are or his "  # noqa: SIM905
          "from at which but have an they you were her she there one all we their has been "
          "would when who will more no if out so said what up its about into than them can "
          "only other new some time could these two may then do first any my now such like "
          "our over man me even most made after also did many before must through back years "
          "where much your way well down should because each just those people how too little "
          "state good very make world still own see men work long get here between both life "
          "being under never day same another know while last might us great old year off come "
          "since against go came right used take three cache memory engine token prompt").split()


def corpus_text(words: int, seed: int = 0) -> str:
    """`words` English words in sentences, drawn with `seed` (the same text every run)."""
    rng = random.Random(seed)
    out: list[str] = []
    while len(out) < words:
        sentence = [rng.choice(_WORDS) for _ in range(rng.randint(6, 18))]
        out.extend([sentence[0].capitalize(), *sentence[1:-1], sentence[-1] + "."])
    return " ".join(out[:words]) + "\n"


def multi_turn_input(plan: ClientsPlan, text_file: Path) -> dict[str, Any]:
    """The multi-turn client's --input-file: its synthetic-conversation generator's JSON
    (benchmarks/multi_turn/README.md). Its num_turns counts user and assistant messages."""
    def uniform(low: int, high: int) -> dict[str, Any]:
        return {"distribution": "uniform", "min": low, "max": high}

    return {
        "filetype": "generate_conversations",
        "num_conversations": plan.conversations,
        "text_files": [str(text_file)],
        "print_stats": False,
        "prompt_input": {
            "num_turns": uniform(2 * plan.user_turns[0], 2 * plan.user_turns[1]),
            "common_prefix_num_tokens": {"distribution": "constant", "value": 0},
            "prefix_num_tokens": {"distribution": "constant", "value": plan.first_tokens},
            "num_tokens": uniform(*plan.user_tokens),
        },
        "prompt_output": {"num_tokens": uniform(*plan.answer_tokens)},
    }


def corpus_words(plan: ClientsPlan) -> int:
    """Words enough for the generator: it cuts each conversation's context and every user
    message from fresh text (~3 tokens a word here), with room to spare."""
    tokens = plan.conversations * (plan.first_tokens + 2 * plan.user_turns[1]
                                   * plan.user_tokens[1])
    return 2 * tokens // 3 + 2000


def multi_turn_argv(plan: ClientsPlan, *, model_dir: Path, model_name: str, url: str,
                    input_file: Path, stats_file: Path, output_file: Path) -> list[str]:
    """vLLM's multi-turn client's command line: `plan.active` conversations at a time,
    round-robin, all its clients run to their end (--no-early-stop: by default all stop when
    the first one does), with its per-request stats and the conversations it finished, with
    their answers, written to files."""
    return [sys.executable, str(MULTI_TURN_SCRIPT), "--model", str(model_dir),
            "--served-model-name", model_name, "--url", url,
            "--input-file", str(input_file), "--num-clients", str(plan.clients),
            "--max-active-conversations", str(plan.active),
            "--seed", "0", "--request-timeout-sec", "600", "--no-early-stop",
            "--stats-json-output", str(stats_file), "--output-file", str(output_file)]


def long_doc_qa_argv(plan: ClientsPlan, *, model_name: str, url: str,
                     responses_file: Path, eos_token_id: int = 2) -> list[str]:
    """LMCache's long_doc_qa's command line: chat, its default random repeat order (seed 0),
    EOS biased away so that every answer has output_tokens tokens, answers to a file."""
    return [sys.executable, str(LONG_DOC_QA_SCRIPT), "--base-url", f"{url}/v1",
            "--model", model_name, "--num-documents", str(plan.documents),
            "--document-length", str(plan.document_words),
            "--output-len", str(plan.output_tokens),
            "--max-inflight-requests", str(plan.inflight), "--repeat-count", "2",
            "--eos-token-id", str(eos_token_id), "--output", str(responses_file),
            "--json-output"]


def run_client(argv: Sequence[str], cwd: Path, log_path: Path, timeout_s: float) -> str:
    """Run a client in `cwd` (created) and return its output (stdout and stderr, also written
    to `log_path`).

    Raises:
        ClientFailed: it exited non-zero or ran past `timeout_s`.
    """
    cwd.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "OPENAI_API_KEY": os.environ.get("OPENAI_API_KEY", "sk-none")}
    try:
        done = subprocess.run(list(argv), cwd=cwd, env=env, capture_output=True, text=True,
                              timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired as exc:
        raise ClientFailed(f"{argv[1]} ran past {timeout_s:.0f} s") from exc
    output = done.stdout + done.stderr
    log_path.write_text(output)
    if done.returncode != 0:
        tail = "\n".join(output.splitlines()[-20:])
        raise ClientFailed(f"{' '.join(argv[:2])} exited {done.returncode} (log {log_path}):"
                           f"\n{tail}")
    return done.stdout


@dataclass(frozen=True, slots=True)
class ClientsConfig:
    """What one `kvtier bench clients` run does."""

    plan: ClientsPlan
    work_dir: Path  # logs, the clients' files, kvtier's disk tier
    model_root: Path  # where the generated model is cached
    clients: tuple[str, ...] = CLIENTS  # which clients, in this order
    # kvtier's settings besides its tiers (e.g. tokens_per_chunk, tail_chunks: a sweep runs
    # the bench once per value); empty: the demo's
    connector: tuple[tuple[str, Any], ...] = ()


@dataclass(frozen=True, slots=True)
class ClientsResult:
    """What `run_clients_bench` measured."""

    config: ClientsConfig
    runs: tuple[ClientFigures, ...]  # per setup, per client
    server_commands: tuple[str, ...]  # one per setup, as shell lines
    wall_s: float
    machine: dict[str, Any]

    def run(self, client: str, setup: str) -> ClientFigures | None:
        return next((r for r in self.runs if r.client == client and r.setup == setup), None)

    def ratios(self, client: str) -> dict[str, float | None]:
        """kvtier's gain per figure of `client` (clients_results.ratio)."""
        plain, kv = self.run(client, SETUPS[0]), self.run(client, SETUPS[1])
        if plain is None or kv is None:
            return {}
        return {k: ratio(k, plain.figures.get(k), kv.figures.get(k))
                for k in plain.figures if k != "requests"}

    def answers_equal(self, client: str) -> tuple[int, int] | None:
        plain, kv = self.run(client, SETUPS[0]), self.run(client, SETUPS[1])
        return None if plain is None or kv is None else equal_answers(plain.answers, kv.answers)

    def write_json(self, path: Path, command: str) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({
            "command": command, "plan": asdict(self.config.plan),
            "clients": {"multi-turn": str(MULTI_TURN_SCRIPT.relative_to(VENDOR)),
                        "long-doc-qa": str(LONG_DOC_QA_SCRIPT.relative_to(VENDOR))},
            "connector": dict(self.config.connector),
            "server_commands": list(self.server_commands), "wall_s": self.wall_s,
            "machine": self.machine,
            "runs": [asdict(r) for r in self.runs],
            "kvtier_vs_vllm": {c: self.ratios(c) for c in self.config.clients},
            "answers_equal": {c: self.answers_equal(c) for c in self.config.clients},
        }, indent=2, default=str) + "\n")


def run_clients_bench(config: ClientsConfig,
                      progress: Callable[[str], None] = lambda _: None) -> ClientsResult:
    """Generate (or reuse) the model, then per setup (vLLM, vLLM + kvtier) start a server
    and run each client against it, one after the other.

    Raises:
        kvtier.tools.ops.server.ServerError: a server did not start.
        ClientFailed: a client failed.
    Call from a thread with no running event loop; one server runs at a time, and it is
    stopped on every way out.
    """
    load_before, started = os.getloadavg(), time.perf_counter()
    plan, work = config.plan, config.work_dir
    progress("the embedded 'bench' model (generated once, cached)")
    model = make_preset_model("bench", config.model_root).resolve()  # clients run elsewhere
    name = served_name(model) or str(model)
    text_file = work / "corpus.txt"
    text_file.write_text(corpus_text(corpus_words(plan)))
    input_file = work / "multi_turn_input.json"
    input_file.write_text(json.dumps(multi_turn_input(plan, text_file), indent=2))
    runs: list[ClientFigures] = []
    commands: list[str] = []
    for setup, on in zip(SETUPS, (False, True)):
        serve = server_config(DEMO_PLANS[plan.demo_plan], model, on, work)
        if on and config.connector:
            serve = replace(serve, extra_config={**(serve.extra_config or {}),
                                                 **dict(config.connector)})
        command = build_command(serve)
        commands.append(command.display())
        tag = "kvtier" if on else "vllm"
        progress(f"{setup}: starting the server (~1 min)")
        with running_server(command, log_path=work / f"server-{tag}.log",
                            startup_timeout_s=600) as server:
            for client in config.clients:
                progress(f"{setup}: {client} running")
                runs.append(_run_one(client, setup, plan, server.url, model, name,
                                     work / tag / client, input_file))
    return ClientsResult(config, tuple(runs), tuple(commands),
                         time.perf_counter() - started, machine(load_before))


def _run_one(client: str, setup: str, plan: ClientsPlan, url: str, model: Path,
             name: str, cwd: Path, input_file: Path) -> ClientFigures:
    """Run `client` in `cwd` against the server at `url`; its figures, answers and the
    server's prefix-cache counters over the run."""
    before = _scrape(url)
    if client == MULTI_TURN:
        stats, convs = cwd / "stats.json", cwd / "conversations.json"
        out = run_client(multi_turn_argv(plan, model_dir=model, model_name=name, url=url,
                                         input_file=input_file,
                                         stats_file=stats, output_file=convs),
                         cwd, cwd.with_suffix(".log"), plan.client_timeout_s)
        figures = parse_multi_turn(out, json.loads(stats.read_text()))
        answers = multi_turn_answers(json.loads(convs.read_text()))
    else:
        assert client == LONG_DOC_QA, client
        responses = cwd / "responses.txt"
        out = run_client(long_doc_qa_argv(plan, model_name=name, url=url,
                                          responses_file=responses),
                         cwd, cwd.with_suffix(".log"), plan.client_timeout_s)
        figures = parse_long_doc_qa(out, (cwd / "query_round.csv").read_text())
        answers = long_doc_qa_answers(responses.read_text())
    after = _scrape(url)

    def delta(metric: str) -> float | None:
        if before is None or after is None or metric not in after:
            return None
        return after[metric] - before.get(metric, 0.0)

    def kvtier(name: str) -> float:
        """A kvtier counter's delta, summed over its labels (0 without kvtier)."""
        if before is None or after is None:
            return 0.0
        family = f"{PREFIX}{name}_total"
        return sum(value - before.get(key, 0.0) for key, value in after.items()
                   if key == family or key.startswith(family + "{"))

    return ClientFigures(client, setup, figures, answers,
                         prompt_tokens=delta("vllm:prompt_tokens_total"),
                         kvtier_hit_tokens=delta("vllm:external_prefix_cache_hits_total"),
                         engine_hit_tokens=delta("vllm:prefix_cache_hits_total"),
                         kvtier={name: kvtier(name) for name in KVTIER_COUNTERS})


def _scrape(url: str) -> dict[str, float] | None:
    """The server's /metrics, flattened (promdiff.parse_metrics); None when it does not answer."""
    try:
        with urllib.request.urlopen(f"{url}/metrics", timeout=10) as resp:
            return parse_metrics(resp.read().decode())
    except (OSError, ValueError):
        return None
