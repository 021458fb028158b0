# Install Megatron-Core via pip
pip install megatron-core

# Or clone for full examples
git clone https://github.com/NVIDIA/Megatron-LM.git
cd Megatron-LM

# Install dependencies
pip install -r requirements.txt

# Download training data (example)
wget https://data.together.xyz/redpajama-data-1T/v1.0.0/book/book.jsonl

# Preprocess data
python tools/preprocess_data.py \
    --input book.jsonl \
    --output-prefix my-gpt3 \
    --tokenizer-type GPT2BPETokenizer \
    --vocab-file gpt2-vocab.json \
    --merge-file gpt2-merges.txt \
    --append-eod

# Train a small GPT model (2.7B)
bash examples/pretrain_gpt_distributed.sh
