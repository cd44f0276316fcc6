#!/usr/bin/env bash
# megalite on the lowest torch it supports (pyproject.toml's lower bound, the torch the GPU machine
# has): a representative subset of the suite under torch 2.11.0 in a venv of its own.
#   bash scripts/test_torch_floor.sh                 # build the venv (or reuse it), run the subset
#   bash scripts/test_torch_floor.sh tests/core/moe  # pytest arguments replace the subset
#   bash scripts/test_torch_floor.sh --venv-only     # build (or check) the venv, run nothing
#   MEGALITE_TORCH_FLOOR_VENV=DIR bash scripts/test_torch_floor.sh   # another venv path
# The venv lives at a stable path and is reused while it still has torch 2.11.0 and the test
# dependencies; anything else there is replaced. The registry serves torch 2.11.0 only as its
# CUDA build (a ~530 MB wheel and ~3 GB of nvidia-* wheels), which runs on a CPU-only machine.
# megalite itself is not installed: the checkout is put on PYTHONPATH, as on the GPU machine.
# The subset: TP/SP, PP schedules, ZeRO-1/2/3, CP, MoE, the Triton kernels under the interpreter,
# HF conversion, and tests/scripts/test_gpu_check.py (gpu_check.sh quick --allow-no-gpu with no
# network, bench_mfu.py's CPU smoke run) with this venv's python. Measured on the 2-core CI machine
# under load (load average 8-18): cold (venv built, empty uv cache) 271 s, of which 68 s install;
# warm (venv reused) 226 s.
set -euo pipefail
cd "$(dirname "$0")/.."
TORCH=2.11.0
VENV=${MEGALITE_TORCH_FLOOR_VENV:-$HOME/.cache/megalite/venv-torch$TORCH}
PY=${PYTHON:-python3}
# megalite's dependencies and test extras (pyproject.toml) less ruff; triton (3.6.0) comes with
# torch. numpy < 2.4: triton 3.6's interpreter turns 1-element arrays into Python ints, which
# numpy 2.4 refuses (the GPU machine runs the kernels compiled, where this does not arise).
DEPS=("numpy<2.4" sentencepiece tensorboard regex pytest transformers safetensors tokenizers)

ready() {
  [[ -x "$VENV/bin/python" ]] && "$VENV/bin/python" - "$TORCH" <<'PY' 2>/dev/null
import importlib, sys
import numpy, torch
assert torch.__version__.split("+")[0] == sys.argv[1], torch.__version__
assert tuple(int(x) for x in numpy.__version__.split(".")[:2]) < (2, 4), numpy.__version__
for m in ("sentencepiece", "tensorboard", "regex", "pytest", "transformers", "safetensors",
          "tokenizers", "triton"):
    importlib.import_module(m)
PY
}

# uv fetches and unpacks the ~3.5 GB in parallel (pip takes minutes longer) and keeps its cache,
# so a venv deleted since is rebuilt from the cache; pip installs everything when uv cannot be had.
install() {
  local log="$VENV.install.log"
  if "$VENV/bin/python" -m pip install -q uv >"$log" 2>&1; then
    "$VENV/bin/python" -m uv pip install -q --python "$VENV/bin/python" "torch==$TORCH" \
      "${DEPS[@]}" >>"$log" 2>&1
  else
    "$VENV/bin/python" -m pip install -q "torch==$TORCH" "${DEPS[@]}" >>"$log" 2>&1
  fi || { tail -n 20 "$log" >&2; return 1; }
}

t0=$SECONDS
if ready; then
  echo "== torch floor: reusing $VENV"
else
  echo "== torch floor: building $VENV (torch==$TORCH)"
  rm -rf "$VENV"
  mkdir -p "$(dirname "$VENV")"
  "$PY" -m venv "$VENV"
  install
  ready || { echo "torch floor: $VENV does not import torch $TORCH and the test deps" >&2; exit 1; }
fi
echo "== torch floor: venv ready in $((SECONDS - t0)) s"
[[ ${1:-} == --venv-only ]] && exit 0

SUBSET=(
  tests/core/tensor_parallel/test_layers.py                 # TP layers vs torch
  tests/core/tensor_parallel/test_sequence_parallel.py      # SP
  tests/core/pipeline_parallel/test_forward_backward.py     # PP schedules
  tests/core/pipeline_parallel/test_executor_hot_path.py    # receive buffers reused (torch internals)
  tests/core/optimizer/test_sharded_optimizer.py            # ZeRO-1
  tests/core/distributed/test_zero2_zero3.py                # ZeRO-2/3
  tests/core/context_parallel/test_attention.py             # CP
  tests/core/moe/test_layer.py                              # MoE across EP, ETP, dispatchers
  tests/kernels/test_layer_norm.py tests/kernels/test_softmax.py tests/kernels/test_gpt_fused.py
  tests/conversion/test_hf_conversion.py                    # HF <-> megalite
  tests/scripts/test_gpu_check.py                           # gpu_check.sh offline, bench_mfu
)
# the kernels' float64 comparisons and looped rows in fp32 only: each dtype's arithmetic is the
# main suite's to check; here what matters is that the kernels compile and run on this torch/triton
SELECT=(-k "not ((matches_float64 or looped_path) and (bf16 or fp16))")
[[ $# -gt 0 ]] && SUBSET=("$@") && SELECT=()
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# the kernels run under triton's interpreter (tests/conftest.py); triton 3.6's warns per element
PYTHONPATH="$PWD" "$VENV/bin/python" -m pytest -q -p no:cacheprovider \
  -W "ignore:Conversion of an array with ndim:DeprecationWarning" "${SELECT[@]}" "${SUBSET[@]}"
