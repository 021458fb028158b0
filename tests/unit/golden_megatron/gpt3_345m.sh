# Megatron-LM's GPT-3 345M example (seed 004's first run: 00_train_gpt3_345m.sh), one GPU
GPT_MODEL_ARGS=(
    --num-layers 24
    --hidden-size 1024
    --num-attention-heads 16
    --seq-length 1024
    --max-position-embeddings 1024
)
TRAINING_ARGS="
    --micro-batch-size 4 \
    --global-batch-size 8 \
    --train-iters 500000 \
    --lr-decay-iters 320000 \
    --lr 0.00015 \
    --min-lr 1.0e-5 \
    --lr-decay-style cosine \
    --lr-warmup-fraction .01 \
    --weight-decay 1e-2 \
    --clip-grad 1.0 \
    --fp16
"
DATA_ARGS="
    --data-path 0.3 /data/wiki_text_document 0.7 /data/books_text_document \
    --vocab-file /data/gpt2-vocab.json \
    --merge-file /data/gpt2-merges.txt \
    --split 949,50,1
"
OUTPUT_ARGS="
    --log-interval 100 \
    --save-interval 10000 \
    --eval-interval 1000 \
    --save /ckpt/gpt3-345m \
    --load /ckpt/gpt3-345m \
    --eval-iters 10
"
