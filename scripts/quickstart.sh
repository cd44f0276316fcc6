#!/usr/bin/env bash
# The quickstart: megalite's whole pipeline on a small model, nothing to set up or download.
#
#   bash scripts/quickstart.sh            # about 5-8 minutes on a 2-core laptop CPU
#
# 1. installs what is missing into the active Python (torch 2.13.0, megalite and its extras);
# 2. writes a corpus from this Python's standard library (one .py file = one document, jsonl);
# 3. trains a SentencePiece tokenizer on it and preprocesses it into Megatron's .bin/.idx;
# 4. pretrains a small Llama-style GPT with TP 2 x PP 2 and the distributed optimizer, 4 processes
#    under torchrun: on CPU (gloo), or on GPUs (nccl) when there are any (4+ GPUs: TP 2 x PP 2;
#    2-3: TP 2; 1: one process), printing the loss every 10 iterations and TensorBoard logs;
# 5. converts the last checkpoint to a HuggingFace LlamaForCausalLM and prints what transformers
#    generates from it.
# Everything goes under one folder (OUT_DIR, default runs/quickstart-<time>), named at the end.
# Knobs: OUT_DIR, TRAIN_ITERS, TRAIN_MINUTES (a cap on the training time, 3), PYTHON.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
START=$(date +%s)
step() { printf '\n== [%4ss] %s\n' "$(($(date +%s) - START))" "$*"; }

step "checking the Python environment ($("$PY" --version 2>&1))"
# torch: exactly 2.13.0 when absent (an open range would pull GBs of CUDA wheels on some indexes).
if ! "$PY" -c "import torch" 2>/dev/null; then
  "$PY" -m pip install -q "torch==2.13.0"
fi
# -I: not from this folder, so the check finds megalite only where the tools will (installed)
if ! "$PY" -I - <<'PY' 2>/dev/null; then
import importlib, megalite  # noqa
for m in ("numpy", "sentencepiece", "tensorboard", "transformers", "safetensors", "tokenizers"):
    importlib.import_module(m)
PY
  "$PY" -m pip install -q -e ".[hf]"
fi

OUT=${OUT_DIR:-runs/quickstart-$(date +%Y%m%d-%H%M%S)}
mkdir -p "$OUT"/{data,tokenizer,logs}
OUT=$(cd "$OUT" && pwd)
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

step "1/5 corpus: the standard library's .py files, one document each"
"$PY" tools/make_stdlib_corpus.py --output "$OUT/data/stdlib.jsonl"

step "2/5 tokenizer: SentencePiece BPE, 4096 pieces"
"$PY" tools/train_tokenizer.py --input "$OUT/data/stdlib.jsonl" --model-prefix \
  "$OUT/tokenizer/stdlib" --vocab-size 4096 --input-sentence-size 200000 --num-threads 2 \
  --keep-whitespace \
  2>&1 | tail -n 1

step "3/5 preprocessing into .bin/.idx"
"$PY" tools/preprocess_data.py --input "$OUT/data/stdlib.jsonl" --output-prefix "$OUT/data/stdlib" \
  --tokenizer-type SentencePieceTokenizer --tokenizer-model "$OUT/tokenizer/stdlib.model" \
  --append-eod --workers 2 --log-interval 1000000 2>&1 | tail -n 2

NGPU=$("$PY" -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)")
if ((NGPU >= 4)); then
  NPROC=4 TP=2 PP=2 DEVICE=cuda ITERS=${TRAIN_ITERS:-2000}
elif ((NGPU >= 2)); then
  NPROC=2 TP=2 PP=1 DEVICE=cuda ITERS=${TRAIN_ITERS:-2000}
elif ((NGPU == 1)); then
  NPROC=1 TP=1 PP=1 DEVICE=cuda ITERS=${TRAIN_ITERS:-2000}
else
  NPROC=4 TP=2 PP=2 DEVICE=cpu ITERS=${TRAIN_ITERS:-300}
fi
step "4/5 pretraining on $DEVICE: $NPROC processes, TP $TP x PP $PP, distributed optimizer," \
  "$ITERS iterations (at most ${TRAIN_MINUTES:-3} minutes)"
MODEL=(  # Llama-style: RoPE, RMSNorm, SwiGLU, grouped-query attention, untied output layer
  --num-layers 4 --hidden-size 128 --ffn-hidden-size 384 --num-attention-heads 4
  --group-query-attention --num-query-groups 2 --seq-length 128 --max-position-embeddings 128
  --position-embedding-type rope --normalization RMSNorm --swiglu --disable-bias-linear
  --untie-embeddings-and-output-weights --hidden-dropout 0 --attention-dropout 0
)
"$PY" -m torch.distributed.run --standalone --nproc-per-node "$NPROC" pretrain_gpt.py "${MODEL[@]}" \
  --tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP" \
  --use-distributed-optimizer --device "$DEVICE" \
  --micro-batch-size 4 --global-batch-size 16 --train-iters "$ITERS" \
  --lr 3e-3 --min-lr 3e-4 --lr-decay-style cosine --lr-warmup-iters 20 --weight-decay 0.1 \
  --clip-grad 1.0 --seed 1234 \
  --data-path "$OUT/data/stdlib_text_document" --split 98,2,0 \
  --tokenizer-type SentencePieceTokenizer --tokenizer-model "$OUT/tokenizer/stdlib.model" \
  --log-interval 10 --eval-interval 100 --eval-iters 10 --tensorboard-dir "$OUT/tensorboard" \
  --save "$OUT/checkpoints" --save-interval 100 --exit-duration-in-mins "${TRAIN_MINUTES:-3}" \
  --exit-signal-handler 2>&1 | grep --line-buffered -v -e '^W[0-9]* ' -e '^\*\*\*' \
  | tee "$OUT/logs/pretrain.log"

step "5/5 converting the checkpoint to HuggingFace, then generating with transformers"
"$PY" tools/convert_checkpoint_to_hf.py --load "$OUT/checkpoints" --save "$OUT/hf" --verify \
  2>&1 | grep -v -e 'deprecated' -e 'Loading weights' | tee "$OUT/logs/convert.log"
echo
"$PY" tools/generate_hf.py --model "$OUT/hf" --max-new-tokens 40 2>&1 | tee "$OUT/logs/generate.log"

# "lm loss X at iteration N" from the first and the last progress line
LOSSES=$(grep -o 'iteration *[0-9]*/.*| lm loss: [0-9.E+-]*' "$OUT/logs/pretrain.log" \
  | sed -E 's#iteration *([0-9]+)/.*lm loss: (.*)#\2 at iteration \1#')
step "done in $(($(date +%s) - START)) s; everything is in $OUT"
echo "   lm loss $(head -n 1 <<<"$LOSSES") -> $(tail -n 1 <<<"$LOSSES"); checkpoint of" \
  "iteration $(cat "$OUT/checkpoints/latest_checkpointed_iteration.txt") converted to hf/"
echo "   data/       corpus (jsonl) and its .bin/.idx     tokenizer/  stdlib.model"
echo "   checkpoints/ megalite checkpoints (Megatron layout)  hf/  the HuggingFace model"
echo "   tensorboard/ run: tensorboard --logdir $OUT/tensorboard"
echo "   logs/        pretrain.log, convert.log, generate.log"
