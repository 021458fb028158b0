# A Llama-3-8B-style block (RoPE, SwiGLU, RMSNorm, GQA), TP 2 x PP 2 (interleaved) x CP 2 = 8 GPUs
--num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32 --group-query-attention
--num-query-groups 8 --position-embedding-type rope --swiglu --normalization RMSNorm --seq-length 8192
--max-position-embeddings 8192 --micro-batch-size 1 --global-batch-size 16 --tensor-model-parallel-size 2
--pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 4 --context-parallel-size 2 --bf16
--tokenizer-type HuggingFaceTokenizer --tokenizer-model /tok/llama3 --lr 3e-4 --min-lr 3e-5 --train-iters 100
--untie-embeddings-and-output-weights --disable-bias-linear
