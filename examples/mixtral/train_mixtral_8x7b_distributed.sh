#!/bin/bash

# Mixtral 8x7B (32 layers, hidden 4096, 8 experts of ffn 14336, top-2 routing, GQA with 8 groups)
# with Megatron-LM's own example flags, unchanged: aux-loss balancing at 1e-2, grouped GEMMs for the
# experts, the all-to-all token dispatcher, PP=4 x EP=8, distributed optimizer.
#
#   bash examples/mixtral/train_mixtral_8x7b_distributed.sh CKPT_DIR TOKENIZER_MODEL DATA_PREFIX
#
# TOKENIZER_MODEL is the Llama-2 / Mixtral SentencePiece tokenizer.model; DATA_PREFIX the output of
#   python tools/preprocess_data.py --input corpus.jsonl --output-prefix data/corpus \
#       --tokenizer-type Llama2Tokenizer --tokenizer-model tokenizer.model --append-eod --workers 8
#   -> data/corpus_text_document.bin/.idx  (DATA_PREFIX=data/corpus_text_document)
# Expert parallelism folds over the data x tensor ranks of each pipeline stage, so EP=8 with PP=4
# needs 8 ranks per stage: 32 GPUs (4 nodes of 8). On one node of 8 use PP=1 EP=8 or PP=2 EP=4
# (PP=2 EP=4 leaves ZeRO-1 over the 4 data-parallel ranks of each stage for the dense weights).
# To start from Hugging Face Mixtral weights instead, convert them first:
#   python tools/convert_hf_to_checkpoint.py --hf-path Mixtral-8x7B-v0.1 --save $CHECKPOINT_PATH
# which prints the model flags below (the checkpoint loads under any PP x EP layout).

export CUDA_DEVICE_MAX_CONNECTIONS=1

GPUS_PER_NODE=${GPUS_PER_NODE:-8}
# Change for multinode config
MASTER_ADDR=${MASTER_ADDR:-"localhost"}
MASTER_PORT=${MASTER_PORT:-"29500"}
NNODES=${SLURM_NNODES:-"1"}
NODE_RANK=${RANK:-"0"}
PP=${PP:-4}
EP=${EP:-8}

CHECKPOINT_PATH=$1
TOKENIZER_MODEL=$2
DATA_PATH=$3

DISTRIBUTED_ARGS=(
    --nproc_per_node $GPUS_PER_NODE
    --nnodes $NNODES
    --node_rank $NODE_RANK
    --master_addr $MASTER_ADDR
    --master_port $MASTER_PORT
)

MODEL_ARGS=(
    --use-mcore-models
    --disable-bias-linear
    --seq-length 4096
    --max-position-embeddings 32768
    --num-layers 32
    --hidden-size 4096
    --ffn-hidden-size 14336
    --num-attention-heads 32
    --init-method-std 0.01
    --attention-dropout 0.0
    --hidden-dropout 0.0
    --normalization RMSNorm
    --position-embedding-type rope
    --swiglu
    --untie-embeddings-and-output-weights
    --group-query-attention
    --num-query-groups 8
    --no-masked-softmax-fusion
    --no-position-embedding
    --rotary-base 1000000
)

MOE_ARGS=(
    --num-experts 8
    --moe-router-topk 2
    --moe-router-load-balancing-type aux_loss
    --moe-aux-loss-coeff 1e-2
    --moe-grouped-gemm
    --moe-token-dispatcher-type alltoall
    --overlap-param-gather
    --overlap-grad-reduce
)

DATA_ARGS=(
    --tokenizer-type Llama2Tokenizer
    --tokenizer-model ${TOKENIZER_MODEL}
    --data-path $DATA_PATH
    --split 99990,8,2
)

TRAINING_ARGS=(
    --micro-batch-size 1
    --global-batch-size 256
    --lr 1e-4
    --train-iters 500000
    --lr-decay-iters 320000
    --lr-decay-style cosine
    --min-lr 1.0e-5
    --weight-decay 0.1
    --lr-warmup-iters 500
    --clip-grad 1.0
    --bf16
)

MODEL_PARALLEL_ARGS=(
    --tensor-model-parallel-size 1
    --pipeline-model-parallel-size $PP
    --expert-model-parallel-size $EP
    --use-distributed-optimizer
    --sequence-parallel
)

LOGGING_ARGS=(
    --log-interval 1
    --save-interval 10000
    --eval-interval 1000
    --eval-iters 10
    --save $CHECKPOINT_PATH
    --load $CHECKPOINT_PATH
    --tensorboard-dir "${CHECKPOINT_PATH}/tensorboard"
    --no-load-optim
    --no-load-rng
)

if [ -n "${WANDB_API_KEY}" ]; then
    LOGGING_ARGS+=(
        --wandb-project ${WANDB_PROJECT:-"Mixtral"}
        --wandb-exp-name ${WANDB_NAME:-"Mixtral_8x7B"}
    )
fi

torchrun ${DISTRIBUTED_ARGS[@]} pretrain_gpt.py \
    ${MODEL_ARGS[@]} \
    ${MOE_ARGS[@]} \
    ${DATA_ARGS[@]} \
    ${TRAINING_ARGS[@]} \
    ${MODEL_PARALLEL_ARGS[@]} \
    ${LOGGING_ARGS[@]}
