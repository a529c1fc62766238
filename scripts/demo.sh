#!/usr/bin/env bash
# The README's first command: set everything up, then see kvtier make returning conversations
# fast: `kvtier demo` serves a generated model with vLLM without and with kvtier and compares.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec kvtier demo "$@"  # ~3-4 min on 2 CPU cores (--quick: ~2 min); results in results/demo/
