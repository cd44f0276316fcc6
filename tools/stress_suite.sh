#!/usr/bin/env bash
# The suite's timing-free property: the tests pass while every core is kept busy.
#   bash tools/stress_suite.sh [--runs 3] [--cores N] [pytest arguments...]
#   bash tools/stress_suite.sh --runs 3                       # the CI's test command, 3 times
#   bash tools/stress_suite.sh --runs 5 tests/planning/test_step_time.py
# Starts N busy loops (`stress-ng --cpu N` when it is installed, else N Python loops; N defaults
# to the cores this process may use), runs `bash scripts/test.sh` (the whole suite as CI runs it),
# or `python -m pytest -q ARGS` when pytest arguments are given, --runs times in a row beside
# them, stops the loops (by the ids it started) and exits non-zero if any run failed.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
runs=3
cores=$("$PY" -c "import os; print(len(os.sched_getaffinity(0)))")
while [[ $# -gt 0 ]]; do
  case "$1" in
    --runs) runs=$2; shift 2 ;;
    --cores) cores=$2; shift 2 ;;
    *) break ;;
  esac
done

loops=()
stop_loops() {
  for pid in "${loops[@]}"; do kill "$pid" 2>/dev/null; done
  wait "${loops[@]}" 2>/dev/null
}
trap stop_loops EXIT
if command -v stress-ng >/dev/null; then
  stress-ng --cpu "$cores" --quiet &
  loops+=($!)
  echo "== stress-ng --cpu $cores (pid ${loops[*]})"
else
  for _ in $(seq "$cores"); do
    "$PY" -c "while True: pass" &
    loops+=($!)
  done
  echo "== $cores Python busy loops (pids ${loops[*]})"
fi

export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} PYTHONPATH=${PYTHONPATH:-$PWD}
failed=0
if [[ $# -gt 0 ]]; then
  command=("$PY" -m pytest -q -p no:cacheprovider "$@")
else
  command=(bash scripts/test.sh)
fi
for i in $(seq "$runs"); do
  echo "== run $i of $runs: ${command[*]}"
  start=$(date +%s)
  if "${command[@]}"; then
    echo "== run $i passed ($(( $(date +%s) - start )) s under load)"
  else
    echo "== run $i FAILED"
    failed=1
  fi
done
exit $failed
