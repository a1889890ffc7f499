#!/usr/bin/env bash
# The classic 8-GPU example of the Megatron-LM guides: GPT-2 124M shape (12 layers, hidden 768,
# 12 heads, seq 1024) with tensor parallel 4 x pipeline parallel 2, micro-batch 8, global batch 128,
# activation recomputation, fp16 (replace --fp16 by --bf16 for bf16). Run from the repository root:
#   examples/pretrain_gpt_tp4_pp2.sh DATA_PREFIX gpt2-vocab.json gpt2-merges.txt CHECKPOINT_DIR
# Run it again with the same arguments to resume from the newest checkpoint.
set -euo pipefail
DATA=${1:?data prefix, e.g. data/my-gpt2_text_document}
VOCAB=${2:?gpt2-vocab.json}
MERGES=${3:?gpt2-merges.txt}
SAVE=${4:?checkpoint directory}

torchrun --nproc_per_node 8 pretrain_gpt.py \
    --tensor-model-parallel-size 4 --pipeline-model-parallel-size 2 \
    --num-layers 12 --hidden-size 768 --num-attention-heads 12 \
    --seq-length 1024 --max-position-embeddings 1024 \
    --micro-batch-size 8 --global-batch-size 128 \
    --lr 6.0e-4 --min-lr 6.0e-5 --lr-decay-style cosine --lr-warmup-fraction 0.01 \
    --train-iters 500000 --lr-decay-iters 320000 --weight-decay 0.1 --clip-grad 1.0 \
    --adam-beta1 0.9 --adam-beta2 0.95 --init-method-std 0.006 \
    --checkpoint-activations --fp16 \
    --data-path "$DATA" --split 949,50,1 --tokenizer-type GPT2BPETokenizer \
    --vocab-file "$VOCAB" --merge-file "$MERGES" \
    --log-interval 100 --eval-interval 1000 --eval-iters 10 \
    --save "$SAVE" --load "$SAVE" --save-interval 1000
