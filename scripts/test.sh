#!/usr/bin/env bash
# The README's test command: set everything up, then run the whole test suite.
#
# With no arguments the suite runs as two lanes side by side, which together run every test
# once. The first, in this terminal, runs the tests that start real vLLM engines (`-m vllm`,
# one engine at a time), but those marked `beside`. An engine start is vLLM's processes
# importing vLLM one after the other, on one core (see tests/engine/vllm_harness.py), so the
# first lane leaves the second core of a 2-core machine mostly idle: the second lane runs all
# the other tests (`-m "not vllm"`), then the engine tests that have no timing premise (`-m
# beside`: outputs and counters only), beside the first lane's engines; its output is printed
# when both are done. It fails if either lane fails.
# Each run ends with its slowest tests (--durations): where CI's time goes.
# With arguments, one pytest process runs them as given.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
if [ "$#" -gt 0 ]; then
  exec python3 -m pytest "$@"
fi

others_log=$(mktemp -t kvtier-tests-second-lane.XXXXXX.log)
echo "second lane (tests without an engine, then engine tests marked beside): running" \
  "alongside, output in $others_log (printed at the end)"
# No cache plugin there: two sessions would overwrite each other's record of failed tests.
second_lane() {
  local status=0
  python3 -m pytest -m "not vllm" -p no:cacheprovider --durations=15 || status=$?
  python3 -m pytest -m "vllm and beside" -p no:cacheprovider --durations=10 || status=$?
  return "$status"
}
second_lane >"$others_log" 2>&1 &
others=$!
trap 'kill "$others" 2>/dev/null || true' INT TERM
engine_status=0
python3 -m pytest -m "vllm and not beside" --durations=40 || engine_status=$?
others_status=0
wait "$others" || others_status=$?
echo
echo "==== second lane (-m 'not vllm', then -m 'vllm and beside'), run alongside:" \
  "exit $others_status ===="
cat "$others_log"
rm -f "$others_log"
if [ "$engine_status" -ne 0 ]; then
  exit "$engine_status"
fi
exit "$others_status"
