#!/usr/bin/env bash
# GPT-2 125M (12 layers, hidden 768, 12 heads, 1024 tokens),
# on one node: torchrun, one process per GPU. Data parallel, ZeRO-1, bf16.
#
#   DATA_PATH=data/corpus_text_document TOKENIZER_MODEL=tokenizers/gpt2 \
#       bash scripts/pretrain_gpt_gpt2_125m.sh [more pretrain_gpt.py flags]
#
# Flags given after the script name come last, so they override the ones below. DATA_PATH: a
# prefix written by tools/preprocess_data.py (--output-prefix data/corpus gives
# data/corpus_text_document), tokenised with TOKENIZER_MODEL: a HuggingFace tokenizer folder.
# Optional: NPROC_PER_NODE (default: every GPU), CHECKPOINT_DIR (default checkpoints/gpt2_125m),
# TRAIN_ITERS, DRY_RUN=1 (print the command instead of running it). Training resumes from
# CHECKPOINT_DIR when it holds a checkpoint; SIGTERM saves one and exits 0 (--exit-signal-handler).
set -euo pipefail
cd "$(dirname "$0")/.."
: "${DATA_PATH:?set DATA_PATH to a preprocessed prefix, e.g. data/corpus_text_document}"
: "${TOKENIZER_MODEL:?set TOKENIZER_MODEL to a local tokenizer folder or tokenizer.json}"
if [[ -z "${NPROC_PER_NODE:-}" ]]; then
  NPROC_PER_NODE=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
  [[ "$NPROC_PER_NODE" -ge 1 ]] 2>/dev/null || NPROC_PER_NODE=1
fi
CHECKPOINT_DIR=${CHECKPOINT_DIR:-checkpoints/gpt2_125m}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# export CUDA_DEVICE_MAX_CONNECTIONS=1  # keep TP/SP collectives in issue order
# export NCCL_DEBUG=WARN                # INFO when debugging hangs

MODEL_ARGS=(  # GPT-2 small: learned positions, LayerNorm, GELU, tied embeddings
  --num-layers 12 --hidden-size 768 --num-attention-heads 12
  --seq-length 1024 --max-position-embeddings 1024
  --hidden-dropout 0.0 --attention-dropout 0.0 --init-method-std 0.02
)
PARALLEL_ARGS=(
  --tensor-model-parallel-size 1 --pipeline-model-parallel-size 1 --use-distributed-optimizer
)
TRAINING_ARGS=(  # 512 x 1024 = 0.5M tokens per step
  --micro-batch-size 16 --global-batch-size 512 --train-iters "${TRAIN_ITERS:-600000}"
  --lr 6e-4 --min-lr 6e-5 --lr-decay-style cosine --lr-warmup-iters 2000
  --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --clip-grad 1.0 --bf16 --seed 1234
)
DATA_ARGS=(
  --data-path "$DATA_PATH" --split 949,50,1
  --tokenizer-type HuggingFaceTokenizer --tokenizer-model "$TOKENIZER_MODEL"
)
OUTPUT_ARGS=(
  --log-interval 10 --eval-interval 1000 --eval-iters 10
  --save "$CHECKPOINT_DIR" --load "$CHECKPOINT_DIR" --save-interval 1000
  --tensorboard-dir "$CHECKPOINT_DIR/tensorboard" --exit-signal-handler
)
CMD=(torchrun --standalone --nproc-per-node "$NPROC_PER_NODE" pretrain_gpt.py
     "${MODEL_ARGS[@]}" "${PARALLEL_ARGS[@]}" "${TRAINING_ARGS[@]}" "${DATA_ARGS[@]}"
     "${OUTPUT_ARGS[@]}" "$@")
if [[ "${DRY_RUN:-0}" == 1 ]]; then
  printf '%q ' "${CMD[@]}"
  echo
  exit 0
fi
exec "${CMD[@]}"
