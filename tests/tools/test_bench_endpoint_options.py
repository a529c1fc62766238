"""`kvtier bench multi-round|prefix-repetition|long-doc`: options that would be dropped are
refused before any request. `--url` beside `--compare URL_A URL_B` was ignored (the run went
to the two compared endpoints, the report naming neither as the --url given); an empty
`--model` (`--model "$MODEL"`, the variable unset) sent the server's first model instead.
Nothing listens at the URLs: a command that got as far as a request fails naming the URL."""

from __future__ import annotations

import socket

import pytest

from kvtier.tools.cli.main import main


def closed_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"  # nothing listens once closed


@pytest.mark.parametrize(("workload", "options", "refused"), [
    ("multi-round", ["--url", "U", "--compare", "U", "U"], "--url"),
    ("long-doc", ["--compare", "U", "U", "--url", "U"], "--url"),
    ("prefix-repetition", ["--url", "U", "--model", ""], "--model"),
    ("multi-round", ["--model", " "], "--model"),
])
def test_an_option_the_run_would_drop_is_refused(workload: str, options: list[str],
                                                 refused: str,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    url = closed_url()
    argv = ["bench", workload, *(url if word == "U" else word for word in options)]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"invalid config {refused}=" in err, err
