"""Tokenizer formats from local files the tests create: HF json, GPT-2 vocab+merges, tiktoken (Llama 3 format),
sentencepiece, Megatron's NullTokenizer; auto-detection and explicit BOS/EOS/EOD."""
from __future__ import annotations

import base64
import io
from dataclasses import replace

import pytest

from titanlike.config.sections import Data
from titanlike.data.tokenizers import build_tokenizer, resolve_tokenizer_kind
from titanlike.data.tokenizers.hf import train_bytelevel_bpe

TEXT = "the theory of the thing: Grüße 東京 🚀\n\tindented"
CORPUS = ["the cat sat on the mat", "the theory of everything", "then they went there", "other thoughts"] * 30


@pytest.fixture(scope="module")
def gpt2_files(tmp_path_factory):
    """A tiny byte-level BPE saved both as tokenizer.json and as GPT-2's vocab.json + merges.txt."""
    folder = tmp_path_factory.mktemp("gpt2")
    hf = train_bytelevel_bpe(CORPUS, 300, special_tokens=["<|endoftext|>"])
    hf.save(str(folder / "tokenizer.json"))
    hf.model.save(str(folder))  # vocab.json + merges.txt (with its "#version" header)
    return folder


def test_gpt2_vocab_merges_equals_hf_json(gpt2_files):
    assert (gpt2_files / "merges.txt").read_text().startswith("#version")
    g = build_tokenizer(Data(tokenizer_type="GPT2BPETokenizer", vocab_file=str(gpt2_files / "vocab.json"),
                             merge_file=str(gpt2_files / "merges.txt")))
    h = build_tokenizer(Data(tokenizer=str(gpt2_files / "tokenizer.json")))
    assert g.encode(TEXT) == h.encode(TEXT) and g.decode(g.encode(TEXT)) == TEXT
    assert g.eod_id == g.eos_id == g.token_to_id("<|endoftext|>") and g.vocab_size == h.vocab_size
    assert g.eos_id not in g.encode("a <|endoftext|> b")  # markup in data stays text
    # auto: vocab_file set -> GPT-2; a folder with only vocab.json + merges.txt -> GPT-2 too
    assert build_tokenizer(Data(vocab_file=str(gpt2_files / "vocab.json"),
                                merge_file=str(gpt2_files / "merges.txt"))).encode(TEXT) == g.encode(TEXT)


def _write_tiktoken(path):
    ranks = [bytes([b]) for b in range(256)] + [b"th", b"the", b" the"]
    path.write_text("".join(f"{base64.b64encode(t).decode()} {i}\n" for i, t in enumerate(ranks)))
    return path


def test_tiktoken_llama3_format(tmp_path):
    pytest.importorskip("tiktoken")
    path = _write_tiktoken(tmp_path / "tokenizer.model")
    assert resolve_tokenizer_kind(Data(tokenizer=str(path)))[0] == "tiktoken"  # sniffed, not guessed by name
    tok = build_tokenizer(Data(tokenizer_type="Llama3Tokenizer", tokenizer_model=str(path)))
    n = 259
    assert tok.vocab_size == n + 256
    assert (tok.bos_id, tok.eos_id, tok.eod_id) == (n, n + 1, n + 1)  # 128000 / 128001 in the real file
    assert tok.token_to_id("<|eot_id|>") == n + 9 and tok.token_to_id("<|start_header_id|>") == n + 6
    assert tok.encode("the") == [257] and tok.encode("the the") == [257, 258]
    assert tok.decode(tok.encode(TEXT)) == TEXT
    long = " ".join([TEXT] * 40)  # a huge document's pieces (cut between words) give the whole text's ids
    assert tok.encode_array(long, piece_chars=64, long_chars=10).tolist() == tok.encode(long)
    assert tok.bos_id not in tok.encode("<|begin_of_text|> is text here")
    assert tok.encode("x", bos=True, eos=True)[::2] == [tok.bos_id, tok.eos_id]
    eot = build_tokenizer(Data(tokenizer=str(path), eod_token="<|eot_id|>"))
    assert eot.eod_id == n + 9 and eot.eos_id == n + 1
    (tmp_path / "bad.model").write_text("dGhl 0\nnot a rank line\n")
    with pytest.raises(ValueError, match=r"bad.model:2"):
        build_tokenizer(Data(tokenizer=str(tmp_path / "bad.model"), tokenizer_type="TikTokenizer"))


def test_sentencepiece_model(tmp_path):
    spm = pytest.importorskip("sentencepiece")
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(CORPUS), model_writer=buf, vocab_size=320, minloglevel=2,
                                   hard_vocab_limit=False, character_coverage=1.0, byte_fallback=True)
    path = tmp_path / "tokenizer.model"
    path.write_bytes(buf.getvalue())
    assert resolve_tokenizer_kind(Data(tokenizer=str(tmp_path)))[0] == "sentencepiece"  # folder, sniffed
    tok = build_tokenizer(Data(tokenizer=str(path)))
    assert (tok.bos_id, tok.eos_id) == (1, 2) and tok.eod_id == 2
    text = "the cat went there"
    assert tok.decode(tok.encode(text)) == text
    long = " ".join([TEXT] * 40)  # a huge document's pieces (cut between words) give the whole text's ids
    assert tok.encode_array(long, piece_chars=64, long_chars=10).tolist() == tok.encode(long)
    assert tok.encode(text, bos=True, eos=True) == [1, *tok.encode(text), 2]
    assert tok.eos_id not in tok.encode("</s> stays text")
    assert max(tok.encode("東京 🚀")) < tok.vocab_size  # byte fallback: nothing is out of vocabulary
    assert build_tokenizer(Data(tokenizer=str(path), tokenizer_type="Llama2Tokenizer")).encode(text) == \
        tok.encode(text)


def test_null_tokenizer_and_overrides(gpt2_files):
    tok = build_tokenizer(Data(tokenizer_type="NullTokenizer", builtin_vocab_size=100))
    assert tok.vocab_size == 101 and tok.eod_id == 100 and tok.encode("3 5 99") == [3, 5, 99]
    with pytest.raises(ValueError, match="out of"):
        tok.encode("100")
    hf = Data(tokenizer=str(gpt2_files))
    with pytest.raises(ValueError, match="data.eod_token='<nope>'"):
        build_tokenizer(replace(hf, eod_token="<nope>"))
    t = build_tokenizer(replace(hf, bos_token="the"))  # any vocabulary entry may be named
    assert t.bos_id == t.token_to_id("the") != t.eos_id


def test_bad_tokenizer_settings(tmp_path):
    with pytest.raises(ValueError, match="tokenizer_type='Bert'"):
        build_tokenizer(Data(tokenizer_type="Bert"))
    with pytest.raises(FileNotFoundError, match="data.vocab_file"):
        build_tokenizer(Data(vocab_file=str(tmp_path / "v.json"), merge_file=str(tmp_path / "m.txt")))
    with pytest.raises(FileNotFoundError, match="no tokenizer file"):
        build_tokenizer(Data(tokenizer_type="TikTokenizer", tokenizer_model=str(tmp_path / "missing.model")))
    (tmp_path / "junk.model").write_bytes(b"\x00\x01junk")
    with pytest.raises(ValueError, match="not a sentencepiece model"):
        build_tokenizer(Data(tokenizer=str(tmp_path / "junk.model")))


def test_mismatched_gpt2_files_name_both(tmp_path):
    """A merges.txt from another vocabulary (a merge of tokens vocab.json lacks), or a damaged file: one error
    naming both files and what to point the keys at."""
    import json

    json.dump({"a": 0, "b": 1, "<|endoftext|>": 2}, open(tmp_path / "vocab.json", "w"))
    (tmp_path / "merges.txt").write_text("#version: 0.2\nx y\n")
    for _ in range(2):
        with pytest.raises(ValueError, match=r"vocab.json / .*merges.txt: not GPT-2 BPE files .*data.vocab_file"):
            build_tokenizer(Data(vocab_file=str(tmp_path / "vocab.json"), merge_file=str(tmp_path / "merges.txt")))
        (tmp_path / "vocab.json").write_text("not json")
