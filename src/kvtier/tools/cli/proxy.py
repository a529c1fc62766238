"""`kvtier proxy --prefill URL --decode URL`: the disaggregated-prefill proxy in front of a
kv_producer and a kv_consumer vLLM instance sharing a kvtier tier (kvtier/tools/ops/disagg_proxy.py,
docs/sharing.md).

Exit codes: 0 stopped, 2 bad input (a port in use or an address not of this machine
included).
"""

from __future__ import annotations

import argparse
import errno

from kvtier.errors import ConfigError
from kvtier.tools.cli.argtypes import http_url, listen_host, port_number, positive_float
from kvtier.tools.ops.disagg_proxy import ProxyConfig, run_proxy


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "proxy", help="disaggregated prefill: one OpenAI front over a prefill (kv_producer) "
                      "and a decode (kv_consumer) instance")
    p.add_argument("--prefill", required=True, type=http_url,
                   help="prefill instance base URL, e.g. http://127.0.0.1:8100")
    p.add_argument("--decode", required=True, type=http_url,
                   help="decode instance base URL")
    p.add_argument("--host", type=listen_host, default="127.0.0.1",
                   help="listen address (default 127.0.0.1)")
    p.add_argument("--port", type=port_number, default=8000, help="listen port (default 8000)")
    p.add_argument("--request-timeout", type=positive_float, default=600.0, metavar="S",
                   help="one upstream request's limit in seconds (default 600)")
    p.add_argument("--prefill-timeout", type=positive_float, default=60.0, metavar="S",
                   help="a prefill's limit in seconds, at most --request-timeout; past it "
                        "the decode instance computes the prompt itself (default 60)")
    p.set_defaults(func=run)


# Bind failures that are the user's choice of --host / --port, not a bug.
_BIND_ERRORS = {errno.EADDRINUSE: ("--port", "a port no other process listens on"),
                errno.EACCES: ("--port", "a port this user may bind (>= 1024 unprivileged)"),
                errno.EADDRNOTAVAIL: ("--host", "an address of this machine, or 0.0.0.0")}


def run(args: argparse.Namespace) -> int:
    if args.prefill_timeout > args.request_timeout:
        raise ConfigError("--prefill-timeout", args.prefill_timeout,
                          f"at most --request-timeout ({args.request_timeout:g} s)")
    try:
        run_proxy(ProxyConfig(prefill_url=args.prefill.rstrip("/"),
                              decode_url=args.decode.rstrip("/"), host=args.host,
                              port=args.port, request_timeout_s=args.request_timeout,
                              prefill_timeout_s=args.prefill_timeout))
    except OSError as exc:  # binding: one line, not a traceback
        if exc.errno not in _BIND_ERRORS:
            raise
        field, allowed = _BIND_ERRORS[exc.errno]
        value = args.port if field == "--port" else args.host
        raise ConfigError(field, value, f"{allowed} ({exc.strerror or exc})") from None
    return 0
