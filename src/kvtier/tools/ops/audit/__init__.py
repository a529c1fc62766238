"""`kvtier audit`: find the known pitfalls in a `vllm serve` deployment.

Primitives (re-exported): `Finding`, `Severity`, `ServeCommand`, `load_deployment`,
`parse_command_line`, `parse_argv`, `parse_kubernetes`, `AuditOptions`, `run_audit`,
`all_rules`. Rules live one module per topic (rules_*.py), one function per rule, registered
with `@rule` in registry.py.
"""

from kvtier.tools.ops.audit.command import (
    ServeCommand,
    load_deployment,
    parse_argv,
    parse_command_line,
    parse_kubernetes,
)
from kvtier.tools.ops.audit.finding import Finding, Severity
from kvtier.tools.ops.audit.registry import AuditOptions, all_rules, run_audit

__all__ = [
    "AuditOptions", "Finding", "ServeCommand", "Severity", "all_rules", "load_deployment",
    "parse_argv", "parse_command_line", "parse_kubernetes", "run_audit",
]
