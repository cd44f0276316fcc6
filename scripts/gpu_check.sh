#!/usr/bin/env bash
# What only a CUDA GPU can check, in time boxes that fit a short window on one GPU, offline.
#   bash scripts/gpu_check.sh [quick|full] [OUT] [--allow-no-gpu] [--only STEP,...]
#     quick (default)  the steps below, at most 6 min on one H100 (the boxes)
#     full             quick, then the benchmarks that take longer (each box <= 9 min)
#     OUT              folder (default out/gpu_check): gpu_check.md (the table, ready for
#                      docs/PERFORMANCE.md), gpu_check.json (every figure), logs/ (each step's log)
#     --allow-no-gpu   without CUDA, report every step "skipped (no GPU)" and exit 0 (CI's smoke
#                      test); without the flag, no CUDA is exit 2
#     --only S1,S2     only these steps of the mode (one command per step fits a 10-minute limit)
# Nothing comes from a network: it runs the python that has torch (PYTHON, default python3) with
# this checkout on PYTHONPATH, and never calls pip. A step passes only if it ran at least one test
# and none failed (pytest's JUnit XML is read, a benchmark's rows are its tests); a step still
# running near the end of its box is interrupted (SIGINT, then KILL at the box's end) and reported
# TIMEOUT, so the boxes bound the whole run. Exit status: 0 every step ok,
# 1 some step was not, 2 no CUDA (or no torch) without --allow-no-gpu.
#
# Steps (box in seconds):
#   quick  kernels_compiled  60  tests/kernels/test_cuda_compiled.py: the Triton kernels compiled,
#                                against float64 (three processes, one per dtype: compiling is
#                                CPU-bound)
#          cuda_paths       100  tests/test_cuda_only.py: SDPA flash/efficient kernels in bf16, CP
#                                block attention's efficient kernel, the offloaded step, compiled
#                                flex attention on block plans (each mask compiles: ~10 s)
#          training          80  tests/test_cuda_training.py: pretrain() on one GPU with nccl, GPT-2
#                                and Llama at each ZeRO rung, ZeRO-1 offload, MoE (all-to-all and
#                                allgather), unfused kernels, each against CPU fp32
#          mfu              110  tools/bench/bench_mfu.py: GPT-2 1.3B and Llama 1B, megalite (bf16,
#                                fp32 grads and masters) vs PyTorch AMP, micro-batch from the planner
#                          = 350 s, and ~10 s to import torch first: at most 6 min
#   full   bench_kernels    300  tools/bench/bench_kernels.py: fused vs eager vs torch.compile
#          mfu_compile      540  bench_mfu.py with torch.compile of the plain models as well
# Multi-GPU layouts (TP, PP schedules, CP, EP > 1) need more GPUs and are not run here.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
MODE=quick
OUT=out/gpu_check
ALLOW_NO_GPU=0
ONLY=""
positional=()
while [[ $# -gt 0 ]]; do
  case $1 in
    --allow-no-gpu) ALLOW_NO_GPU=1 ;;
    --only) ONLY=${2:-}; shift ;;
    -h | --help) sed -n '2,13p' "$0"; exit 0 ;;
    -*) echo "gpu_check: unknown option $1" >&2; exit 2 ;;
    *) positional+=("$1") ;;
  esac
  shift
done
[[ ${#positional[@]} -gt 0 ]] && MODE=${positional[0]}
[[ ${#positional[@]} -gt 1 ]] && OUT=${positional[1]}
if [[ $MODE != quick && $MODE != full ]]; then
  echo "gpu_check: the mode is quick or full, not '$MODE'" >&2
  exit 2
fi

# name, box seconds: quick's, then full's
STEPS=(kernels_compiled:60 cuda_paths:100 training:80 mfu:110)
[[ $MODE == full ]] && STEPS+=(bench_kernels:300 mfu_compile:540)
if [[ -n $ONLY ]]; then
  chosen=()
  for entry in "${STEPS[@]}"; do
    [[ ",$ONLY," == *",${entry%%:*},"* ]] && chosen+=("$entry")
  done
  if [[ ${#chosen[@]} -ne $(tr ',' '\n' <<<"$ONLY" | grep -c .) ]]; then
    echo "gpu_check: --only $ONLY: the $MODE steps are ${STEPS[*]%%:*}" >&2
    exit 2
  fi
  STEPS=("${chosen[@]}")
fi

export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET  # the kernels run compiled
mkdir -p "$OUT/logs"
OUT=$(cd "$OUT" && pwd)
TSV="$OUT/steps.tsv"

probe=$("$PY" -c "import torch; print(torch.__version__); print(torch.cuda.is_available() and torch.cuda.get_device_name(0) or '')" 2>&1)
if [[ $? -ne 0 ]]; then
  echo "gpu_check: $PY cannot import torch (set PYTHON to the python that has it): ${probe##*$'\n'}" >&2
  exit 2
fi
TORCH=$(sed -n 1p <<<"$probe")
DEVICE=$(sed -n 2p <<<"$probe")
printf '%s\t%s\t%s\n' "${DEVICE:-no CUDA GPU}" "$TORCH" "$MODE" >"$TSV"

if [[ -z $DEVICE ]]; then
  for entry in "${STEPS[@]}"; do
    printf '%s\t-\t%s\tskipped\t0\t-\n' "${entry%%:*}" "${entry##*:}" >>"$TSV"
  done
  "$PY" tools/gpu_check_report.py "$TSV" "$OUT" >/dev/null
  if [[ $ALLOW_NO_GPU -eq 1 ]]; then
    cat "$OUT/gpu_check.md"
    echo "gpu_check: no CUDA GPU (torch $TORCH): every step skipped (--allow-no-gpu); $OUT/gpu_check.md"
    exit 0
  fi
  echo "gpu_check: no CUDA GPU (torch $TORCH, torch.cuda.is_available() is False): nothing checked" >&2
  exit 2
fi

PYTEST=("$PY" -m pytest -q -p no:cacheprovider --noconftest)
KERNEL_SHARDS=("float32" "bfloat16" "float16 and not bfloat16")  # -k: one process per dtype

step_command() {  # step_command NAME: the step's kind, artifacts and command (bash), one per line
  local x="$OUT/logs/$1"
  case $1 in
    kernels_compiled)
      local i cmd="" files=""
      for i in "${!KERNEL_SHARDS[@]}"; do
        cmd+="OMP_NUM_THREADS=4 ${PYTEST[*]} --junitxml=$x.$i.xml -k '${KERNEL_SHARDS[$i]}' "
        cmd+="tests/kernels/test_cuda_compiled.py > $x.$i.log 2>&1 & "
        files+="${files:+,}$x.$i.xml"
      done
      printf 'pytest\n%s\n%s\n' "$files" "$cmd wait" ;;
    cuda_paths) printf 'pytest\n%s\n%s\n' "$x.xml" "${PYTEST[*]} --junitxml=$x.xml tests/test_cuda_only.py" ;;
    training) printf 'pytest\n%s\n%s\n' "$x.xml" "${PYTEST[*]} --junitxml=$x.xml tests/test_cuda_training.py" ;;
    mfu | mfu_compile)
      local kinds="megalite plain"
      [[ $1 == mfu_compile ]] && kinds+=" compile"
      printf 'bench_json\n%s\n%s\n' "$x.json" \
        "$PY tools/bench/bench_mfu.py --kinds $kinds --out-json $x.json --out-md $x.md" ;;
    bench_kernels) printf 'table\n%s\n%s\n' "$x.log" "$PY tools/bench/bench_kernels.py --markdown" ;;
  esac
}

for entry in "${STEPS[@]}"; do
  name=${entry%%:*}
  box=${entry##*:}
  mapfile -t spec < <(step_command "$name")
  echo "== $name (box $box s): ${spec[2]}"
  t0=$SECONDS
  # SIGINT 10 s before the box ends (pytest still writes its JUnit XML), KILL at its end
  timeout -s INT -k 10 "$((box - 10))" bash -c "${spec[2]}" >"$OUT/logs/$name.log" 2>&1
  code=$?
  cat "$OUT/logs/$name".[0-9].log >>"$OUT/logs/$name.log" 2>/dev/null  # a step's processes
  tail -n 15 "$OUT/logs/$name.log"
  printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$name" "${spec[0]}" "$box" "$code" "$((SECONDS - t0))" \
    "${spec[1]}" >>"$TSV"
done

"$PY" tools/gpu_check_report.py "$TSV" "$OUT"
status=$?
echo "gpu_check: $OUT/gpu_check.md and $OUT/gpu_check.json"
exit $status
