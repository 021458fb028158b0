#!/bin/bash
# The peer of scripts/bench/benchmark.py (`--peer auto`): torchtitan 0.2.2 on local synthetic inputs.
#
# usage, on the GPU machine from the repository root, after installing the wheels (.whl/ and .peer/, filled by
# scripts/bench/fetch_wheels.sh --peer) into /tmp/site:
#   NPROC=2 MODEL=llama3 bash scripts/bench/peer_torchtitan.sh FLAVOR [torchtitan flags...]
#   NPROC=2 bash scripts/bench/peer_torchtitan.sh 8B_4L --training.seq_len 8192 --activation_checkpoint.mode selective \
#       --compile.enable
#   MODEL=qwen3 bash scripts/bench/peer_torchtitan.sh 30B-A3B_4L --training.local_batch_size 1
#
# NPROC: processes (GPUs), default 1. MODEL: torchtitan's --model.name, default llama3.
# Flavors: torchtitan's own plus llama3 1B (Llama-3.2-1B shape) and 8B_4L, qwen3 30B-A3B_4L, deepseek_v3 16B_4L
# (4-layer cuts); see peer_torchtitan.py. Defaults: local batch 2, seq 4096, 15 steps, 2 warm-up steps, a log line
# every step, output under $TMPDIR/ttout (/tmp by default); flags given here come later and so win.
# Prints only torchtitan's per-step lines ("step: ... loss: ... memory: ...GiB ... tps: ..."; tps is tokens/s per
# GPU, every rank prints its own) and error lines; exits with torchrun's status.
set -eo pipefail
here=$(cd "$(dirname "$0")" && pwd)
flavor=${1:?usage: NPROC=N MODEL=NAME bash $0 FLAVOR [torchtitan flags...]}
shift
# /tmp/site holds the wheels torchtitan needs; nothing may reach for the network (the GPU machine has none).
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
# --standalone: a free rendezvous port, so a run killed at benchmark.py's timeout cannot block the next one's.
torchrun --standalone --nproc_per_node "${NPROC:-1}" "$here/peer_torchtitan.py" --work "${TMPDIR:-/tmp}/ttwork" -- \
  --model.name "${MODEL:-llama3}" --model.flavor "$flavor" \
  --training.local_batch_size 2 --training.seq_len 4096 --training.steps 15 --lr_scheduler.warmup_steps 2 \
  --metrics.log_freq 1 --job.dump_folder "${TMPDIR:-/tmp}/ttout" "$@" 2>&1 |
  # Line-buffered, so a run killed at a timeout still hands over the steps it logged. Every step line stays (the
  # benchmark needs the first ones for the compile time); error lines stop at 40, as every rank repeats them.
  { grep --line-buffered -E "step:|Error|Traceback" || true; } |
  awk '/step:/ || errors++ < 40 { print; fflush() }'
