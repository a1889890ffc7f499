#!/usr/bin/env bash
# Several nodes with torchrun: run this script once on every node with its NODE_RANK.
#   MASTER_ADDR=node0 NNODES=4 NODE_RANK=0 examples/pretrain_gpt_multi_node.sh DATA VOCAB MERGES SAVE   # on node0
#   MASTER_ADDR=node0 NNODES=4 NODE_RANK=1 examples/pretrain_gpt_multi_node.sh DATA VOCAB MERGES SAVE   # on node1 ...
# Tensor parallel stays inside a node (TP=8 on 8 GPUs); data parallel spans the nodes with ZeRO-3.
set -euo pipefail
DATA=${1:?data prefix}
VOCAB=${2:?gpt2-vocab.json}
MERGES=${3:?gpt2-merges.txt}
SAVE=${4:?checkpoint directory on a shared file system}
: "${MASTER_ADDR:?set MASTER_ADDR to the first node}" "${NNODES:?set NNODES}" "${NODE_RANK:?set NODE_RANK}"
MASTER_PORT=${MASTER_PORT:-29500}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}

torchrun --nnodes "$NNODES" --node_rank "$NODE_RANK" --nproc_per_node "$GPUS_PER_NODE" \
    --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT" pretrain_gpt.py \
    --tensor-model-parallel-size "$GPUS_PER_NODE" --sequence-parallel --zero-stage 3 --overlap-param-gather \
    --num-layers 32 --hidden-size 4096 --num-attention-heads 32 --group-query-attention --num-query-groups 8 \
    --seq-length 4096 --max-position-embeddings 4096 --position-embedding-type rope --normalization RMSNorm \
    --swiglu --disable-bias-linear --untie-embeddings-and-output-weights \
    --micro-batch-size 1 --global-batch-size 512 --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine \
    --lr-warmup-iters 2000 --train-iters 100000 --clip-grad 1.0 --bf16 \
    --recompute-granularity full --recompute-method block --recompute-num-layers 8 \
    --data-path "$DATA" --split 969,30,1 --tokenizer-type GPT2BPETokenizer \
    --vocab-file "$VOCAB" --merge-file "$MERGES" --distributed-timeout-minutes 30 \
    --log-interval 10 --eval-interval 2000 --eval-iters 10 --save "$SAVE" --load "$SAVE" --save-interval 2000
