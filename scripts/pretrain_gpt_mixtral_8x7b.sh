#!/usr/bin/env bash
# Mixtral 8x7B (46.7B parameters, 12.9B active per token: 32 layers, hidden 4096, 32 heads in 8 KV
# groups, 8 SwiGLU experts of 14336 per layer, top-2 routing, vocabulary 32000), on 8 nodes of 8
# GPUs: TP 2 (sequence parallel) x PP 4 x EP 8 with expert-TP 1, ZeRO-1, bf16, dropless all-to-all
# dispatch with grouped GEMM. Run this script on every node (torchrun, one process per GPU):
#
#   NNODES=8 NODE_RANK=$i MASTER_ADDR=node0 DATA_PATH=data/corpus_text_document \
#       TOKENIZER_MODEL=tokenizers/mixtral bash scripts/pretrain_gpt_mixtral_8x7b.sh [more flags]
#
# Flags given after the script name come last, so they override the ones below. Optional:
# NPROC_PER_NODE (default 8), MASTER_PORT (29500), CHECKPOINT_DIR (checkpoints/mixtral_8x7b),
# TRAIN_ITERS, DRY_RUN=1 (print the command instead of running it). Start from Mixtral's weights
# with tools/convert_hf_to_megalite.py, or train from scratch.
set -euo pipefail
cd "$(dirname "$0")/.."
: "${DATA_PATH:?set DATA_PATH to a preprocessed prefix, e.g. data/corpus_text_document}"
: "${TOKENIZER_MODEL:?set TOKENIZER_MODEL to a local tokenizer folder or tokenizer.json}"
NNODES=${NNODES:-8}
NODE_RANK=${NODE_RANK:-0}
NPROC_PER_NODE=${NPROC_PER_NODE:-8}
CHECKPOINT_DIR=${CHECKPOINT_DIR:-checkpoints/mixtral_8x7b}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

MODEL_ARGS=(  # Mixtral: RoPE base 1e6, RMSNorm, SwiGLU experts, GQA, no biases, untied embeddings
  --num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32
  --group-query-attention --num-query-groups 8 --kv-channels 128
  --seq-length 4096 --max-position-embeddings 32768
  --position-embedding-type rope --rotary-base 1000000 --normalization RMSNorm --norm-epsilon 1e-5
  --swiglu --disable-bias-linear --untie-embeddings-and-output-weights
  --hidden-dropout 0.0 --attention-dropout 0.0 --init-method-std 0.02
)
MOE_ARGS=(  # 8 experts per layer, top-2 softmax routing, switch aux loss, dropless
  --num-experts 8 --moe-ffn-hidden-size 14336 --moe-router-topk 2
  --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-2
  --moe-token-dispatcher-type alltoall --moe-grouped-gemm
)
PARALLEL_ARGS=(
  --tensor-model-parallel-size 2 --sequence-parallel --pipeline-model-parallel-size 4
  --expert-model-parallel-size 8 --expert-tensor-parallel-size 1 --use-distributed-optimizer
)
TRAINING_ARGS=(  # 512 x 4096 = 2M tokens per step
  --micro-batch-size 1 --global-batch-size 512 --train-iters "${TRAIN_ITERS:-250000}"
  --lr 1e-4 --min-lr 1e-5 --lr-decay-style cosine --lr-warmup-iters 2000
  --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --clip-grad 1.0 --bf16 --seed 1234
  --recompute-activations
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
CMD=(torchrun --nnodes "$NNODES" --node-rank "$NODE_RANK" --nproc-per-node "$NPROC_PER_NODE"
     --master-addr "${MASTER_ADDR:-localhost}" --master-port "${MASTER_PORT:-29500}"
     pretrain_gpt.py "${MODEL_ARGS[@]}" "${MOE_ARGS[@]}" "${PARALLEL_ARGS[@]}"
     "${TRAINING_ARGS[@]}" "${DATA_ARGS[@]}" "${OUTPUT_ARGS[@]}" "$@")
if [[ "${DRY_RUN:-0}" == 1 ]]; then
  printf '%q ' "${CMD[@]}"
  echo
  exit 0
fi
exec "${CMD[@]}"
