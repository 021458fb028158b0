#!/bin/bash
# multi_datacenter_training.sh

# Data Center 1 (Primary)
export MASTER_ADDR=dc1-node01.example.com
export MASTER_PORT=6000
export DATACENTER_ID=dc1
export NCCL_CROSS_DC=1

# Configure inter-DC networking
export NCCL_IB_HCA=mlx5_0:1,mlx5_1:1
export NCCL_IB_TC=106
export NCCL_IB_QPS_PER_CONN=4

# Data Center 2 (Secondary)
# Run with same MASTER_ADDR, different node rank

torchrun \
    --nproc_per_node=8 \
    --nnodes=16 \
    --node_rank=$NODE_RANK \
    --master_addr=$MASTER_ADDR \
    --master_port=$MASTER_PORT \
    pretrain_gpt.py \
    --tensor-model-parallel-size=8 \
    --pipeline-model-parallel-size=4 \
    --data-parallel-size=32 \
    --micro-batch-size=1 \
    --global-batch-size=512 \
    --datacenter-id=$DATACENTER_ID \
    [... model config ...]
