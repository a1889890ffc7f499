#!/usr/bin/env bash
# One node, 8 GPUs: tensor parallel 2 x data parallel 4, sequence parallel, distributed optimizer (ZeRO-1/2),
# bf16, selective recomputation. Usage: examples/pretrain_gpt_single_node.sh DATA_PREFIX VOCAB MERGES SAVE_DIR
set -euo pipefail
DATA=${1:?data prefix, e.g. my-corpus_text_document}
VOCAB=${2:?gpt2-vocab.json}
MERGES=${3:?gpt2-merges.txt}
SAVE=${4:?checkpoint directory}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}

torchrun --nproc_per_node "$GPUS_PER_NODE" pretrain_gpt.py \
    --tensor-model-parallel-size 2 --sequence-parallel \
    --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather \
    --num-layers 24 --hidden-size 2048 --num-attention-heads 16 --seq-length 2048 \
    --max-position-embeddings 2048 --micro-batch-size 4 --global-batch-size 256 \
    --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters 500 --train-iters 20000 \
    --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --clip-grad 1.0 --bf16 \
    --recompute-granularity selective \
    --data-path "$DATA" --split 969,30,1 --tokenizer-type GPT2BPETokenizer \
    --vocab-file "$VOCAB" --merge-file "$MERGES" \
    --log-interval 10 --eval-interval 1000 --eval-iters 10 \
    --save "$SAVE" --load "$SAVE" --save-interval 1000 --tensorboard-dir "$SAVE/tensorboard"
