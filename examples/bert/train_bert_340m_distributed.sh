#!/bin/bash

# BERT-large (340M parameters) with Megatron-LM's own example flags, unchanged: 24 layers, hidden 1024,
# 16 heads, sequence 512, fp16, tensor and pipeline parallelism.
#
#   bash examples/bert/train_bert_340m_distributed.sh CKPT_DIR TB_DIR VOCAB_FILE DATA_PREFIX
#
# DATA_PREFIX is sentence-level data, as tools/preprocess_data.py writes it with --split-sentences:
#   python tools/preprocess_data.py --input corpus.jsonl --output-prefix data/corpus \
#       --tokenizer-type BertWordPieceLowerCase --vocab-file bert-vocab.txt --split-sentences --workers 8
#   -> data/corpus_text_sentence.bin/.idx  (DATA_PREFIX=data/corpus_text_sentence)
# On one 8-GPU node set TP x PP to fit the node, e.g. GPUS_PER_NODE=8 with TP=2 PP=2 (DP=2).

export CUDA_DEVICE_MAX_CONNECTIONS=1

GPUS_PER_NODE=${GPUS_PER_NODE:-8}
# Change for multinode config
MASTER_ADDR=${MASTER_ADDR:-localhost}
MASTER_PORT=${MASTER_PORT:-29500}
NUM_NODES=${NUM_NODES:-1}
NODE_RANK=${NODE_RANK:-0}
TP=${TP:-2}
PP=${PP:-2}

CHECKPOINT_PATH=$1
TENSORBOARD_LOGS_PATH=$2
VOCAB_FILE=$3
DATA_PATH=$4

DISTRIBUTED_ARGS=(
    --nproc_per_node $GPUS_PER_NODE
    --nnodes $NUM_NODES
    --node_rank $NODE_RANK
    --master_addr $MASTER_ADDR
    --master_port $MASTER_PORT
)

BERT_MODEL_ARGS=(
    --num-layers 24
    --hidden-size 1024
    --num-attention-heads 16
    --seq-length 512
    --max-position-embeddings 512
    --attention-backend auto
)

TRAINING_ARGS=(
    --micro-batch-size 4
    --global-batch-size 32
    --train-iters 1000000
    --weight-decay 1e-2
    --clip-grad 1.0
    --fp16
    --lr 0.0001
    --lr-decay-iters 990000
    --lr-decay-style linear
    --min-lr 1.0e-5
    --lr-warmup-fraction .01
)

MODEL_PARALLEL_ARGS=(
    --tensor-model-parallel-size $TP
    --pipeline-model-parallel-size $PP
)

DATA_ARGS=(
    --data-path $DATA_PATH
    --vocab-file $VOCAB_FILE
    --split 949,50,1
)

EVAL_AND_LOGGING_ARGS=(
    --log-interval 100
    --save-interval 10000
    --eval-interval 1000
    --save $CHECKPOINT_PATH
    --load $CHECKPOINT_PATH
    --eval-iters 10
    --tensorboard-dir $TENSORBOARD_LOGS_PATH
)

torchrun ${DISTRIBUTED_ARGS[@]} pretrain_bert.py \
    ${BERT_MODEL_ARGS[@]} \
    ${TRAINING_ARGS[@]} \
    ${MODEL_PARALLEL_ARGS[@]} \
    ${DATA_ARGS[@]} \
    ${EVAL_AND_LOGGING_ARGS[@]}
