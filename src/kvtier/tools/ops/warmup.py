"""Warm-up: pre-load documents' or system prompts' KV into kvtier before traffic arrives.

Each prompt is sent to an OpenAI-compatible vLLM server running kvtier's connector as a
completion with `max_tokens=1`: vLLM prefills it, kvtier stores its chunks (pinned for
`retain_s`, expiring after `ttl_s`, under the tenant `cache_salt`, as asked through the
request's `kv_transfer_params`), and the next request sharing that prefix loads it instead of
recomputing. A prompt kvtier holds already is loaded, not stored again; its pin and expiry
are extended. What each prompt did comes from the response's `usage` and from kvtier's
counters on the server's /metrics (`vllm:kvtier_stored_tokens_total`, `..._loaded_tokens_total`),
read before and after it (prompts go one at a time, so the difference is the prompt's own
unless other traffic runs meanwhile).

Prompts come from text files (one prompt per file, its whole text) or JSONL files (one JSON
object per line: `{"prompt": "..."}` or `{"prompt_token_ids": [...]}`, optionally `"name"`
and a per-line `"cache_salt"`).

Primitives: `WarmPrompt`, `WarmSettings`, `WarmResult`, `load_prompts`, `warm`,
`WarmupError`.
"""

from __future__ import annotations

import http.client
import json
import re
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtier.errors import ConfigError, WarmupError

STORED = "vllm:kvtier_stored_tokens_total"
LOADED = "vllm:kvtier_loaded_tokens_total"
# vLLM records a step's connector stats just after it returns that step's outputs: a counter
# read right after the response may lag one step. Re-read until it moves, this many times.
METRIC_SETTLE_READS = 10
METRIC_SETTLE_S = 0.1


@dataclass(frozen=True, slots=True)
class WarmPrompt:
    """One prompt to warm."""

    name: str  # where it came from: a file name, or "file.jsonl:LINE"
    prompt: str | list[int]  # text, or token ids
    cache_salt: str | None = None  # its own tenant (JSONL "cache_salt"), else the run's

    def __repr__(self) -> str:  # a salt may be a secret
        return f"WarmPrompt(name={self.name!r})"


@dataclass(frozen=True, slots=True)
class WarmSettings:
    """Where and how to warm."""

    url: str  # server base URL, e.g. http://127.0.0.1:8000 (a trailing /v1 is accepted)
    model: str | None = None  # served model name; None: the server's first model
    retain_s: float | None = None  # pin the prompts' chunks this long (kv_transfer_params)
    ttl_s: float | None = None  # the prompts' chunks expire this long after being stored
    cache_salt: str | None = None  # the tenant of prompts that name none
    timeout_s: float = 600.0  # per request

    def __repr__(self) -> str:  # never the salt
        return (f"WarmSettings(url={self.url!r}, model={self.model!r}, "
                f"retain_s={self.retain_s}, ttl_s={self.ttl_s})")


@dataclass(frozen=True, slots=True)
class WarmResult:
    """What warming one prompt did."""

    name: str
    prompt_tokens: int | None  # from the response's usage (None: failed)
    stored_tokens: int | None  # kvtier's stored-token counter's rise (None: no /metrics)
    loaded_tokens: int | None  # kvtier's loaded-token counter's rise: held already
    seconds: float  # the request's wall time
    error: str | None = None  # one line, when the request failed

    @property
    def ok(self) -> bool:
        return self.error is None


def api_base(url: str) -> str:
    """`url` without a trailing "/" or "/v1".

    Raises:
        ConfigError: not an http(s) URL with a host.
    """
    parsed = urllib.parse.urlparse(url)
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise ConfigError("url", url, "an http:// or https:// URL, e.g. http://127.0.0.1:8000")
    base = url.rstrip("/")
    return base[: -len("/v1")] if base.endswith("/v1") else base


def load_prompts(texts: Sequence[Path] = (), jsonl: Sequence[Path] = ()) -> list[WarmPrompt]:
    """The prompts of text files (one each, the whole text) and JSONL files (one a line).

    Raises:
        ConfigError: a missing or unreadable file, an empty one, one named twice (its
            prompts were warmed twice), a line that is not a JSON object with a non-empty
            "prompt" (text) or "prompt_token_ids" (integers).
    """
    named: set[Path] = set()
    for path in [*texts, *jsonl]:
        if path.resolve() in named:
            raise ConfigError("prompt file", str(path), "each file named once (it is named "
                              "twice: its prompts would be warmed twice)")
        named.add(path.resolve())
    prompts: list[WarmPrompt] = []
    for path in texts:
        text = _read(path)
        if not text.strip():
            raise ConfigError("prompt file", str(path), "a file holding a prompt (it is empty)")
        prompts.append(WarmPrompt(path.name, text))
    for path in jsonl:
        lines = [(n, line) for n, line in enumerate(_read(path).splitlines(), 1) if line.strip()]
        if not lines:
            raise ConfigError("jsonl file", str(path), "one JSON object per line (it is empty)")
        prompts += [_jsonl_prompt(path, n, line) for n, line in lines]
    if not prompts:
        raise ConfigError("prompts", None, "at least one prompt file or --jsonl file")
    return prompts


def _read(path: Path) -> str:
    """The file's text. A UTF-8 byte order mark (Windows editors write one) is dropped: in a
    prompt it would be a token the users' requests do not start with, so the warmed prefix
    would never be hit; in a JSONL file it made the first line invalid JSON."""
    try:
        return path.read_text(encoding="utf-8-sig")
    except FileNotFoundError:
        raise ConfigError("prompt file", str(path), "an existing file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError("prompt file", str(path),
                          f"a readable UTF-8 file ({type(exc).__name__})") from None


def _jsonl_prompt(path: Path, line_no: int, line: str) -> WarmPrompt:
    where = f"{path}:{line_no}"
    try:
        item = json.loads(line)
    except ValueError:
        raise ConfigError("jsonl line", where, "a JSON object (not valid JSON)") from None
    if not isinstance(item, dict):
        raise ConfigError("jsonl line", where, "a JSON object")
    prompt: Any = item.get("prompt", item.get("prompt_token_ids"))
    valid_text = isinstance(prompt, str) and prompt.strip()
    valid_ids = (isinstance(prompt, list) and prompt
                 and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                         for t in prompt))
    if not (valid_text or valid_ids):
        raise ConfigError("jsonl line", where, 'an object with a non-empty "prompt" (text) or '
                          '"prompt_token_ids" (a list of token ids)')
    salt = item.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise ConfigError("jsonl line", where, '"cache_salt" as a non-empty string')
    name = item.get("name")
    return WarmPrompt(str(name) if name is not None else f"{path.name}:{line_no}", prompt, salt)


def warm(settings: WarmSettings, prompts: Sequence[WarmPrompt],
         on_result: Callable[[WarmResult], None] | None = None) -> list[WarmResult]:
    """Send each prompt (one at a time) as a `max_tokens=1` completion with the pin, expiry
    and tenant asked; one `WarmResult` each, in order (`on_result` is called as each ends).
    A prompt the server rejects is a failed result, not an exception.

    Raises:
        ConfigError: a bad URL.
        WarmupError: the server is unreachable or serves no model.
    """
    base = api_base(settings.url)
    model = settings.model or served_model(base, settings.timeout_s)
    params: dict[str, Any] = {}
    if settings.retain_s is not None:
        params["retain_s"] = settings.retain_s
    if settings.ttl_s is not None:
        params["ttl_s"] = settings.ttl_s
    results = []
    for prompt in prompts:
        result = _warm_one(base, model, prompt, params, settings)
        results.append(result)
        if on_result is not None:
            on_result(result)
    return results


def served_model(base: str, timeout_s: float) -> str:
    """The first model `base`/v1/models lists.

    Raises:
        WarmupError: unreachable, or no model listed.
    """
    reply = _get_json(base + "/v1/models", timeout_s)
    models = reply.get("data") if isinstance(reply, dict) else None
    if not isinstance(models, list) or not models or not isinstance(models[0], dict):
        raise WarmupError(f"{base}/v1/models lists no model: is this an OpenAI-compatible "
                          "vLLM server?")
    return str(models[0].get("id"))


def _warm_one(base: str, model: str, prompt: WarmPrompt, params: dict[str, Any],
              settings: WarmSettings) -> WarmResult:
    body: dict[str, Any] = {"model": model, "prompt": prompt.prompt, "max_tokens": 1,
                            "temperature": 0.0}
    if params:
        body["kv_transfer_params"] = params
    salt = prompt.cache_salt or settings.cache_salt
    if salt:
        body["cache_salt"] = salt
    before = _counters(base, settings.timeout_s)
    start = time.perf_counter()
    try:
        reply = _post_json(base + "/v1/completions", body, settings.timeout_s)
    except WarmupError as exc:
        return WarmResult(prompt.name, None, None, None, time.perf_counter() - start, str(exc))
    seconds = time.perf_counter() - start
    usage = reply.get("usage") if isinstance(reply, dict) else None
    prompt_tokens = usage.get("prompt_tokens") if isinstance(usage, dict) else None
    after = _settled_counters(base, settings.timeout_s, before)
    stored = loaded = None
    if before is not None and after is not None:
        stored = int(after[0] - before[0])
        loaded = int(after[1] - before[1])
    return WarmResult(prompt.name, prompt_tokens if isinstance(prompt_tokens, int) else None,
                      stored, loaded, seconds)


def _settled_counters(base: str, timeout_s: float, before: tuple[float, float] | None,
                      ) -> tuple[float, float] | None:
    """The counters after a prompt, read again while they have not moved (they may lag the
    response by a step; a prompt shorter than a chunk never moves them: the last read)."""
    after = _counters(base, timeout_s)
    for _ in range(METRIC_SETTLE_READS):
        if after is None or before is None or after != before:
            break
        time.sleep(METRIC_SETTLE_S)
        after = _counters(base, timeout_s)
    return after


def _counters(base: str, timeout_s: float) -> tuple[float, float] | None:
    """(stored tokens, loaded tokens) from /metrics, or None when /metrics is unreadable."""
    try:
        with urllib.request.urlopen(base + "/metrics", timeout=timeout_s) as response:
            text = response.read().decode()
    except (OSError, ValueError, http.client.HTTPException):
        return None
    return metric_total(text, STORED), metric_total(text, LOADED)


def metric_total(text: str, name: str) -> float:
    """A metric of a Prometheus text exposition, summed over its label sets (0: absent)."""
    pattern = re.compile(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.e+-]+)$", re.MULTILINE)
    return sum(float(v) for v in pattern.findall(text))


def _get_json(url: str, timeout_s: float) -> Any:
    return _request(urllib.request.Request(url), timeout_s)


def _post_json(url: str, body: dict[str, Any], timeout_s: float) -> Any:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    return _request(request, timeout_s)


def _request(request: urllib.request.Request, timeout_s: float) -> Any:
    """The decoded JSON reply.

    Raises:
        WarmupError: one line: the server's error message, unreachable, or not JSON.
    """
    url = request.full_url
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return json.loads(response.read().decode())
    except urllib.error.HTTPError as exc:
        raise WarmupError(f"{url}: HTTP {exc.code}: {_error_message(exc)}") from None
    except urllib.error.URLError as exc:
        raise WarmupError(f"{url}: server unreachable ({exc.reason})") from None
    except TimeoutError:
        raise WarmupError(f"{url}: no answer within {timeout_s:g} s") from None
    except http.client.HTTPException as exc:  # a server that does not speak HTTP, a cut body
        raise WarmupError(f"{url}: not an HTTP answer ({type(exc).__name__}: "
                          f"{_clip(str(exc))})") from None
    except (OSError, ValueError) as exc:
        raise WarmupError(f"{url}: {type(exc).__name__}: {exc}") from None


def _clip(text: str, limit: int = 120) -> str:
    """`text` on one line, at most `limit` characters."""
    line = " ".join(text.split())
    return line if len(line) <= limit else line[:limit - 3] + "..."


def _error_message(exc: urllib.error.HTTPError) -> str:
    """The server's own error message (vLLM: {"error": {"message": ...}}), one line."""
    try:
        body = json.loads(exc.read().decode())
        message = body.get("error", {}).get("message") or body.get("message") or body
    except (OSError, ValueError, AttributeError):
        message = exc.reason
    return " ".join(str(message).split())[:300]
