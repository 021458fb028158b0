# Seed 004's GPT2-large (774M: 36 layers, 1280 hidden, 20 heads), TP 2 + sequence parallel, bf16, 4 GPUs
python pretrain_gpt.py --num-layers=36 --hidden-size=1280 --num-attention-heads=20 --seq-length=1024 \
  --max-position-embeddings=1024 --micro-batch-size=32 --global-batch-size=64 --tensor-model-parallel-size=2 \
  --sequence-parallel --use-distributed-optimizer --bf16 --use-flash-attn --train-iters=1000 --lr=6e-4 \
  --min-lr=6e-5 --lr-warmup-iters=100 --lr-decay-iters=1000 --adam-beta1=0.9 --adam-beta2=0.95 --adam-eps=1e-8 \
  --tokenizer-type=GPT2BPETokenizer --vocab-file=vocab.json --merge-file=merges.txt --data-path=/d/owt_text_document \
  --recompute-granularity=full --recompute-method=uniform --recompute-num-layers=1 --attention-dropout 0.1 \
  --hidden-dropout 0.1 --init-method-std 0.02 --seed 1234 --distributed-backend nccl --no-masked-softmax-fusion
