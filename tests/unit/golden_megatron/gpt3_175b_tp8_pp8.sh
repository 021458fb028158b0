# GPT-3 175B (96 layers, 12288 hidden, 96 heads) at seed 000's 175B layout: 256 GPUs = TP 8 x PP 8 x DP 4, global
# batch 1024 (its "Expected Performance" row); the other flags as in its Pattern 1/2 blocks
torchrun --nproc_per_node=8 --nnodes=32 pretrain_gpt.py \
    --num-layers=96 --hidden-size=12288 --num-attention-heads=96 \
    --seq-length=2048 --max-position-embeddings=2048 \
    --micro-batch-size=1 --global-batch-size=1024 \
    --tensor-model-parallel-size=8 --pipeline-model-parallel-size=8 \
    --sequence-parallel --use-distributed-optimizer \
    --train-iters=100000 --lr=6.0e-5 --min-lr=6.0e-6 --lr-decay-style=cosine --lr-warmup-iters=2000 \
    --weight-decay=0.1 --clip-grad=1.0 --bf16 --use-flash-attn \
    --recompute-granularity=full --recompute-method=uniform --recompute-num-layers=1 \
    --data-path=/data/pile_text_document --split=949,50,1 \
    --tokenizer-type=GPT2BPETokenizer --vocab-file=gpt2-vocab.json --merge-file=gpt2-merges.txt \
    --save=/checkpoints/gpt-175b --load=/checkpoints/gpt-175b --save-interval=500 \
    --eval-interval=100 --eval-iters=10 --log-interval=1
