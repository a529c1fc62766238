"""Text that comes from outside kvtier's code (a model name read from a tier's manifest, an
error message, an argument) shown in a rich table or line as it is: never read as rich
markup (a model named "llama-3[fp8]" lost its "[fp8]", one named "[/]" crashed the command)
and its control characters escaped (an ANSI sequence in a manifest never reaches the
terminal raw).

Primitives: `literal`.
"""

from __future__ import annotations

from rich.text import Text


def literal(value: str, style: str = "") -> Text:
    """`value` as rich shows it literally, control characters as Python escapes them."""
    return Text("".join(c if c.isprintable() else repr(c)[1:-1] for c in value), style=style)
