#!/usr/bin/env bash
# The README's test command: set everything up, then run the whole test suite as CI does.
#
# With no arguments every test runs once, in two phases, each keeping both cores of a 2-core
# machine busy:
#   1. the tests that start real vLLM engines, the slow ones and the node's (`-m "(vllm or
#      slow or node) and not timing"`; engines mostly in the test's own process, see
#      tests/engine/vllm_harness.start_engine; slow: vLLM servers, whole commands,
#      simulations; node: tests/node, `kvtier node` processes, ~140 s of a core, here so that
#      the rest below takes about as long as the timing lane) in two pytest-xdist workers, a
#      module to a worker at a time (`--dist loadfile`: a module's engine is started once);
#      the workers take the next module as they are free, so no hand-kept split balances
#      them, the modules with a slow test first (tests/conftest.py; `--no-loadscope-reorder`
#      keeps that order);
#   2. the tests that assert a wall-clock bound (`-m timing`: a deadline met, a call back
#      within N seconds), with the rest (`-m "not vllm and not slow and not node and not
#      timing"`: the cache, tiers, connector, tools) beside them, their output printed when
#      both are done. The timing tests' bounds sit 3-10x above what they measure on a core of
#      their own; an engine lane beside them would leave them none, the rest (one Python
#      thread, mostly) leaves them one. As a 2-core machine is shared with its host's other
#      tenants, a timing test that fails runs once more (pytest-rerunfailures, as CPython's CI
#      reruns its failures): a bound missed twice fails the suite; a rerun is printed
#      ("RERUN").
# Under KVTIER_TEST_STRICT=1 (set here) a test skipped for want of something on the machine
# (redis-server, prometheus, a tmpfs mount...) fails instead: scripts/setup.sh installs them
# all (tests/conftest.py lists the skips that stay skips: CUDA, real S3 endpoints).
# Each run ends with its slowest tests (--durations); the suite ends with each lane's time and
# what was skipped, and why. It fails if any lane fails.
# With arguments, one pytest process runs them as given.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export KVTIER_TEST_STRICT="${KVTIER_TEST_STRICT:-1}"
# Bytecode written once, read by every later process: a machine that sets
# PYTHONDONTWRITEBYTECODE compiled kvtier's sources (an editable install) again in each pytest
# lane, server and engine process, and pytest rewrote every test module's asserts again in
# each lane (~10 s of a lane's collection on 2 cores). __pycache__ is ignored by git.
unset PYTHONDONTWRITEBYTECODE
if [ "$#" -gt 0 ]; then
  exec python3 -m pytest "$@"
fi

logs=$(mktemp -d -t kvtier-tests.XXXXXX)
trap 'rm -rf "$logs"' EXIT
# No cache plugin: sessions side by side would overwrite each other's record of failed tests.
# Each lane's summary (-ra, pyproject.toml) names its failures and its skips with their reasons.
lane() {  # lane NAME PYTEST-ARGS...: pytest, its output kept in $logs/NAME.log (and shown
  # as it comes unless QUIET=1), its exit status and time in $logs/NAME.result
  local name=$1 began=$SECONDS status=0
  shift
  if [ "${QUIET:-0}" = 1 ]; then
    python3 -m pytest -p no:cacheprovider "$@" >"$logs/$name.log" 2>&1 || status=$?
  else
    python3 -m pytest -p no:cacheprovider "$@" 2>&1 | tee "$logs/$name.log" || status=$?
  fi
  echo "$name: exit $status, $((SECONDS - began)) s" >"$logs/$name.result"
  return "$status"
}

echo "phase 1: the engine, slow and node tests (-m '(vllm or slow or node) and not timing')," \
  "two workers (pytest-xdist)"
engines_status=0
lane engines -m "(vllm or slow or node) and not timing" -n 2 --dist loadfile \
  --no-loadscope-reorder --durations=25 || engines_status=$?

echo
echo "phase 2: the tests that assert wall-clock bounds (-m timing) here; alongside, the rest" \
  "(-m 'not vllm and not slow and not node and not timing', printed after)"
QUIET=1 lane rest -m "not vllm and not slow and not node and not timing" --durations=15 &
rest=$!
trap 'kill "$rest" 2>/dev/null || true; rm -rf "$logs"' EXIT
trap 'exit 130' INT TERM
timing_status=0
lane timing -m timing --reruns 1 -raR --durations=15 || timing_status=$?
rest_status=0
wait "$rest" || rest_status=$?
echo
echo "==== run alongside: $(cat "$logs/rest.result") ===="
cat "$logs/rest.log"

echo
echo "==== skipped, and why (all lanes) ===="
grep -h '^SKIPPED' "$logs"/*.log || echo "(none)"
echo
echo "==== timing tests run twice (a bound missed once, met the second time) ===="
grep -h '^RERUN' "$logs"/timing.log || echo "(none)"
echo
echo "==== lanes ===="
cat "$logs/engines.result" "$logs/timing.result" "$logs/rest.result"
for status in "$engines_status" "$timing_status" "$rest_status"; do
  if [ "$status" -ne 0 ]; then
    exit "$status"
  fi
done
