#!/bin/bash
# titanlike on several nodes without a scheduler: run this once on every node, each with its own NODE_RANK.
#
#   node 0:  NNODES=2 NODE_RANK=0 MASTER_ADDR=node0.example.com scripts/slurm/multinode_torchrun.sh CONFIG.toml [flags]
#   node 1:  NNODES=2 NODE_RANK=1 MASTER_ADDR=node0.example.com scripts/slurm/multinode_torchrun.sh CONFIG.toml [flags]
#
# Run it from the repository root, with the same checkout, config and flags on every node. MASTER_ADDR is node 0's
# address (reachable from every node; node 0 serves the rendezvous on MASTER_PORT), NODE_RANK 0..NNODES-1, each
# once. Global ranks are NODE_RANK * GPUS_PER_NODE + local rank, so global rank 0 (the one that logs, holds the run
# lock and writes the config) is on node 0. The run folder must be on storage every node sees (docs/multinode.md).
set -euo pipefail

if [[ $# -lt 1 ]]; then
    echo "usage: NNODES=N NODE_RANK=I MASTER_ADDR=HOST $0 CONFIG.toml [--section.key=value ...]" >&2
    exit 2
fi
CONFIG=$1
shift

: "${NNODES:?set NNODES, the number of nodes}"
: "${NODE_RANK:?set NODE_RANK, this node's index 0..NNODES-1}"
: "${MASTER_ADDR:?set MASTER_ADDR, node 0's host name or address}"
MASTER_PORT=${MASTER_PORT:-29500}
GPUS_PER_NODE=${GPUS_PER_NODE:-$( (nvidia-smi --list-gpus 2>/dev/null || true) | wc -l)}
if [[ -z "$GPUS_PER_NODE" || "$GPUS_PER_NODE" -lt 1 ]]; then
    GPUS_PER_NODE=1
fi
TORCHRUN=${TORCHRUN:-torchrun}        # e.g. TORCHRUN="python -m torch.distributed.run" (word-split on purpose)

export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# NCCL / network settings: as in scripts/slurm/train.sbatch, e.g.
# export NCCL_SOCKET_IFNAME=eth0 GLOO_SOCKET_IFNAME=eth0
# export NCCL_IB_DISABLE=0 NCCL_IB_HCA=mlx5_0:1,mlx5_1:1

# shellcheck disable=SC2086
exec $TORCHRUN \
    --nnodes "$NNODES" \
    --node_rank "$NODE_RANK" \
    --nproc_per_node "$GPUS_PER_NODE" \
    --master_addr "$MASTER_ADDR" \
    --master_port "$MASTER_PORT" \
    scripts/train.py --config "$CONFIG" "$@"
