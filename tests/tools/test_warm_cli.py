"""`kvtier warm`: bad input and an unusable server are one line and an exit status, never a
traceback (the real warm-up through a vLLM server is tests/engine/test_warmup_e2e.py)."""

from __future__ import annotations

import contextlib
import socket
import threading
from pathlib import Path

import pytest

from kvtier.tools.cli.main import main
from kvtier.tools.ops.warmup import WarmPrompt, load_prompts


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])  # closed once the block exits: nothing listens


def run(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """`kvtier warm ARGS`: its exit status and stderr, less the usage block argparse prints
    above its own one-line error."""
    try:
        code = main(["warm", *args])
    except SystemExit as refused:  # argparse refused an argument
        code = int(refused.code or 0)
    err = capsys.readouterr().err.strip()
    if err.startswith("usage:"):
        err = err[err.index("kvtier warm: error:"):]
    return code, err


def test_bad_input_is_one_line_naming_what_is_wrong(tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    prompt = tmp_path / "p.txt"
    prompt.write_text("a system prompt")
    url = f"http://127.0.0.1:{closed_port()}"
    bad_json = tmp_path / "bad.jsonl"
    bad_json.write_text('{"prompt": "ok"}\n{"prompt": 3}\n')
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    cases = [
        ([url, str(tmp_path / "missing.txt")], 2, "an existing file"),
        (["not-a-url", str(prompt)], 2, "argument url: 'not-a-url' is not a http or https URL"),
        ([url, "--jsonl", str(bad_json)], 2, "bad.jsonl:2"),
        ([url, str(empty)], 2, "it is empty"),
        ([url], 2, "at least one prompt"),
        ([url, "--jsonl", str(bad_json), "--jsonl", str(tmp_path / "." / "bad.jsonl")], 2,
         "it is named twice"),
        ([url, str(prompt), str(prompt)], 2, "it is named twice"),
        ([url, str(prompt), "--cache-salt-env", "KVTIER_NO_SUCH_VAR"], 2, "environment"),
        ([url, str(prompt)], 1, "server unreachable"),
        # the engine ignores a retain_s or ttl_s of 1e9 s or more (logged there): the prompts
        # were stored unpinned while warm reported the pin it sent
        ([url, str(prompt), "--retain-s", "1e9"], 2, "argument --retain-s: '1e9': below"),
        ([url, str(prompt), "--ttl-s", "99999999999"], 2, "argument --ttl-s"),
    ]
    for args, status, message in cases:
        code, err = run(args, capsys)
        assert (code, len(err.splitlines())) == (status, 1), (args, err)
        assert message in err and "Traceback" not in err, (args, err)



def test_an_empty_salt_or_model_and_two_salts_are_refused(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """`--cache-salt "$SALT"` with the variable unset warmed the prompts with no salt, outside
    the tenant, and said nothing (a JSONL line's empty "cache_salt" and an empty
    --cache-salt-env variable were refused); `--model "$MODEL"` unset warmed the server's
    first model; --cache-salt beside --cache-salt-env was dropped. Each is refused before any
    request (nothing listens at the URL: a request would fail with status 1)."""
    prompt = tmp_path / "p.txt"
    prompt.write_text("a system prompt")
    url = f"http://127.0.0.1:{closed_port()}"
    monkeypatch.setenv("KVTIER_TEST_SALT", "tenant-a")
    cases = [
        ([url, str(prompt), "--cache-salt", ""], "--cache-salt"),
        ([url, str(prompt), "--model", ""], "--model"),
        ([url, str(prompt), "--model", " "], "--model"),
        ([url, str(prompt), "--cache-salt", "x", "--cache-salt-env", "KVTIER_TEST_SALT"],
         "--cache-salt"),
    ]
    for args, option in cases:
        code, err = run(args, capsys)
        assert (code, len(err.splitlines())) == (2, 1), (args, err)
        assert option in err and "server unreachable" not in err, (args, err)


def test_prompts_from_text_and_jsonl_files(tmp_path: Path) -> None:
    (tmp_path / "doc.txt").write_text("a document\nof two lines\n")
    (tmp_path / "p.jsonl").write_text('{"prompt": "first"}\n\n'
                                      '{"name": "ids", "prompt_token_ids": [5, 6, 7], '
                                      '"cache_salt": "tenant-9"}\n')
    prompts = load_prompts([tmp_path / "doc.txt"], [tmp_path / "p.jsonl"])
    assert prompts == [WarmPrompt("doc.txt", "a document\nof two lines\n"),
                       WarmPrompt("p.jsonl:1", "first"),
                       WarmPrompt("ids", [5, 6, 7], "tenant-9")]
    assert "tenant-9" not in repr(prompts)


def test_a_byte_order_mark_is_not_part_of_the_prompt(tmp_path: Path) -> None:
    """Windows editors start UTF-8 files with a BOM: kept, it became the prompt's first token
    (a prefix no user request has: the warm-up was never hit) and made a JSONL's first line
    invalid JSON."""
    (tmp_path / "doc.txt").write_bytes("\ufeffa handbook".encode())
    (tmp_path / "p.jsonl").write_bytes('\ufeff{"prompt": "first"}\n'.encode())
    assert load_prompts([tmp_path / "doc.txt"], [tmp_path / "p.jsonl"]) == [
        WarmPrompt("doc.txt", "a handbook"), WarmPrompt("p.jsonl:1", "first")]


def read_request(conn: socket.socket) -> bytes:
    """One HTTP request off `conn`, its head and its Content-Length body."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(65536)
        if not chunk:
            return data
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                   if line.lower().startswith(b"content-length:")), 0)
    while len(body) < length:
        chunk = conn.recv(65536)
        if not chunk:
            break
        body += chunk
    return head + b"\r\n\r\n" + body


@pytest.mark.parametrize("reply", [
    b"-ERR unknown command\r\n",  # not HTTP (a Redis port, say)
    b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n{\"data\":",  # a body cut short
])
def test_a_server_that_does_not_answer_http_is_one_line_and_status_1(
        reply: bytes, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    prompt = tmp_path / "p.txt"
    prompt.write_text("a system prompt")
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    listener.settimeout(0.1)  # the accept loop looks at `done` this often
    port = listener.getsockname()[1]
    done = threading.Event()

    def answer() -> None:
        while not done.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            with conn, contextlib.suppress(OSError):
                conn.settimeout(10)
                read_request(conn)  # whole: a close with unread bytes resets the connection
                conn.sendall(reply)
                conn.shutdown(socket.SHUT_WR)

    thread = threading.Thread(target=answer, daemon=True)
    thread.start()
    try:
        for args in ([], ["--model", "m"]):  # /v1/models, then /v1/completions
            code, err = run([f"http://127.0.0.1:{port}", str(prompt), *args], capsys)
            assert code == 1 and "not an HTTP answer" in err and "Traceback" not in err, err
            assert len(err.splitlines()) == 1, err
    finally:
        done.set()
        thread.join(timeout=10)
        listener.close()


def test_files_may_come_before_or_after_the_options(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`kvtier warm URL --model m FILE` was refused as "unrecognized arguments" (argparse
    filled `files` with nothing before the options); every order now reaches the server,
    which is down here (status 1), and an unknown option is still refused."""
    first, second = tmp_path / "a.txt", tmp_path / "b.txt"
    first.write_text("a system prompt")
    second.write_text("another system prompt")
    url = f"http://127.0.0.1:{closed_port()}"
    orders = [
        [url, str(first), "--model", "m", str(second)],
        [url, "--model", "m", str(first), str(second)],
        ["--model", "m", url, str(first), "--timeout-s", "5", str(second)],
        [url, "--jsonl", str(tmp_path / "c.jsonl"), str(first)],
    ]
    (tmp_path / "c.jsonl").write_text('{"prompt": "third"}\n')
    for args in orders:
        code, err = run(args, capsys)
        assert (code, "server unreachable" in err) == (1, True), (args, err)
    with pytest.raises(SystemExit) as refused:
        main(["warm", url, "--model", "m", str(first), "--no-such-flag"])
    assert refused.value.code == 2
    assert "unrecognized arguments: --no-such-flag" in capsys.readouterr().err
    assert main(["-v", "warm", url, "--model", "m", str(first)]) == 1
