#!/usr/bin/env bash
# The README's first command: set everything up, then run kvtier's main job on its defaults.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec kvtier bench storage --quick "$@"  # ~10-20 s; drop --quick for the full run
