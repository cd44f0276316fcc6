#!/usr/bin/env bash
# One command that checks megalite on a CUDA machine:
#   bash scripts/gpu_check.sh [OUT_FILE]     # the summary table also goes to OUT_FILE
#                                            # (default gpu_check_results.md)
#   GPU_CHECK_LIST_RUNS=1 bash scripts/gpu_check.sh   # print each training run's flags, run nothing
# Steps: the fused kernels compiled (no interpreter) against float64; the CUDA-only checks of
# tests/test_cuda_only.py (SDPA flash/efficient kernels in bf16, CP block attention's efficient
# kernel, the offloaded step); one-GPU training with nccl on mock data (TP1/PP1; ZeRO-1, -2 and -3
# and ZeRO-1 with half the optimizer offloaded to the host, each with a world of 1; MoE at EP1
# with the all-to-all dispatcher; unfused kernels); tools/bench/bench_kernels.py;
# tools/bench/bench_mfu.py. Multi-rank layouts (TP, PP schedules, CP, EP > 1) need more GPUs and are
# not run here. Prints one table (step, status, seconds, log), exits non-zero if any step failed.
# torch must already be installed (with CUDA); megalite and its extras are installed editable when
# missing. Without CUDA it prints one line and exits 0.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${1:-gpu_check_results.md}

# mock-data pretraining on one GPU (nccl, world of 1): loss must be finite, the run must finish
TRAIN=(--num-layers 4 --hidden-size 256 --num-attention-heads 8 --seq-length 512
  --max-position-embeddings 512 --micro-batch-size 4 --global-batch-size 8 --train-iters 20
  --lr 1e-4 --mock-data --tokenizer-type NullTokenizer --vocab-size 8191 --bf16
  --log-interval 5 --eval-iters 0 --distributed-backend nccl)
LLAMA=(--position-embedding-type rope --normalization RMSNorm --swiglu --disable-bias-linear
  --group-query-attention --num-query-groups 2)
MOE=(--num-experts 4 --moe-router-topk 2 --expert-model-parallel-size 1
  --moe-token-dispatcher-type alltoall --moe-aux-loss-coeff 1e-2)
RUN_NAMES=(train_gpt2_tp1_pp1 train_llama_zero1 train_llama_zero2 train_llama_zero3
  train_llama_zero1_offload train_llama_moe_ep1 train_gpt2_unfused)
run_flags() {  # run_flags NAME: the pretrain_gpt.py flags of that training run
  case $1 in
    train_gpt2_tp1_pp1) echo "${TRAIN[*]}" ;;
    train_llama_zero1) echo "${TRAIN[*]} ${LLAMA[*]} --use-distributed-optimizer" ;;
    train_llama_zero2) echo "${TRAIN[*]} ${LLAMA[*]} --zero-stage 2 --overlap-grad-reduce" ;;
    train_llama_zero3) echo "${TRAIN[*]} ${LLAMA[*]} --zero-stage 3 --overlap-grad-reduce" ;;
    train_llama_zero1_offload) echo "${TRAIN[*]} ${LLAMA[*]} --use-distributed-optimizer \
--optimizer-cpu-offload --optimizer-offload-fraction 0.5" ;;
    train_llama_moe_ep1) echo "${TRAIN[*]} ${LLAMA[*]} ${MOE[*]}" ;;
    train_gpt2_unfused) echo "${TRAIN[*]} --no-fused-kernels" ;;
  esac
}
if [[ -n "${GPU_CHECK_LIST_RUNS:-}" ]]; then
  for name in "${RUN_NAMES[@]}"; do
    echo "$name $(run_flags "$name")"
  done
  exit 0
fi

if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  echo "gpu_check: no CUDA GPU (torch.cuda.is_available() is False or torch is missing): nothing checked"
  exit 0
fi
if ! "$PY" -c "import megalite.kernels, triton, pytest, transformers" 2>/dev/null; then
  "$PY" -m pip install -q -e ".[test,triton]" || { echo "gpu_check: pip install failed"; exit 1; }
fi
unset TRITON_INTERPRET
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
LOGS=$(mktemp -d /tmp/gpu_check.XXXXXX)
ROWS=()
FAILED=0

step() {  # step NAME COMMAND...: run, log to $LOGS/NAME.log, record a row
  local name=$1
  shift
  local t0=$SECONDS status=ok
  echo "== $name: $*"
  if ! "$@" >"$LOGS/$name.log" 2>&1; then
    status=FAILED
    FAILED=1
  fi
  tail -n 25 "$LOGS/$name.log"
  ROWS+=("| $name | $status | $((SECONDS - t0)) | $LOGS/$name.log |")
}

step kernels_compiled "$PY" -m pytest -q -p no:cacheprovider --noconftest \
  tests/kernels/test_cuda_compiled.py
step cuda_paths "$PY" -m pytest -q -p no:cacheprovider --noconftest \
  tests/test_cuda_only.py
for name in "${RUN_NAMES[@]}"; do
  read -r -a flags <<<"$(run_flags "$name")"
  step "$name" "$PY" -m torch.distributed.run --standalone --nproc-per-node 1 \
    pretrain_gpt.py "${flags[@]}"
done
step bench_kernels "$PY" tools/bench/bench_kernels.py --markdown
step bench_mfu "$PY" tools/bench/bench_mfu.py --out "$LOGS/bench_mfu.md"

{
  echo "gpu_check $(date -u +%Y-%m-%dT%H:%MZ) on $("$PY" -c 'import torch; print(torch.cuda.get_device_name())')"
  echo
  echo "| step | status | seconds | log |"
  echo "|---|---|---|---|"
  printf '%s\n' "${ROWS[@]}"
  if [[ -f "$LOGS/bench_mfu.md" ]]; then
    echo
    cat "$LOGS/bench_mfu.md"
  fi
} | tee "$OUT"
echo "gpu_check: table written to $OUT"
exit $FAILED
