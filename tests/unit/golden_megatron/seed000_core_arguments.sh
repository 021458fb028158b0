# Basic configuration
DISTRIBUTED_ARGS="
    --nproc_per_node=8 \
    --nnodes=2 \
    --node_rank=$NODE_RANK \
    --master_addr=$MASTER_ADDR \
    --master_port=$MASTER_PORT
"

# Model architecture
MODEL_ARGS="
    --num-layers=32 \
    --hidden-size=4096 \
    --num-attention-heads=32 \
    --seq-length=2048 \
    --max-position-embeddings=2048 \
    --micro-batch-size=4 \
    --global-batch-size=128
"

# Parallelism configuration
PARALLEL_ARGS="
    --tensor-model-parallel-size=4 \
    --pipeline-model-parallel-size=2 \
    --sequence-parallel \
    --use-distributed-optimizer
"

# Training parameters
TRAINING_ARGS="
    --train-iters=100000 \
    --lr=1.5e-4 \
    --min-lr=1.0e-5 \
    --lr-decay-style=cosine \
    --lr-warmup-iters=2000 \
    --weight-decay=0.1 \
    --clip-grad=1.0 \
    --bf16  # or --fp16
"

# Data configuration
DATA_ARGS="
    --data-path=/data/my-gpt3_text_document \
    --split=949,50,1 \
    --tokenizer-type=GPT2BPETokenizer \
    --vocab-file=gpt2-vocab.json \
    --merge-file=gpt2-merges.txt
"

# Checkpointing
CHECKPOINT_ARGS="
    --save=/checkpoints/gpt-model \
    --load=/checkpoints/gpt-model \
    --save-interval=1000 \
    --eval-interval=100 \
    --eval-iters=10
"

# Logging
LOGGING_ARGS="
    --log-interval=10 \
    --tensorboard-dir=/logs \
    --wandb-project=my-gpt-training \
    --wandb-entity=my-org
"
