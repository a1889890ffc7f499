#!/usr/bin/env bash
# One node, 8 GPUs: a LLaMA-style 1.2B model on 32k-token sequences. Context parallel 4 (each GPU
# holds 8k tokens of every sequence) x data parallel 2, distributed optimizer, bf16, selective
# recomputation. Usage: examples/pretrain_llama_long_context_cp.sh DATA_PREFIX TOKENIZER_DIR SAVE_DIR
set -euo pipefail
DATA=${1:?data prefix, e.g. my-corpus_text_document}
TOKENIZER=${2:?a local Hugging Face tokenizer folder or tokenizer.json}
SAVE=${3:?checkpoint directory}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}

torchrun --nproc_per_node "$GPUS_PER_NODE" pretrain_gpt.py \
    --context-parallel-size 4 --use-distributed-optimizer \
    --num-layers 16 --hidden-size 2048 --num-attention-heads 32 --group-query-attention --num-query-groups 8 \
    --ffn-hidden-size 8192 --swiglu --position-embedding-type rope --rotary-base 500000 \
    --normalization RMSNorm --untie-embeddings-and-output-weights --disable-bias-linear \
    --seq-length 32768 --max-position-embeddings 32768 --micro-batch-size 1 --global-batch-size 64 \
    --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters 200 --train-iters 10000 \
    --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --clip-grad 1.0 --bf16 \
    --recompute-granularity selective --calculate-per-token-loss --eod-mask-loss \
    --data-path "$DATA" --split 990,9,1 --tokenizer-type HuggingFaceTokenizer --tokenizer-model "$TOKENIZER" \
    --log-interval 10 --eval-interval 500 --eval-iters 5 \
    --save "$SAVE" --load "$SAVE" --save-interval 500 --async-save --tensorboard-dir "$SAVE/tensorboard"
