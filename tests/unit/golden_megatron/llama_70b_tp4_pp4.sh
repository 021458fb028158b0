# Seed 001 "Workflow 1" train_llama_70b.sh with its variables expanded (TP=4 PP=4 CP=1, 8 nodes x 8 GPUs = 64).
# Its flags name no RoPE/SwiGLU/RMSNorm, so the translator reads a GPT-style model (and names the closest flavor).
torchrun \
  --nproc_per_node=8 \
  --nnodes=8 \
  pretrain_gpt.py \
  --tensor-model-parallel-size 4 \
  --pipeline-model-parallel-size 4 \
  --context-parallel-size 1 \
  --sequence-parallel \
  --num-layers 80 \
  --hidden-size 8192 \
  --num-attention-heads 64 \
  --seq-length 4096 \
  --max-position-embeddings 4096 \
  --micro-batch-size 1 \
  --global-batch-size 1024 \
  --lr 3e-4 \
  --train-iters 100000 \
  --lr-decay-style cosine \
  --lr-warmup-iters 2000 \
  --weight-decay 0.1 \
  --clip-grad 1.0 \
  --bf16 \
  --use-mcore-models \
  --transformer-impl transformer_engine \
  --data-path /path/to/data \
  --vocab-file /path/to/vocab.json \
  --merge-file /path/to/merges.txt
