"""The CA bundle a remote tier's config names (`tls_ca_file` of the redis and s3 tiers),
checked when the tier is built.

Why: the TLS libraries read it only when a connection opens, on a worker's thread, and a
wrong path then reads as the server being down: redis-py's "Error 2 connecting to host:port.
No such file or directory." marked the server unavailable, retried for ever.

Primitives: `check_ca_file`.
"""

from __future__ import annotations

import ssl
from pathlib import Path

from kvtier.errors import ConfigError


def check_ca_file(path: Path | None) -> None:
    """Load `path` as the CA certificates a TLS client verifies against (None: the system's).

    Raises:
        ConfigError: on field `tls_ca_file`: the file is unreadable, or holds no PEM
            certificate.
    """
    if path is None:
        return
    try:
        ssl.create_default_context(cafile=str(path))
    except OSError as exc:  # ssl.SSLError is an OSError: no certificate in it
        reason = exc.strerror or "no PEM certificate in it"
        raise ConfigError("tls_ca_file", str(path),
                          f"a readable file of PEM CA certificates ({reason})") from None
