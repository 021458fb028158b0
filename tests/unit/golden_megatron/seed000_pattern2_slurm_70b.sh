#!/bin/bash
#SBATCH --job-name=megatron-gpt
#SBATCH --nodes=16
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --time=48:00:00
#SBATCH --output=logs/%j.out
#SBATCH --error=logs/%j.err

# Get node information
export MASTER_ADDR=$(scontrol show hostnames $SLURM_JOB_NODELIST | head -n 1)
export MASTER_PORT=6000
export WORLD_SIZE=$((SLURM_NNODES * 8))

echo "MASTER_ADDR: $MASTER_ADDR"
echo "WORLD_SIZE: $WORLD_SIZE"
echo "SLURM_PROCID: $SLURM_PROCID"

# Configure NCCL
export NCCL_DEBUG=INFO
export NCCL_IB_HCA=mlx5_0:1,mlx5_1:1
export NCCL_IB_DISABLE=0

# GPT-3 70B configuration with 3D parallelism
srun --mpi=pmix python pretrain_gpt.py \
    --num-layers=80 \
    --hidden-size=8192 \
    --num-attention-heads=64 \
    --seq-length=2048 \
    --max-position-embeddings=2048 \
    --micro-batch-size=1 \
    --global-batch-size=128 \
    --tensor-model-parallel-size=8 \
    --pipeline-model-parallel-size=4 \
    --sequence-parallel \
    --use-distributed-optimizer \
    --train-iters=100000 \
    --lr=1.0e-4 \
    --min-lr=1.0e-5 \
    --lr-decay-style=cosine \
    --lr-warmup-iters=2000 \
    --weight-decay=0.1 \
    --clip-grad=1.0 \
    --bf16 \
    --data-path=/scratch/data/pile_text_document \
    --split=949,50,1 \
    --tokenizer-type=GPT2BPETokenizer \
    --vocab-file=/data/vocab/gpt2-vocab.json \
    --merge-file=/data/vocab/gpt2-merges.txt \
    --save=/scratch/checkpoints/gpt-70b \
    --load=/scratch/checkpoints/gpt-70b \
    --save-interval=500 \
    --eval-interval=100 \
    --eval-iters=10 \
    --log-interval=1 \
    --tensorboard-dir=/scratch/logs/gpt-70b \
    --wandb-project=gpt-70b-training \
    --distributed-backend=nccl
