python resume_training.py \
    --load=/checkpoints/gpt-13b \
    --save=/checkpoints/gpt-13b-continued \
    --new-lr=5e-5 \
    --train-iters=200000 \
    [... other args ...]
