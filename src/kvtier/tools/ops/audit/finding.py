"""What an audit rule reports.

Primitives: `Severity`, `Finding`.
"""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass
from typing import Any


class Severity(enum.IntEnum):
    """How bad a finding is; `ERROR` makes `kvtier audit` exit non-zero."""

    INFO = 0
    WARNING = 1
    ERROR = 2

    def __str__(self) -> str:
        return self.name.lower()


@dataclass(frozen=True, slots=True)
class Finding:
    """One problem in a `vllm serve` deployment."""

    rule: str  # id of the rule that found it, e.g. "offload-needs-hma-flag"
    severity: Severity
    what: str  # what is wrong, in the operator's terms (flags, values)
    why: str  # why it matters: the failure or cost it causes
    fix: str  # what to change

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (severity as its lowercase name)."""
        out = asdict(self)
        out["severity"] = str(self.severity)
        return out
