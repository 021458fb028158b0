"""The [data] config section (titanlike/config/sections.py has the others and says how sections are used)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Data:
    # stdlib (the Python standard library's own source) | mock (random tokens) | indexed (Megatron .bin/.idx
    # prefixes in `paths`) | text (streaming JSONL/Parquet/text files or globs in `paths`, tokenised on the fly)
    dataset: str = "stdlib"
    paths: list[str] = field(default_factory=list)  # indexed: blend "0.3 prefix_a 0.7 prefix_b" or prefixes
    split: str = "949,50,1"  # indexed: train,valid,test shares of every prefix's documents (Megatron's --split)
    text_key: str = "text"  # text: the JSONL/Parquet field holding a document
    tokenizer: str = "builtin"  # builtin (byte-level BPE trained and cached locally) | path to a tokenizer file
    tokenizer_type: str = "auto"  # auto | builtin | Megatron names: HuggingFaceTokenizer, GPT2BPETokenizer, ...
    tokenizer_model: str = ""  # Megatron's name for the tokenizer file; when set it is used instead of `tokenizer`
    vocab_file: str = ""  # GPT2BPETokenizer: vocab.json
    merge_file: str = ""  # GPT2BPETokenizer: merges.txt
    bos_token: str = ""  # "" = detect; else the exact text of the BOS token
    eos_token: str = ""  # "" = detect
    eod_token: str = ""  # document separator when packing; "" = the EOS token
    add_bos: bool = False  # stdlib/text: prepend BOS to every document
    add_eod: bool = True  # stdlib/text: append the EOD token after every document
    builtin_vocab_size: int = 2048  # builtin: the BPE's vocabulary size; NullTokenizer: ids are below this
    cache_dir: str = ""  # "" = ~/.cache/titanlike
    num_workers: int = 0
    pin_memory: bool = True
    # Packed sequences: attention stays inside each document (ends at the EOD token); Megatron's --reset-attention-mask
    document_masking: bool = False
    reset_position_ids: bool = False  # RoPE positions restart at every document (Megatron's --reset-position-ids)
    eod_mask_loss: bool = False  # no loss on predicting from an EOD token (Megatron's --eod-mask-loss)
    # chat (supervised fine-tuning, docs/post_training.md): "" = the tokenizer folder's template (chat_template.jinja
    # or tokenizer_config.json), else a built-in ("chatml", "header", "llava"), a .jinja file or an HF tokenizer folder
    chat_template: str = ""
    sft_layout: str = "pack"  # chat: pack (conversations end to end, EOD between) | pad (one per row, EOD padding)
    sft_truncation: str = "truncate"  # chat: a conversation longer than seq_len+1 tokens: truncate | drop
    # preference (DPO): pad (a sample is a pair, each sequence padded to a row) | pack (a sample is a row of seq_len + 1
    # tokens holding several whole pairs; needs document_masking and reset_position_ids; local_batch_size counts rows)
    preference_layout: str = "pad"
    messages_key: str = "messages"  # chat: the record field holding [{"role", "content"}, ...]
    prompt_key: str = "prompt"  # chat: without messages, a prompt/response pair becomes a user + assistant turn
    response_key: str = "response"
    # bert / t5 (Megatron's BERT and T5 data over sentence-split .bin/.idx, titanlike/data/bert_dataset.py and
    # t5_dataset.py; docs/data.md): the tokenizer is a BERT vocab.txt (tokenizer_type = BertWordPieceLowerCase)
    vocab_extra_ids: int = 0  # sentinel tokens <extra_id_0..N-1> added after the vocabulary (t5 needs them)
    mask_prob: float = 0.15  # bert: share of the tokens masked (80% [MASK], 10% random, 10% kept)
    short_seq_prob: float = 0.1  # bert/t5: a sample's target length is drawn uniformly from [2, max] this often
    whole_word_masking: bool = False  # bert/t5: mask whole words ("##" pieces with the piece before them)
    binary_head: bool = True  # bert: sentence pairs + the sentence-order label (False: --bert-no-binary-head)
    noise_density: float = 0.15  # t5: share of the encoder tokens replaced by sentinel spans
    mean_span_length: float = 5.0  # t5: spans' length is geometric with this mean (p = 1/mean), cut at 10 tokens
    decoder_seq_length: int = 128  # t5: decoder length (training.seq_len is the encoder's)
    # t5: "span" (the span corruption above) | "ul2" (UL2's mixture of denoisers, docs/t5.md: each sample draws one
    # entry of the ul2_* lists by ul2_probabilities and its encoder input starts with the mode token [R] / [S] / [X],
    # which the vocab.txt must hold)
    t5_denoisers: str = "span"
    ul2_kinds: list[str] = field(default_factory=lambda: ["R", "S", "X", "X"])  # R regular, S prefix LM, X extreme
    ul2_mean_span_lengths: list[float] = field(default_factory=lambda: [3.0, 0.0, 32.0, 3.0])  # R/X (S: unused)
    # R/X: share of the tokens in spans; S: the suffix's mean share of the row (its length uniform in 1..2 x that)
    ul2_noise_densities: list[float] = field(default_factory=lambda: [0.15, 0.25, 0.15, 0.5])
    ul2_probabilities: list[float] = field(default_factory=lambda: [0.5, 0.25, 0.125, 0.125])  # sum to 1
    # shapes_captions: the share of images that also carry a drawn digit 0-9, named by the caption ("... with the
    # digit 7"; titanlike/data/image_text.py); 0 = none, the captions of earlier versions
    caption_digits: float = 0.5
    # webdataset (tar shards of image + caption / conversation / class, titanlike/data/webdataset.py; docs/llava.md,
    # docs/vit.md): which member is the target: txt (captions) | json (conversations: loss on the answers) | cls
    wds_target: str = "txt"
    image_size: int = 0  # webdataset txt/json rows: the llava tower's image side (cls: 0 = from training.seq_len)
    image_tokens: int = 0  # webdataset txt/json rows: placeholders per image (the llava model's image_tokens)
    images_per_row: int = 1  # mock_image_text / webdataset txt/json rows: image slots per row (the model's)
    # webdataset txt/json rows: pad (one sample a row) | pack (samples end to end, images in the row's slots in order;
    # with document_masking and reset_position_ids each attends only to itself: titanlike/data/webdataset_pack.py)
    wds_layout: str = "pad"
    # webdataset / image_folder: an image that does not decode, a bad class or conversation, a truncated shard:
    # error (stop, naming the shard and member) | skip (the next good sample instead, logged with a count)
    bad_samples: str = "error"
