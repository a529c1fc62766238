#!/usr/bin/env bash
# The GPU run-book of issues 23 and 47 in one command (docs/performance.md, "GPU run-book").
#
# For a machine with an NVIDIA GPU and a CUDA build of PyTorch, without vLLM, reaching nothing
# but the package registry. It
#   1. checks the GPU: nvidia-smi, then torch.cuda.is_available();
#   2. installs kvtier without its dependencies (pip install --no-deps -e .) and then the
#      dependencies pyproject.toml names (not openai: a bench client's), plus pytest and its
#      plugins; never torch or vllm
#      (the torch in place is checked to be the same afterwards); with --wheels, offline:
#      from that folder of wheels (scripts/gpu-wheels.sh fetches them) and what is installed,
#      kvtier itself from src/;
#   3. runs the device tests: pytest tests/gpu tests/connector/test_stream_mover.py
#      tests/connector/test_stream_mover_batches.py (the mover a chunk at a time and in batches;
#      a CUDA test that skips on this machine counts as a failure); then, printing its figures,
#      tests/gpu/test_cuda_batches.py's node-slab test: a kvtier node's shared-memory RAM slab
#      registered for DMA (cudaHostRegister) against a pinned in-process slab;
#   4. measures the copy path: kvtier bench copy --device cuda --chunk-mib ... (1-32 MiB
#      chunks, load = host -> device, store = device -> host, each against a raw pinned copy),
#      in bf16 LBNHC, fp8 LBNHC, bf16 BLHNC (2-32 MiB: a 32-layer bf16 block is 2 MiB) and a
#      16-layer bf16 LBNHC model (1-32 MiB);
#   5. writes everything under the results directory ($OUT where it is set, as on a lent
#      device machine, else gpu-results/; kept out of git with its own .gitignore) and prints
#      a summary: PASS/FAIL per chunk size against the 0.8x target (1 MiB: reported, not
#      judged), the runner's blocked time per step of stores, and the node slab's copy speeds.
#
# Steps 2-4 run within --budget-s seconds in all (default 480: a lent GPU's 15 minutes hold
# the machine's start, one run and a rerun of the summary; a full run took ~100 s on an H200):
# each step gets what is left (`timeout`), one that runs out is killed and counts as failed,
# and the steps after it are not run; the summary names them (timed-out.txt).
#
# --standin runs the same steps on a machine without a GPU, on the stand-in device where a
# step has one, so that the run-book is known to work before a GPU is lent: no GPU check and
# no install, the same tests (the CUDA ones skip), the same bench runs with --device cpu
# --quick, and `kvtier bench mover --quick` (the device mover on the stand-in); no target is
# judged (exit 0: every step ran, every test passed, every byte verified).
#
# Usage: bash scripts/gpu-check.sh [--results DIR] [--python PY] [--no-install] [--wheels DIR]
#                                  [--quick] [--dry-run] [--summary-only] [--budget-s S]
#                                  [--standin] [--tests "PATH ..."]
#   --results DIR   where the results go (default $OUT where set, else gpu-results)
#   --python PY     the Python with the CUDA build of torch (default $PYTHON, else python3)
#   --no-install    use the environment as it is (kvtier and its dependencies installed)
#   --wheels DIR    install offline (a GPU machine that reaches no registry): the missing
#                   dependencies from the wheels in DIR; kvtier is not built (nothing to
#                   build it with there) but run from src/ (PYTHONPATH)
#   --quick         2 trials and 32 blocks per bench run instead of 5 and 512
#   --dry-run       print the steps, run nothing
#   --summary-only  only step 5, over the results a run left in DIR
#   --budget-s S    seconds for steps 2-4 in all (default 480; see above)
#   --standin       no GPU: the steps on the CPU stand-in (see above)
#   --tests "PATH ..."  step 3 runs these pytest paths instead (a rerun of the one that
#                   failed, within a lease; the suite's test of the run-book, whose device
#                   tests the suite runs anyway)
#
# Exit status: 0 tests passed and the target met at every chunk size; 1 a test failed, a
# bench run failed, a step ran out of the budget or loaded bytes differ; 2 no usable GPU (or
# bad arguments); 3 all correct, but below the target at some chunk size.
set -uo pipefail
cd "$(dirname "$0")/.."

RESULTS=${OUT:-gpu-results}
BUDGET=480
STANDIN=0
PY=${PYTHON:-python3}
INSTALL=1
WHEELS=
QUICK=()
TESTS_GIVEN=()
DRY=0
SUMMARY_ONLY=0
while (($#)); do
  case $1 in
    --results) RESULTS=${2:?--results needs a directory}; shift 2 ;;
    --python) PY=${2:?--python needs an interpreter}; shift 2 ;;
    --no-install) INSTALL=0; shift ;;
    --wheels) WHEELS=${2:?--wheels needs a directory}; shift 2 ;;
    --quick) QUICK=(--quick); shift ;;
    --dry-run) DRY=1; shift ;;
    --summary-only) SUMMARY_ONLY=1; shift ;;
    --budget-s) BUDGET=${2:?--budget-s needs seconds}; shift 2 ;;
    --standin) STANDIN=1; shift ;;
    --tests) read -ra TESTS_GIVEN <<< "${2:?--tests needs pytest paths}"; shift 2 ;;
    -h|--help) sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "gpu-check: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
[[ $BUDGET =~ ^[0-9]+$ ]] && ((BUDGET > 0)) ||
  { echo "gpu-check: --budget-s $BUDGET: a whole number of seconds above 0" >&2; exit 2; }
DEVICE=cuda
if ((STANDIN)); then  # the steps that have a stand-in, on it (see above)
  DEVICE=cpu INSTALL=0 QUICK=(--quick)
  export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"  # kvtier from this checkout
fi
DEADLINE=$((SECONDS + BUDGET))

# The bench runs: name, then `kvtier bench copy` arguments.
BENCH_RUNS=(
  "bf16-LBNHC|--dtype bfloat16 --layout LBNHC --chunk-mib 2,4,8,16,32"
  "fp8-LBNHC|--dtype fp8 --layout LBNHC --chunk-mib 1,2,4,8,16,32"
  "bf16-BLHNC|--dtype bfloat16 --layout BLHNC --chunk-mib 2,4,8,16,32"
  "bf16-LBNHC-16layers|--dtype bfloat16 --layout LBNHC --layers 16 --chunk-mib 1,2,4,8,16,32"
)
TESTS=(tests/gpu tests/connector/test_stream_mover.py tests/connector/test_stream_mover_batches.py)
((${#TESTS_GIVEN[@]})) && TESTS=("${TESTS_GIVEN[@]}")
SLAB_TEST=tests/gpu/test_cuda_batches.py::test_a_node_slab_registered_for_dma_copies_at_pinned_speed

say() { printf '\n== %s\n' "$*"; }

# bounded NAME COMMAND...: COMMAND, killed once the budget is spent (status 124; NAME goes in
# timed-out.txt); not run at all when less than 5 s of it is left.
bounded() {
  local name=$1 left=$((DEADLINE - SECONDS)) rc
  shift
  if ((left < 5)); then
    echo "gpu-check: $name not run: the budget of $BUDGET s (--budget-s) is spent" >&2
    echo "$name" >> "$RESULTS/timed-out.txt"
    return 124
  fi
  timeout --kill-after=10 "$left" "$@"
  rc=$?
  if ((rc == 124 || rc == 137)); then
    echo "gpu-check: $name killed: the budget of $BUDGET s (--budget-s) ran out" >&2
    echo "$name" >> "$RESULTS/timed-out.txt"
  fi
  return "$rc"
}
fail() { printf 'gpu-check: FAIL: %s\n' "$1" >&2; exit "${2:-1}"; }

summary() {
  say "5. summary"
  local names=()
  for run in "${BENCH_RUNS[@]}"; do names+=("${run%%|*}"); done
  "$PY" - "$RESULTS" "$STANDIN" "${names[@]}" <<'EOF' | tee "$RESULTS/summary.md"
import json, sys
from pathlib import Path

results = Path(sys.argv[1])
standin = sys.argv[2] == "1"  # no GPU: CUDA tests skip, no target is judged
names = sys.argv[3:]


def read(name: str, default: str = "") -> str:
    path = results / name
    return path.read_text().strip() if path.exists() else default


tests_rc = int(read("pytest.rc", "1"))
cuda_skips = read("pytest.txt").count("needs a CUDA device")
tests_ok = tests_rc == 0 and (cuda_skips == 0 or standin)
timed_out = read("timed-out.txt").split()
print(f"# gpu-check summary{' (--standin: the CPU stand-in, no GPU)' if standin else ''}\n")
if timed_out:
    print(f"- OUT OF BUDGET (--budget-s), killed or not run: {', '.join(timed_out)}")
print(f"- GPU: {read('gpu.txt', 'unknown')}")
print(f"- {read('torch.txt', 'torch: unknown').splitlines()[0]}")
print(f"- tests (pytest {read('tests.txt', 'tests/gpu tests/connector/test_stream_mover*.py')}): "
      f"{'PASS' if tests_ok else 'FAIL'} (exit status {tests_rc}; skip lines for want of "
      f"CUDA: {cuda_skips}); see pytest.txt")
if standin:
    mover_rc = read("mover.rc", "not run")
    tests_ok = tests_ok and mover_rc == "0"
    print(f"- kvtier bench mover --quick: {'ran' if mover_rc == '0' else 'FAIL'} "
          f"(exit status {mover_rc}); see mover.json")
slab = [line for line in read("shm-register.txt").splitlines() if line.startswith("node slab")]
print(f"- {slab[0] if slab else 'node slab registered for DMA: no figures (see shm-register.txt)'}"
      "\n")
print("| run | chunk MiB | store GB/s | store/raw | load GB/s | load/raw | runner blocked "
      "| bytes | target |")
print("|---|---|---|---|---|---|---|---|---|")
correct, met, target = tests_ok, True, None
for name in names:
    rc, path = read(f"copy-{name}.rc", "not run"), results / f"copy-{name}.json"
    if rc != "0" or not path.exists():
        print(f"| {name} | - | - | - | - | - | - | - | FAIL (exit status {rc}) |")
        correct = False
        if not path.exists():
            continue
    data = json.loads(path.read_text())
    target = data["target_ratio"]
    correct = correct and data["verified"]
    for r in data["results"]:
        gbps = {f["name"]: f["gbps"] for f in r["figures"]}
        runner = r["runner"]
        judged = r["chunk_bytes"] >= 2 * 2**20  # 1 MiB chunks: reported, not judged
        met = met and (r["passed"] or not judged)
        judgement = "not judged" if standin else "PASS" if r["passed"] else \
            "FAIL" if judged else "below (1 MiB)"
        print(f"| {name} | {r['chunk_bytes'] / 2**20:g} | {gbps['store']:.1f} | "
              f"{r['ratios']['store']:.2f}x | {gbps['load']:.1f} | {r['ratios']['load']:.2f}x | "
              f"{runner['blocked_s'] * 1e3:.2f} ms of {runner['job_s'] * 1e3:.1f} ms | "
              f"{'verified' if r['verified'] else 'DIFFER'} | "
              f"{judgement} |")
correct = correct and not timed_out
if standin:
    met = True  # a CPU's copies say nothing of a GPU's target
verdict = "PASS" if correct and met else \
    "FAIL: correct, but below the target" if correct else "FAIL"
print(f"\n**gpu-check: {verdict}** " + (
    "(the stand-in: every step ran, tests passed, bytes verified; no target judged)"
    if standin else f"(target: store and load >= {target}x a raw pinned copy at every chunk "
    "size from 2 MiB)"))
sys.exit(0 if correct and met else 3 if correct else 1)
EOF
  return "${PIPESTATUS[0]}"
}

if ((SUMMARY_ONLY)); then
  summary
  exit $?
fi

if ((DRY)); then
  echo "gpu-check --dry-run: the steps, with $PY, results in $RESULTS/, steps 2-4 within" \
       "$BUDGET s"
  if ((STANDIN)); then
    echo "1. (--standin: no GPU; the CPU stand-in where a step has one)"
  else
    echo "1. nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader"
    echo "   $PY -c 'import torch; assert torch.cuda.is_available()'"
  fi
  if ((INSTALL)); then
    if [[ -n $WHEELS ]]; then
      echo "2. export PYTHONPATH=$PWD/src (kvtier from the checkout, not built)"
    else
      echo "2. $PY -m pip install --no-deps -e ."
    fi
    echo "   $PY -m pip install <pyproject.toml [project] dependencies> pytest pytest-timeout" \
         "${WHEELS:+--no-index --find-links $WHEELS}"
    echo "   (never torch or vllm: the torch in place must be the same afterwards)"
  else
    echo "2. (--no-install: the environment as it is)"
  fi
  echo "3. $PY -m pytest ${TESTS[*]} -q -rs   > $RESULTS/pytest.txt, pytest.rc"
  ((STANDIN)) || echo "   $PY -m pytest $SLAB_TEST -q -s   > $RESULTS/shm-register.txt"
  for run in "${BENCH_RUNS[@]}"; do
    echo "4. $PY -m kvtier.tools.cli.main bench copy --device $DEVICE ${run#*|} ${QUICK[*]}" \
         "--json $RESULTS/copy-${run%%|*}.json --markdown $RESULTS/copy-${run%%|*}.md" \
         "  (exit status: copy-${run%%|*}.rc)"
  done
  ((STANDIN)) && echo "4. $PY -m kvtier.tools.cli.main bench mover --quick" \
    "--json $RESULTS/mover.json   (exit status: mover.rc)"
  echo "5. the summary: $RESULTS/summary.md (PASS/FAIL per chunk size, target 0.8x)"
  exit 0
fi

mkdir -p "$RESULTS" || fail "cannot create $RESULTS" 2
echo '*' > "$RESULTS/.gitignore"  # results are never committed
rm -f "$RESULTS"/copy-*.{json,md,rc} "$RESULTS"/{gpu.txt,torch.txt,pytest.txt,pytest.rc,tests.txt} \
  "$RESULTS"/{shm-register.txt,summary.md,timed-out.txt,mover.json,mover.rc}

if ((STANDIN)); then
  say "1. no GPU (--standin): the CPU stand-in"
  echo "none: the CPU stand-in (--standin)" > "$RESULTS/gpu.txt"
  "$PY" -c 'import torch; print(f"torch {torch.__version__}, CUDA {torch.version.cuda}")' \
    | tee "$RESULTS/torch.txt"
  ((PIPESTATUS[0] == 0)) || fail "no torch in $PY (--python PY)" 2
else  # (not indented: its heredoc's end must start its line)
say "1. the GPU"
command -v nvidia-smi >/dev/null ||
  fail "nvidia-smi not found: no NVIDIA driver on this machine (the run-book needs a GPU)" 2
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader \
  | tee "$RESULTS/gpu.txt" || fail "nvidia-smi failed: the driver sees no GPU" 2
command -v "$PY" >/dev/null || fail "no Python '$PY' (--python PY)" 2
"$PY" - <<'EOF' | tee "$RESULTS/torch.txt"
import sys
try:
    import torch
except ImportError:
    sys.exit("gpu-check: FAIL: torch is not installed in this Python (install a CUDA build "
             "of PyTorch first; this script never installs torch)")
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, "
      f"available: {torch.cuda.is_available()}")
if not torch.cuda.is_available():
    why = ("a CPU-only build" if torch.version.cuda is None
           else "built for CUDA, but it finds no usable GPU (driver, CUDA_VISIBLE_DEVICES?)")
    sys.exit(f"gpu-check: FAIL: torch {torch.__version__} is {why}")
print(f"device: {torch.cuda.get_device_name(0)}")
EOF
((PIPESTATUS[0] == 0)) || exit 2
fi
TORCH_BEFORE=$("$PY" -c 'import torch; print(torch.__version__)')

if ((INSTALL)); then
  say "2. kvtier and its light dependencies (not torch, not vllm)"
  mapfile -t DEPS < <("$PY" - <<'EOF'
import re, tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
extras = project["optional-dependencies"]
deps = project["dependencies"] + extras["tools"] + [d for d in extras["test"]
                                             if re.match(r"pytest", d)]
for dep in deps:  # openai: the field's bench clients' (tools extra); no device step uses it
    if not re.match(r"(torch|vllm|openai)\b", dep):
        print(dep)
EOF
  )
  ((${#DEPS[@]})) || fail "could not read the dependencies from pyproject.toml"
  OFFLINE=()
  if [[ -n $WHEELS ]]; then
    [[ -d $WHEELS ]] || fail "--wheels $WHEELS: no such directory (scripts/gpu-wheels.sh)" 2
    OFFLINE=(--no-index --find-links "$WHEELS")
    export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
  else
    bounded install "$PY" -m pip install --no-deps -e . || fail "pip install --no-deps -e . failed"
  fi
  bounded install "$PY" -m pip install "${OFFLINE[@]}" "${DEPS[@]}" ||
    fail "pip install of the dependencies failed${WHEELS:+ (a wheel missing from $WHEELS?)}"
  TORCH_AFTER=$("$PY" -c 'import torch; print(torch.__version__)')
  [[ $TORCH_AFTER == "$TORCH_BEFORE" ]] ||
    fail "torch changed from $TORCH_BEFORE to $TORCH_AFTER during the install"
fi

say "3. the device tests"
PYTEST_OPTS=()  # pyproject's addopts name --timeout: without pytest-timeout, drop them
"$PY" -c 'import pytest_timeout' 2>/dev/null || PYTEST_OPTS=(-o addopts=)
echo "${TESTS[*]}" > "$RESULTS/tests.txt"
bounded tests "$PY" -m pytest "${TESTS[@]}" -q -rs -p no:cacheprovider "${PYTEST_OPTS[@]}" 2>&1 \
  | tee "$RESULTS/pytest.txt"
echo "${PIPESTATUS[0]}" > "$RESULTS/pytest.rc"
# The node slab's figures (printed by the test; its pass or fail counts in pytest.txt above).
if ((STANDIN)); then
  echo "not run: --standin (a CUDA test)" > "$RESULTS/shm-register.txt"
else
  bounded node-slab "$PY" -m pytest "$SLAB_TEST" -q -s -p no:cacheprovider "${PYTEST_OPTS[@]}" \
    2>&1 | tee "$RESULTS/shm-register.txt"
fi

say "4. kvtier bench copy --device $DEVICE, 1-32 MiB chunks"
for run in "${BENCH_RUNS[@]}"; do
  name=${run%%|*}
  # shellcheck disable=SC2086  # the run's arguments are words
  bounded "copy-$name" "$PY" -m kvtier.tools.cli.main bench copy --device "$DEVICE" ${run#*|} \
    "${QUICK[@]}" \
    --json "$RESULTS/copy-$name.json" --markdown "$RESULTS/copy-$name.md"
  echo $? > "$RESULTS/copy-$name.rc"
done
if ((STANDIN)); then  # the device mover's ordering protocol, on the stand-in
  bounded mover "$PY" -m kvtier.tools.cli.main bench mover --quick --json "$RESULTS/mover.json"
  echo $? > "$RESULTS/mover.rc"
fi

summary
