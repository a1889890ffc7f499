#!/usr/bin/env bash
# One node, 8 GPUs: the Llama-3 8B shape with fp8 matmuls (torchao; `pip install 'megatrain[fp8]'`),
# as in Megatron-LM's examples/llama/train_llama3_8b_h100_fp8.sh: ZeRO-3 (FSDP2) over 8 GPUs,
# per-token loss, a separate learning rate for the embedding and output layer, manual GC.
# Usage: examples/pretrain_llama3_8b_fp8.sh DATA_PREFIX TOKENIZER_DIR SAVE_DIR
set -euo pipefail
DATA=${1:?data prefix, e.g. my-corpus_text_document}
TOKENIZER=${2:?a local Hugging Face tokenizer folder or tokenizer.json}
SAVE=${3:?checkpoint directory}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}

torchrun --nproc_per_node "$GPUS_PER_NODE" pretrain_gpt.py \
    --zero-stage 3 \
    --num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32 \
    --group-query-attention --num-query-groups 8 --kv-channels 128 \
    --seq-length 8192 --max-position-embeddings 8192 --position-embedding-type rope --rotary-base 1000000 \
    --swiglu --normalization RMSNorm --untie-embeddings-and-output-weights --disable-bias-linear \
    --init-method-std 0.0134 --attention-dropout 0.0 --hidden-dropout 0.0 \
    --micro-batch-size 1 --global-batch-size 128 --train-samples 1953125000 \
    --lr-decay-samples 1949218748 --lr-warmup-samples 3906252 --lr 0.00015 --min-lr 0.00001 \
    --decoupled-lr 5.0e-4 --decoupled-min-lr 4.5e-5 --lr-decay-style cosine \
    --clip-grad 1.0 --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 \
    --bf16 --fp8-format hybrid --calculate-per-token-loss --manual-gc --manual-gc-interval 100 \
    --recompute-granularity selective \
    --data-path "$DATA" --split 99,1,0 --tokenizer-type HuggingFaceTokenizer --tokenizer-model "$TOKENIZER" \
    --log-interval 1 --eval-interval 100 --eval-iters 32 \
    --save "$SAVE" --load "$SAVE" --save-interval 1000 --async-save --tensorboard-dir "$SAVE/tensorboard"
