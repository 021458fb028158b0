#!/bin/bash
# complete_training_pipeline.sh

set -e

WORK_DIR=/workspace/gpt-training
DATA_DIR=$WORK_DIR/data
CHECKPOINT_DIR=$WORK_DIR/checkpoints
LOG_DIR=$WORK_DIR/logs

mkdir -p $DATA_DIR $CHECKPOINT_DIR $LOG_DIR

echo "=== Megatron-LM Complete Training Pipeline ==="

# Step 1: Download and prepare data
echo "Step 1: Preparing data..."
wget -P $DATA_DIR https://data.together.xyz/redpajama-data-1T/v1.0.0/arxiv/arxiv.jsonl

# Step 2: Preprocess data
echo "Step 2: Preprocessing data..."
python tools/preprocess_data.py \
    --input=$DATA_DIR/arxiv.jsonl \
    --output-prefix=$DATA_DIR/arxiv_text_document \
    --tokenizer-type=GPT2BPETokenizer \
    --vocab-file=gpt2-vocab.json \
    --merge-file=gpt2-merges.txt \
    --append-eod \
    --workers=32

# Step 3: Configure environment
echo "Step 3: Configuring environment..."
export NCCL_DEBUG=INFO
export NCCL_IB_DISABLE=0
export CUDA_DEVICE_MAX_CONNECTIONS=1

# Step 4: Launch training
echo "Step 4: Starting training..."

GPUS_PER_NODE=8
NNODES=4
MASTER_ADDR=node01
MASTER_PORT=6000

torchrun \
    --nproc_per_node=$GPUS_PER_NODE \
    --nnodes=$NNODES \
    --node_rank=$SLURM_NODEID \
    --master_addr=$MASTER_ADDR \
    --master_port=$MASTER_PORT \
    pretrain_gpt.py \
    --num-layers=32 \
    --hidden-size=4096 \
    --num-attention-heads=32 \
    --seq-length=2048 \
    --max-position-embeddings=2048 \
    --micro-batch-size=2 \
    --global-batch-size=256 \
    --tensor-model-parallel-size=4 \
    --pipeline-model-parallel-size=2 \
    --sequence-parallel \
    --use-distributed-optimizer \
    --train-iters=100000 \
    --lr=1.5e-4 \
    --min-lr=1.0e-5 \
    --lr-decay-style=cosine \
    --lr-warmup-iters=2000 \
    --weight-decay=0.1 \
    --clip-grad=1.0 \
    --bf16 \
    --use-flash-attn \
    --data-path=$DATA_DIR/arxiv_text_document \
    --split=949,50,1 \
    --tokenizer-type=GPT2BPETokenizer \
    --vocab-file=gpt2-vocab.json \
    --merge-file=gpt2-merges.txt \
    --save=$CHECKPOINT_DIR/gpt-13b \
    --load=$CHECKPOINT_DIR/gpt-13b \
    --save-interval=1000 \
    --eval-interval=100 \
    --eval-iters=10 \
    --log-interval=10 \
    --tensorboard-dir=$LOG_DIR \
    --wandb-project=gpt-13b-arxiv \
    2>&1 | tee $LOG_DIR/training.log

echo "Training complete!"
