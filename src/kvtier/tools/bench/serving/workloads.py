"""Token-exact prompt generators for `kvtier bench <workload>` against a serving endpoint.

Prompts are lists of token ids drawn from a seeded RNG, sent as `prompt=[ids]` to an
OpenAI-compatible `/v1/completions` endpoint (vLLM accepts that), so the number of tokens
and the shared prefixes are exact whatever the server's tokenizer does with text.

A workload is an ordered list of `Turn`s grouped into *sessions*. Turns are dispatched in
that order; the order is round-robin over sessions (turn 0 of every session, then turn 1 of
every session, ...), so that between two turns of one session the server sees the other
sessions' traffic — what evicts a session from a small KV cache and makes a tiered cache pay.

  - `prefix_repetition`: N distinct shared prefixes; request i uses prefix i % N plus its own
    random suffix (like `vllm bench serve --dataset-name prefix_repetition`). Independent.
  - `multi_round`: U users, T turns each; turn k's prompt is turn k-1's prompt + turn k-1's
    answer + new user tokens (`Workload.chained`). Answers come from the server when it
    returns token ids (vLLM's `return_token_ids`), else `Turn.filler_answer` stands in.
  - `long_doc`: D long documents, Q questions each; prompt = document + question. Independent.

Primitives: `Turn`, `Workload`, `TokenRange`, `prefix_repetition`, `multi_round`, `long_doc`,
`next_prompt`, `WORKLOADS` (name -> generator).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvtier.errors import ConfigError


@dataclass(frozen=True, slots=True)
class TokenRange:
    """Token ids are drawn uniformly from [low, high)."""

    # First id drawn; skips the special ids (0..2 in kvtier's generated models).
    low: int = 3
    # One past the last id drawn; must not exceed the model's vocabulary size. 500 is valid
    # for kvtier's generated models (vocab 512 / 1024) and ordinary ids for real vocabularies.
    high: int = 500

    def __post_init__(self) -> None:
        if self.low < 0 or self.high <= self.low:
            raise ConfigError("token_ids", f"{self.low}:{self.high}",
                              "LOW:HIGH with 0 <= LOW < HIGH")

    @classmethod
    def parse(cls, text: str) -> TokenRange:
        """Parse "LOW:HIGH". Raises ConfigError."""
        low, _, high = text.partition(":")
        try:
            bounds = int(low), int(high)
        except ValueError:
            raise ConfigError("token_ids", text, "LOW:HIGH, two integers") from None
        return cls(*bounds)  # outside the try: its ConfigError is a ValueError too


@dataclass(frozen=True, slots=True)
class Turn:
    """One request of a workload."""

    # Which session (shared prefix, user, document) the request belongs to.
    session: int
    # Its index within the session: the turn (multi-round), question (long-doc) or repeat.
    turn: int
    # The whole prompt (independent workloads) or the new user tokens appended to the
    # history (chained workloads, see `next_prompt`).
    tokens: tuple[int, ...]
    # Tokens to generate (sent as max_tokens, with ignore_eos so that it is exact).
    max_tokens: int
    # Chained workloads: stands in for this turn's answer when the server returns no ids.
    filler_answer: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class Workload:
    """An ordered list of turns and how their prompts are formed."""

    name: str  # workload name, as on the command line
    turns: tuple[Turn, ...]  # in dispatch order
    chained: bool  # prompt = previous prompt + previous answer + turn.tokens
    params: dict[str, Any] = field(default_factory=dict)  # the sizes it was built with

    def limit(self, max_requests: int | None) -> Workload:
        """The first `max_requests` turns (all when None)."""
        if max_requests is None or max_requests >= len(self.turns):
            return self
        return Workload(self.name, self.turns[:max_requests], self.chained, self.params)

    def max_prompt_tokens(self) -> int:
        """An upper bound of the longest prompt (answers at their full max_tokens)."""
        if not self.chained:
            return max((len(t.tokens) for t in self.turns), default=0)
        # Each turn adds its tokens and, for the turns after it, its answer.
        length: dict[int, int] = {}
        last_answer: dict[int, int] = {}
        for t in self.turns:
            length[t.session] = length.get(t.session, 0) + len(t.tokens) + t.max_tokens
            last_answer[t.session] = t.max_tokens
        return max((n - last_answer[s] for s, n in length.items()), default=0)

    def static_prompts(self) -> list[tuple[int, ...]]:
        """Every prompt, with filler answers in the history (what is sent when the server
        returns no token ids); in dispatch order."""
        prompts: list[tuple[int, ...]] = []
        history: dict[int, tuple[tuple[int, ...], tuple[int, ...]]] = {}
        for t in self.turns:
            prev = history.get(t.session) if self.chained else None
            prompt = next_prompt(t, prev[0], prev[1]) if prev else t.tokens
            history[t.session] = (prompt, t.filler_answer)
            prompts.append(prompt)
        return prompts


def next_prompt(turn: Turn, prev_prompt: Sequence[int],
                prev_answer: Sequence[int]) -> tuple[int, ...]:
    """The prompt of a chained turn: the previous prompt, its answer, then the new tokens."""
    return (*prev_prompt, *prev_answer, *turn.tokens)


def prefix_repetition(*, num_prefixes: int = 4, prefix_len: int = 512, suffix_len: int = 64,
                      output_len: int = 16, num_requests: int = 32, seed: int = 0,
                      token_ids: TokenRange = TokenRange()) -> Workload:
    """N shared prefixes; request i = prefix number (i mod N) + its own suffix.

    Raises:
        ConfigError: a size below its minimum.
    """
    _check(num_prefixes=(num_prefixes, 1), prefix_len=(prefix_len, 0), suffix_len=(suffix_len, 1),
           output_len=(output_len, 1), num_requests=(num_requests, 1))
    rng = random.Random(seed)
    prefixes = [_draw(rng, prefix_len, token_ids) for _ in range(num_prefixes)]
    turns = tuple(
        Turn(session=i % num_prefixes, turn=i // num_prefixes,
             tokens=prefixes[i % num_prefixes] + _draw(rng, suffix_len, token_ids),
             max_tokens=output_len)
        for i in range(num_requests))
    return Workload("prefix-repetition", turns, chained=False, params={
        "num_prefixes": num_prefixes, "prefix_len": prefix_len, "suffix_len": suffix_len,
        "output_len": output_len, "num_requests": num_requests, "seed": seed})


def multi_round(*, users: int = 8, turns: int = 4, first_len: int = 256, user_len: int = 64,
                output_len: int = 32, seed: int = 0,
                token_ids: TokenRange = TokenRange()) -> Workload:
    """U users, T turns each; every turn the history grows by the answer and user_len tokens.

    Turn 0 of a user sends `first_len` tokens (system prompt and first message, unique to the
    user); turn k > 0 sends the whole history plus `user_len` new tokens.

    Raises:
        ConfigError: a size below its minimum.
    """
    _check(users=(users, 1), turns=(turns, 1), first_len=(first_len, 1), user_len=(user_len, 1),
           output_len=(output_len, 1))
    rng = random.Random(seed)
    # Drawn user by user, so that a user's tokens do not depend on how many users there are.
    per_user = [[Turn(session=u, turn=k, tokens=_draw(rng, first_len if k == 0 else user_len,
                                                      token_ids),
                      max_tokens=output_len, filler_answer=_draw(rng, output_len, token_ids))
                 for k in range(turns)] for u in range(users)]
    ordered = tuple(per_user[u][k] for k in range(turns) for u in range(users))
    return Workload("multi-round", ordered, chained=True, params={
        "users": users, "turns": turns, "first_len": first_len, "user_len": user_len,
        "output_len": output_len, "seed": seed})


def long_doc(*, docs: int = 4, doc_len: int = 1024, questions: int = 4, question_len: int = 32,
             output_len: int = 16, seed: int = 0,
             token_ids: TokenRange = TokenRange()) -> Workload:
    """D documents, Q questions each; question q of every document, then question q+1.

    Raises:
        ConfigError: a size below its minimum.
    """
    _check(docs=(docs, 1), doc_len=(doc_len, 1), questions=(questions, 1),
           question_len=(question_len, 1), output_len=(output_len, 1))
    rng = random.Random(seed)
    documents = [_draw(rng, doc_len, token_ids) for _ in range(docs)]
    asks = [[_draw(rng, question_len, token_ids) for _ in range(questions)] for _ in range(docs)]
    ordered = tuple(Turn(session=d, turn=q, tokens=documents[d] + asks[d][q], max_tokens=output_len)
                    for q in range(questions) for d in range(docs))
    return Workload("long-doc", ordered, chained=False, params={
        "docs": docs, "doc_len": doc_len, "questions": questions, "question_len": question_len,
        "output_len": output_len, "seed": seed})


# name on the command line -> generator (keyword arguments only).
WORKLOADS: dict[str, Callable[..., Workload]] = {
    "prefix-repetition": prefix_repetition,
    "multi-round": multi_round,
    "long-doc": long_doc,
}


def _draw(rng: random.Random, n: int, ids: TokenRange) -> tuple[int, ...]:
    return tuple(rng.randrange(ids.low, ids.high) for _ in range(n))


def _check(**sizes: tuple[int, int]) -> None:
    for name, (value, minimum) in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ConfigError(name, value, f"an integer >= {minimum}")
