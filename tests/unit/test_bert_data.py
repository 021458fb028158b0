"""BERT data: --split-sentences output as Megatron writes it, the BertWordPiece tokenizer, BertDataset's samples
(layout, determinism, resume) and their statistics against megatron-core's BERTMaskedWordPieceDataset."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.unit.masked_data_helpers import (megatron_dataset, preprocess, preprocess_main, resumed_batches,
                                             write_corpus, write_vocab)
from titanlike.config.sections import Data
from titanlike.data.bert_dataset import BertDataset
from titanlike.data.indexed import IndexedDataset
from titanlike.data.tokenizers import build_tokenizer
from titanlike.data.tokenizers.bert_wordpiece import BertWordPieceTokenizer

N = 600  # samples per statistic: megatron-core's Python masking takes ~2.5 ms a sample


@pytest.fixture(scope="module")
def prefix(tmp_path_factory):
    return preprocess(tmp_path_factory.mktemp("bert"))


@pytest.fixture(scope="module")
def tok(prefix):
    return BertWordPieceTokenizer(prefix.rsplit("/", 1)[0] + "/vocab.txt", vocab_extra_ids=100)


def _ours(prefix, tok, tmp_path, seq_len=128, **kw):
    ix = IndexedDataset(prefix)
    return BertDataset(ix, (0, ix.num_documents), seq_len, tok, seed=1234, cache_dir=str(tmp_path), **kw)


def test_megatron_reads_split_sentences(prefix):
    from megatron.core.datasets.indexed_dataset import IndexedDataset as MegatronIndexed

    ours, theirs = IndexedDataset(prefix), MegatronIndexed(prefix)
    assert np.array_equal(ours.document_indices, theirs.document_indices)
    assert ours.num_documents == 400 and len(ours) > 3 * ours.num_documents  # a sequence per sentence
    assert all(np.array_equal(ours.get(i), theirs[i]) for i in range(len(ours)))
    assert not np.isin(ours.get(0), [3, 4]).any()  # no [CLS]/[SEP] written: the dataset adds them


def test_sentences_match_the_splitter(tmp_path):
    (tmp_path / "d.jsonl").write_text('{"text": "The dog ran. A cat sang! Was it green?"}\n'
                                      '{"text": "One sentence only."}\n')
    write_vocab(tmp_path / "vocab.txt")
    assert preprocess_main([str(a) for a in ("--input", tmp_path / "d.jsonl", "--output-prefix", tmp_path / "o",
                                             "--tokenizer-type", "BertWordPieceLowerCase", "--vocab-file",
                                             tmp_path / "vocab.txt", "--split-sentences", "--sentence-splitter",
                                             "rules", "--append-eod", "--no-progress")]) == 0
    ix = IndexedDataset(tmp_path / "o_text_sentence")
    tok = BertWordPieceTokenizer(tmp_path / "vocab.txt")
    assert ix.document_indices.tolist() == [0, 3, 4]
    assert ix.get(0).tolist() == tok.encode("The dog ran.")
    assert ix.get(2).tolist() == tok.encode("Was it green?") + [tok.eod_id]  # EOD joins the last sentence


def test_punkt_missing_is_one_line(tmp_path, capsys):
    from titanlike.data.sentences import _punkt_language_data

    if _punkt_language_data("english"):
        pytest.skip("NLTK's punkt data is installed here")
    write_vocab(tmp_path / "vocab.txt")
    write_corpus(tmp_path / "d.jsonl", docs=3)
    assert preprocess_main([str(a) for a in ("--input", tmp_path / "d.jsonl", "--output-prefix", tmp_path / "o",
                                             "--tokenizer-type", "BertWordPieceCase", "--vocab-file",
                                             tmp_path / "vocab.txt", "--split-sentences", "--no-progress")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "nltk.downloader punkt_tab" in err[0] and "--sentence-splitter rules" in err[0]
    assert not list(tmp_path.glob("o_*"))


def test_tokenizer_on_a_tiny_vocab(tmp_path):
    (tmp_path / "vocab.txt").write_text("[PAD]\n[UNK]\n[CLS]\n[SEP]\n[MASK]\nthe\ndog\nrun\n##s\n##ning\n.\n")
    cfg = Data(tokenizer_type="BertWordPieceLowerCase", vocab_file=str(tmp_path / "vocab.txt"), vocab_extra_ids=3)
    tok = build_tokenizer(cfg)
    assert (tok.pad_id, tok.cls_id, tok.sep_id, tok.mask_id) == (0, 2, 3, 4)
    assert tok.encode("The dogs running.") == [5, 6, 8, 7, 9, 10]  # lower-cased, "##" pieces
    assert tok.encode("[MASK] cat") == [4, 1]  # a special token stays whole; unknown words are [UNK]
    assert (tok.bos_id, tok.eos_id, tok.sentinel_ids, tok.vocab_size) == (11, 12, [13, 14, 15], 16)  # as Megatron
    assert tok.continuation.nonzero()[0].tolist() == [8, 9]
    cased = build_tokenizer(Data(tokenizer_type="BertWordPieceCase", vocab_file=str(tmp_path / "vocab.txt")))
    assert cased.encode("The dog") == [1, 6] and cased.sentinel_ids == []


def test_missing_special_tokens_are_one_line(tmp_path, prefix):
    (tmp_path / "vocab.txt").write_text("[PAD]\n[UNK]\n[CLS]\n[SEP]\nthe\n")
    tok = BertWordPieceTokenizer(tmp_path / "vocab.txt")
    ix = IndexedDataset(prefix)
    with pytest.raises(ValueError, match=r"needs a \[MASK\] token .* add a line \[MASK\]"):
        BertDataset(ix, (0, 10), 64, tok)
    from titanlike.data.t5_dataset import T5Dataset

    with pytest.raises(ValueError, match="set data.vocab_extra_ids"):
        T5Dataset(ix, (0, 10), 64, tok)
    with pytest.raises(ValueError, match="BertWordPieceLowerCase needs data.vocab_file"):
        build_tokenizer(Data(tokenizer_type="BertWordPieceLowerCase"))


def test_document_data_is_refused(tmp_path, tok):
    write_vocab(tmp_path / "vocab.txt")
    write_corpus(tmp_path / "d.jsonl", docs=20)
    assert preprocess_main([str(a) for a in ("--input", tmp_path / "d.jsonl", "--output-prefix", tmp_path / "o",
                                             "--tokenizer-type", "BertWordPieceLowerCase", "--vocab-file",
                                             tmp_path / "vocab.txt", "--no-progress")]) == 0
    ix = IndexedDataset(tmp_path / "o_text_document")
    with pytest.raises(ValueError, match="one sequence per document: re-run .* with --split-sentences"):
        BertDataset(ix, (0, 20), 64, tok)


def test_sample_layout(prefix, tok, tmp_path):
    ds = _ours(prefix, tok, tmp_path, seq_len=64)
    for i in range(50):
        x, y = ds[i]
        s = ds.sample(i)
        assert x.shape == (3, 64) and y.shape == (65,) and x.dtype == y.dtype == torch.int64
        tokens, types, pad = x.numpy()
        n = int(pad.sum())
        assert pad[:n].all() and not pad[n:].any() and (tokens[n:] == tok.pad_id).all()
        seps = np.nonzero(tokens[:n] == tok.sep_id)[0]
        assert tokens[0] == tok.cls_id and seps[-1] == n - 1 and len(seps) == 2  # [CLS] A [SEP] B [SEP]
        assert (types[: seps[0] + 1] == 0).all() and (types[seps[0] + 1 : n] == 1).all() and not types[n:].any()
        masked = np.nonzero(y[:64].numpy() != -100)[0]
        assert masked.size and not np.isin(masked, [0, *seps]).any() and masked.max() < n
        assert y[64] == s["is_random"] in (0, 1)


def test_deterministic_and_resumable(prefix, tok, tmp_path):
    a, b = _ours(prefix, tok, tmp_path / "a"), _ours(prefix, tok, tmp_path / "b")
    for i in (0, 7, 5000):  # 5000: past the first epoch, another order
        assert all(torch.equal(p, q) for p, q in zip(a[i], b[i]))
    assert not torch.equal(a[3][0], a[3 + len(a.groups)][0])  # the next epoch masks again
    cfg = Data(dataset="bert", paths=[prefix], split="100,0,0", tokenizer_type="BertWordPieceLowerCase",
               vocab_file=str(tok.path), vocab_extra_ids=100, cache_dir=str(tmp_path))
    (want,), (got,), _ = resumed_batches(cfg, tok, skip=3, take=1)
    assert want[0].shape == (4, 3, 64) and want[1].shape == (4, 65)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def _stats(samples, mask_id):
    lengths = np.array([s["padding_mask"].sum() for s in samples])
    masked = asked = mask = kept = 0
    for s in samples:
        tokens = s.get("text", s.get("tokens"))
        pos = np.nonzero(s["loss_mask"] if "loss_mask" in s else s["labels"] != -100)[0]
        masked, asked = masked + pos.size, asked + int(s["padding_mask"].sum()) - 3
        mask += int((tokens[pos] == mask_id).sum())
        kept += int((tokens[pos] == s["labels"][pos]).sum())
    return {"mask_rate": masked / asked, "as_mask": mask / masked, "kept": kept / masked,
            "random": 1 - (mask + kept) / masked, "len_mean": lengths.mean(), "len_p10": np.percentile(lengths, 10),
            "len_p50": np.percentile(lengths, 50), "swapped": np.mean([s["is_random"] for s in samples]),
            "truncated": np.mean([s["truncated"] for s in samples])}


def test_statistics_match_megatron_core(prefix, tok, tmp_path):
    """Same prefix, same settings (pretrain_bert.py's: n-grams up to 3, P(n) ~ 1/n, sentence-order head)."""
    theirs = megatron_dataset("bert", prefix, tok, 128, tmp_path / "m", num_samples=N)
    m = _stats([theirs[i] for i in range(N)], tok.mask_id)
    o = _stats([_ours(prefix, tok, tmp_path).sample(i) for i in range(N)], tok.mask_id)
    print("megatron-core", m, "\ntitanlike", o)
    assert abs(o["mask_rate"] - 0.15) < 0.005 and abs(m["mask_rate"] - o["mask_rate"]) < 0.005
    for key in ("as_mask", "kept", "random"):  # 80/10/10 over ~8k masked tokens each
        assert abs(m[key] - o[key]) < 0.03, key
    assert abs(o["as_mask"] - 0.8) < 0.03 and abs(o["random"] - 0.1) < 0.03
    for key in ("len_mean", "len_p10", "len_p50"):  # the pair length distribution (short samples included)
        assert abs(m[key] - o[key]) < 0.08 * m[key], key
    assert abs(o["swapped"] - 0.5) < 0.07 and abs(m["truncated"] - o["truncated"]) < 0.08


def test_whole_word_masking(prefix, tok, tmp_path):
    ds = _ours(prefix, tok, tmp_path, whole_word=True)
    pieces = masked = asked = 0
    for i in range(200):
        s = ds.sample(i)
        tokens = s["tokens"].copy()
        pos = np.nonzero(s["labels"] != -100)[0]
        tokens[pos] = s["labels"][pos]  # the original ids
        cont = tok.continuation[tokens]
        for span in s["spans"]:  # a span starts at a word and ends where a word ends
            assert not cont[span[0]] and (span[-1] + 1 == tokens.size or not cont[span[-1] + 1])
        pieces, masked, asked = pieces + int(cont[pos].sum()), masked + pos.size, asked + s["padding_mask"].sum() - 3
    assert pieces > 0 and abs(masked / asked - 0.15) < 0.01  # whole words, and still 15% of the tokens


# Both cases of every word, "##" pieces, accented forms (kept by the cased tokenizer, stripped by the lower-case one),
# punctuation and a few CJK characters, which BERT splits one a token.
_HF_VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "the", "The", "dog", "Dog", "run", "##s", "##ning", "##ed",
             "cafe", "café", "naive", "naïve", "Zurich", "zurich", "Zürich", "un", "##able", "##aff", ".", ",", "!",
             "?", "'", "-", "(", ")", "\"", "$", "中", "国", "人", "##中", "a", "b", "##b", "x", "3", "##0"]
_HF_TEXTS = ["The dogs running.", "THE DOG RUNS!", "café naïve Zürich, cafe naive zurich?", "Ünable unaff ZÜRICH",
             "(dog)-the 'run' \"dogs\" $30", "中国人 dog中国 the中", "  the\tdog\n\nruns \u00a0 \u3000 runned  ",
             "unknownword dog xylophone ab bb abb", "[MASK] dog [CLS] the [SEP]", "Café\u0301 e\u0301 dog\u200b",
             "a" * 120 + " dog", "dog\x00the\ufffdrun"]


@pytest.mark.parametrize("lower", [True, False])
def test_tokenizer_matches_transformers(tmp_path, lower):
    """Megatron's BertWordPiece follows Google's BERT tokenization, as transformers' BertTokenizer does: same ids
    from the same vocab.txt, lower-case and cased, on punctuation, accents, unknown words, CJK and odd whitespace."""
    from transformers import BertTokenizer, BertTokenizerFast

    (tmp_path / "vocab.txt").write_text("\n".join(_HF_VOCAB) + "\n")
    ours = build_tokenizer(Data(tokenizer_type="BertWordPieceLowerCase" if lower else "BertWordPieceCase",
                                vocab_file=str(tmp_path / "vocab.txt")))
    slow = BertTokenizer(str(tmp_path / "vocab.txt"), do_lower_case=lower)
    fast = BertTokenizerFast(str(tmp_path / "vocab.txt"), do_lower_case=lower)
    for text in _HF_TEXTS:
        want = slow.encode(text, add_special_tokens=False)
        assert ours.encode(text) == want == fast.encode(text, add_special_tokens=False), text
    assert ours.encode_batch(_HF_TEXTS) == [slow.encode(t, add_special_tokens=False) for t in _HF_TEXTS]
    assert len([i for t in _HF_TEXTS for i in ours.encode(t) if i == ours.unk_id]) > 3  # unknown words were hit
