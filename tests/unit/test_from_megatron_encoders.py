"""Megatron's pretrain_bert.py and pretrain_t5.py launches -> titanlike TOML (titanlike/config/megatron_encoder.py):
the script picks the family, the sizes land on the nearest flavor, the data flags on the data keys, and the result
loads through load_config (validation included)."""
from __future__ import annotations

from pathlib import Path

import pytest

from titanlike.config.load import load_config
from titanlike.config.megatron import to_toml, translate_text

# As Megatron-LM's examples/bert/train_bert_340m_distributed.sh and examples/t5/train_t5_220m_distributed.sh write
# them (paths shortened).
BERT_340M = """
torchrun --nproc_per_node 8 pretrain_bert.py \\
    --num-layers 24 --hidden-size 1024 --num-attention-heads 16 \\
    --seq-length 512 --max-position-embeddings 512 \\
    --micro-batch-size 4 --global-batch-size 32 \\
    --lr 0.0001 --train-iters 1000000 --lr-decay-iters 990000 --lr-decay-style linear --min-lr 1.0e-5 \\
    --weight-decay 1e-2 --lr-warmup-fraction .01 --clip-grad 1.0 --fp16 \\
    --data-path /data/bert_text_sentence --vocab-file /data/bert-vocab.txt \\
    --tokenizer-type BertWordPieceLowerCase --split 949,50,1 --mask-prob 0.15 --short-seq-prob 0.1
"""
T5_220M = """
torchrun --nproc_per_node 8 pretrain_t5.py \\
    --encoder-num-layers 12 --decoder-num-layers 12 --hidden-size 768 --num-attention-heads 12 \\
    --kv-channels 64 --ffn-hidden-size 3072 \\
    --encoder-seq-length 512 --decoder-seq-length 128 --max-position-embeddings 512 \\
    --micro-batch-size 64 --global-batch-size 512 \\
    --lr 0.0001 --train-iters 1000000 --lr-decay-iters 1000000 --lr-decay-style linear --min-lr 0.00001 \\
    --weight-decay 1e-2 --lr-warmup-fraction .01 --clip-grad 1.0 --bf16 --vocab-extra-ids 100 \\
    --data-path /data/t5_text_sentence --vocab-file /data/bert-large-cased-vocab.txt \\
    --tokenizer-type BertWordPieceCase --split 99982,9,9
"""


def _load(t, tmp_path: Path, world_size: int = 8):
    path = tmp_path / "run.toml"
    path.write_text(to_toml(t))
    return load_config(["--config", str(path)], world_size=world_size)


def test_bert_340m(tmp_path: Path) -> None:
    t = translate_text(BERT_340M)
    cfg = _load(t, tmp_path)
    assert cfg.model.name == "bert" and cfg.data.dataset == "bert"
    assert cfg.training.seq_len == 512 and (cfg.training.local_batch_size, cfg.training.global_batch_size) == (4, 32)
    assert (cfg.data.tokenizer_type, cfg.data.vocab_file) == ("BertWordPieceLowerCase", "/data/bert-vocab.txt")
    assert cfg.data.paths == ["/data/bert_text_sentence"]
    assert (cfg.data.mask_prob, cfg.data.short_seq_prob) == (0.15, 0.1)
    assert cfg.data.binary_head is True and cfg.model.args["binary_head"] is True  # Megatron's default: head on
    values = t.values["model"]
    assert values.get("flavor") == "megatron-bert-345m", values  # 24 x 1024 x 16 heads is Megatron's 345M


def test_bert_no_binary_head(tmp_path: Path) -> None:
    t = translate_text(BERT_340M.replace("--short-seq-prob 0.1", "--short-seq-prob 0.1 --bert-no-binary-head"))
    cfg = _load(t, tmp_path)
    assert cfg.data.binary_head is False


def test_t5_220m(tmp_path: Path) -> None:
    t = translate_text(T5_220M)
    cfg = _load(t, tmp_path)
    # Megatron's own T5Model layout, at exactly its 220M shape (examples/t5/train_t5_220m_distributed.sh)
    assert cfg.model.name == "t5" and cfg.data.dataset == "t5" and cfg.model.flavor == "megatron-t5-220m"
    assert cfg.model.args == {} and cfg.model.n_layers in (-1, 12), (cfg.model.args, cfg.model.n_layers)
    assert (cfg.training.seq_len, cfg.data.decoder_seq_length, cfg.data.vocab_extra_ids) == (512, 128, 100)
    assert (cfg.training.local_batch_size, cfg.training.global_batch_size) == (64, 512)
    assert cfg.data.tokenizer_type == "BertWordPieceCase"
    # another shape: the nearest Megatron flavor with the fields that differ (its positions table too)
    t = translate_text(T5_220M.replace("--hidden-size 768", "--hidden-size 512").replace(
        "--max-position-embeddings 512", "--max-position-embeddings 1024"))
    cfg = _load(t, tmp_path)
    assert cfg.model.flavor == "megatron-t5-220m" and cfg.model.args["dim"] == 512, cfg.model.args
    # --kv-channels 64 is the flavor's head_dim already
    assert cfg.model.args["max_position_rows"] == 1024 and "head_dim" not in cfg.model.args, cfg.model.args


@pytest.mark.parametrize("flag", ["--bert-no-binary-head", "--vocab-extra-ids 100"])
def test_encoder_flags_in_a_gpt_block_are_not_silently_dropped(flag: str) -> None:
    t = translate_text(f"--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 128 {flag}")
    assert any(f == flag.split()[0] for f, _ in t.unmapped), t.unmapped
