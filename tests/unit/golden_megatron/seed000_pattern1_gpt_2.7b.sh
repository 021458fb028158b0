#!/bin/bash
# train_gpt_basic.sh

GPUS_PER_NODE=8
NNODES=1
NODE_RANK=0
MASTER_ADDR=localhost
MASTER_PORT=6000

# Distributed setup
DISTRIBUTED_ARGS="
    --nproc_per_node=$GPUS_PER_NODE \
    --nnodes=$NNODES \
    --node_rank=$NODE_RANK \
    --master_addr=$MASTER_ADDR \
    --master_port=$MASTER_PORT
"

# GPT-3 2.7B configuration
python -m torch.distributed.launch $DISTRIBUTED_ARGS \
    pretrain_gpt.py \
    --num-layers=32 \
    --hidden-size=2560 \
    --num-attention-heads=32 \
    --seq-length=2048 \
    --max-position-embeddings=2048 \
    --micro-batch-size=4 \
    --global-batch-size=32 \
    --tensor-model-parallel-size=2 \
    --pipeline-model-parallel-size=1 \
    --train-iters=100000 \
    --lr=1.5e-4 \
    --min-lr=1.0e-5 \
    --lr-decay-style=cosine \
    --lr-warmup-iters=2000 \
    --weight-decay=0.1 \
    --clip-grad=1.0 \
    --bf16 \
    --data-path=/data/my-gpt3_text_document \
    --split=949,50,1 \
    --tokenizer-type=GPT2BPETokenizer \
    --vocab-file=gpt2-vocab.json \
    --merge-file=gpt2-merges.txt \
    --save=/checkpoints/gpt-2.7b \
    --load=/checkpoints/gpt-2.7b \
    --save-interval=1000 \
    --eval-interval=100 \
    --eval-iters=10 \
    --log-interval=10 \
    --tensorboard-dir=/logs/gpt-2.7b
