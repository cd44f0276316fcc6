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
for m in ("numpy", "sentencepiece", "tensorboard", "pytest", "ruff", "transformers", "safetensors", "triton"):
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
# The tests marked kernels_on (norms and softmax through the models, the SP norm blocks, HF and
# Mixtral equivalence, the planner's activations with the fused norms) with the fused Triton
# kernels forced on (as on a GPU), through triton's interpreter on CPU; tests/kernels runs them
# interpreted in the main suite already. Only on a whole-suite run, before it (so its summary
# line comes last). ~60 s.
if [[ $# -eq 0 ]]; then
  echo "== pytest, fused kernels on (TRITON_INTERPRET=1)"
  TRITON_INTERPRET=1 "$PY" -m pytest -q -p no:cacheprovider -m kernels_on \
    tests/core/tensor_parallel/test_sequence_parallel.py tests/models tests/conversion \
    tests/planning/test_memory_prediction.py
fi

echo "== pytest"
"$PY" -m pytest -q "$@"
