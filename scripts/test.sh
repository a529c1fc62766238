#!/usr/bin/env bash
# The README's test command: set everything up, then run the whole test suite.
#
# With no arguments the suite runs as two pytest processes side by side, which together run
# every test once: the tests that start real vLLM engines (`-m vllm`, one engine at a time as
# before, in this terminal) and all the others (`-m "not vllm"`, printed when both are done).
# An engine start is vLLM's processes importing vLLM one after the other, on one core (see
# tests/engine/vllm_harness.py): the engine half leaves the second core of a 2-core machine
# mostly idle, and the other half uses it. It fails if either half fails.
# Each half ends with its slowest tests (--durations): where CI's time goes.
# With arguments, one pytest process runs them as given.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
if [ "$#" -gt 0 ]; then
  exec python3 -m pytest "$@"
fi

others_log=$(mktemp -t kvtier-tests-not-vllm.XXXXXX.log)
echo "tests without a vLLM engine: running alongside, output in $others_log (printed at the end)"
# No cache plugin there: two sessions would overwrite each other's record of failed tests.
python3 -m pytest -m "not vllm" -p no:cacheprovider --durations=15 >"$others_log" 2>&1 &
others=$!
trap 'kill "$others" 2>/dev/null || true' INT TERM
engine_status=0
python3 -m pytest -m vllm --durations=40 || engine_status=$?
others_status=0
wait "$others" || others_status=$?
echo
echo "==== tests without a vLLM engine (-m 'not vllm'), run alongside: exit $others_status ===="
cat "$others_log"
rm -f "$others_log"
if [ "$engine_status" -ne 0 ]; then
  exit "$engine_status"
fi
exit "$others_status"
