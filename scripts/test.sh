#!/usr/bin/env bash
# The test command: installs what is missing into the active Python environment, then runs
# ruff (format check + lint) and the whole test suite on CPU.
#   bash scripts/test.sh            # everything
#   bash scripts/test.sh tests/core # pytest arguments pass through
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

# torch: exactly 2.13.0 when absent (a CPU wheel here; an open range would pull GBs of CUDA wheels).
if ! "$PY" -c "import torch" 2>/dev/null; then
  "$PY" -m pip install -q "torch==2.13.0"
fi
# the package itself (editable) and the test extras,
# installed only when something is missing so a warm machine starts the suite at once.
if ! "$PY" - <<'PY' 2>/dev/null; then
import importlib, os, megalite.kernels
# megalite must be installed from THIS checkout (an editable install of another clone would serve
# megalite.kernels from there)
assert os.path.samefile(os.path.dirname(megalite.kernels.__file__), "megalite/kernels")
for m in ("numpy", "sentencepiece", "tensorboard", "pytest", "ruff", "transformers", "safetensors", "triton", "megatron.core"):
    importlib.import_module(m)
PY
  "$PY" -m pip install -q -e ".[test,triton]"
fi

echo "== history: no issue numbers in the code"
"$PY" tools/check_history.py

echo "== ruff"
"$PY" -m ruff format --check .
"$PY" -m ruff check .

export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
if [[ $# -gt 0 ]]; then
  echo "== pytest"
  exec "$PY" -m pytest -q "$@"
fi
# A whole-suite run, each test once, in three parts side by side (each part spends much of its
# time in one process; together they keep both cores busy until the end). Every test about
# kernels, fusions, softmax or norms runs with triton's interpreter on (TRITON_INTERPRET=1), as on
# a GPU where the kernels exist: the models then take the fused kernels wherever they would on a
# GPU, and the planner's predictions must follow the path that runs. The rest runs without it, the
# tests marked kernels_on (the fused kernels forced on) again there on the reference path, split
# in two by path: the tools, scripts, conversion, data, checkpoint and planning tests and the
# training tests that launch whole jobs (signals, torchrun), and everything else (paths move to
# the side when the rest outgrows it: per-test durations from `--junitxml` runs of each part
# decide; the interpreter part is a few minutes since the kernels run short rows as tiles).
SELECTION="kernel or fused or softmax or norm"
SIDE=(tests/tools tests/scripts tests/conversion tests/data tests/checkpoint tests/planning
  tests/training/test_signals.py tests/training/test_pretrain_torchrun.py)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
echo "== pytest, $SELECTION: TRITON_INTERPRET=1 (beside the rest; its output follows)"
TRITON_INTERPRET=1 "$PY" -m pytest -q -p no:cacheprovider --durations=10 --basetemp="$work/interp" \
  -k "$SELECTION" >"$work/interp.log" 2>&1 &
interp=$!
echo "== pytest, ${SIDE[*]} (beside the rest; its output follows)"
"$PY" -m pytest -q -p no:cacheprovider --durations=10 --basetemp="$work/side" \
  -k "not ($SELECTION) or kernels_on" "${SIDE[@]}" >"$work/side.log" 2>&1 &
side=$!
echo "== pytest, the rest (and kernels_on on the reference path)"
ignore=()
for d in "${SIDE[@]}"; do ignore+=(--ignore="$d"); done
rest=0
"$PY" -m pytest -q --durations=10 --basetemp="$work/rest" -k "not ($SELECTION) or kernels_on" \
  "${ignore[@]}" || rest=$?
side_status=0
wait "$side" || side_status=$?
interp_status=0
wait "$interp" || interp_status=$?
echo "== pytest, ${SIDE[*]}"
cat "$work/side.log"
echo "== pytest, $SELECTION: TRITON_INTERPRET=1"
cat "$work/interp.log"
if [[ $rest -ne 0 || $side_status -ne 0 || $interp_status -ne 0 ]]; then
  echo "test.sh: the rest exited $rest, ${SIDE[*]} $side_status, the TRITON_INTERPRET part" \
    "$interp_status" >&2
  exit 1
fi
