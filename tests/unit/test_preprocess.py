"""scripts/preprocess_data.py and the MMIDIDX format: Megatron's flags, byte layout, workers, bad input, atomic
output."""
from __future__ import annotations

import gzip
import importlib.util
import json
import os
import struct
import subprocess
import sys

import numpy as np
import pytest

from tests.launch import REPO_ROOT
from titanlike.data import IndexedDataset, IndexedDatasetWriter
from titanlike.data.tokenizers.hf import train_bytelevel_bpe

_spec = importlib.util.spec_from_file_location("_preprocess_script", REPO_ROOT / "scripts" / "preprocess_data.py")
_script = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_script)
main = _script.main  # the command line users run

DOCS = [f"document {i}: " + "the quick brown fox " * (i % 9 + 1) for i in range(300)]


@pytest.fixture(scope="module")
def tokdir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tok")
    hf = train_bytelevel_bpe(DOCS, 300, special_tokens=["<|endoftext|>"])
    hf.save(str(folder / "tokenizer.json"))
    hf.model.save(str(folder))
    return folder


@pytest.fixture(scope="module")
def jsonl(tmp_path_factory):
    path = tmp_path_factory.mktemp("in") / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": d, "title": f"t{i}"}) + "\n" for i, d in enumerate(DOCS)))
    return path


def _run(*argv):
    return main([str(a) for a in argv] + ["--no-progress"])


def test_megatron_byte_layout(tmp_path):
    """The .idx is exactly Megatron's MMIDIDX layout (spelled out here independently of the writer)."""
    w = IndexedDatasetWriter(tmp_path / "x", np.uint16)
    w.add_document([5, 6, 7])
    w.add_documents(np.array([1, 2, 3, 4], np.uint16), np.array([1, 3]))
    w.finalize()
    expect = b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 1, 8, 3, 4)  # version 1, uint16 = code 8, 3 seqs, 4 docs+1
    expect += np.array([3, 1, 3], "<i4").tobytes() + np.array([0, 6, 8], "<i8").tobytes()
    expect += np.array([0, 1, 2, 3], "<i8").tobytes()
    assert (tmp_path / "x.idx").read_bytes() == expect
    assert (tmp_path / "x.bin").read_bytes() == np.array([5, 6, 7, 1, 2, 3, 4], "<u2").tobytes()
    ds = IndexedDataset(tmp_path / "x.bin")  # ".bin"/".idx" suffixes are accepted for the prefix
    assert ds.num_documents == 3 and ds.get(2).tolist() == [2, 3, 4] and ds.get(0, 1, 2).tolist() == [6, 7]


def test_preprocess_gpt2_workers_identical(tmp_path, tokdir, jsonl):
    from titanlike.config.sections import Data
    from titanlike.data.tokenizers import build_tokenizer

    common = ["--input", jsonl, "--json-keys", "text", "title", "--tokenizer-type", "GPT2BPETokenizer",
              "--vocab-file", tokdir / "vocab.json", "--merge-file", tokdir / "merges.txt", "--append-eod"]
    assert _run(*common, "--output-prefix", tmp_path / "w1", "--workers", "1") == 0
    assert _run(*common, "--output-prefix", tmp_path / "w2", "--workers", "2") == 0
    for key in ("text", "title"):
        for ext in (".bin", ".idx"):
            a, b = (tmp_path / f"{w}_{key}_document{ext}" for w in ("w1", "w2"))
            assert a.read_bytes() == b.read_bytes()
    tok = build_tokenizer(Data(vocab_file=str(tokdir / "vocab.json"), merge_file=str(tokdir / "merges.txt")))
    ds = IndexedDataset(tmp_path / "w1_text_document")
    assert ds.dtype == np.uint16 and ds.num_documents == len(DOCS)
    for i in (0, 17, 299):
        assert ds.get(i).tolist() == tok.encode(DOCS[i]) + [tok.eod_id]
    stats = json.loads((tmp_path / "w1_text_document.stats.json").read_text())
    assert stats["max_token_id"] == int(ds.tokens.max()) and stats["num_tokens"] == ds.num_tokens
    assert not [p for p in os.listdir(tmp_path) if ".tmp" in p]


def test_bad_lines_counted_with_file_and_line(tmp_path, tokdir, capsys):
    src = tmp_path / "bad.jsonl.gz"
    lines = [b'{"text": "fine one"}', b'{"text": broken', b'{"other": 1}', b'\xff{"text": "x"}', b'{"text": ""}',
             b'{"text": 3}', b'{"text": "fine two"}']
    with gzip.open(src, "wb") as f:
        f.write(b"\n".join(lines) + b"\n")
    args = ["--input", src, "--tokenizer-model", tokdir / "tokenizer.json", "--append-eod"]
    assert _run(*args, "--output-prefix", tmp_path / "ok") == 0
    err = capsys.readouterr().err
    assert "skipped 5 bad line(s)" in err
    for where in ("bad.jsonl.gz:2: invalid JSON", "bad.jsonl.gz:3: no key 'text'", "bad.jsonl.gz:4: not valid UTF-8",
                  "bad.jsonl.gz:5: empty document", "bad.jsonl.gz:6: key 'text' holds int"):
        assert where in err
    assert IndexedDataset(tmp_path / "ok_text_document").num_documents == 2
    assert _run(*args, "--output-prefix", tmp_path / "strict", "--strict") == 1
    assert "--strict" in capsys.readouterr().err
    assert not [p for p in os.listdir(tmp_path) if p.startswith("strict")]  # nothing left behind, not even tmp


def test_cli_and_bad_arguments(tmp_path, tokdir, jsonl):
    p = subprocess.run([sys.executable, str(REPO_ROOT / "scripts/preprocess_data.py"), "--input", str(jsonl),
                        "--output-prefix", str(tmp_path / "cli"), "--tokenizer-type", "HuggingFaceTokenizer",
                        "--tokenizer-model", str(tokdir), "--append-eod", "--workers", "1"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "docs/s" in p.stderr and "tokens/s" in p.stderr
    assert _run("--input", tmp_path / "nope*.jsonl", "--output-prefix", tmp_path / "x",
                "--tokenizer-model", tokdir) == 2
    # --split-sentences: tests/unit/test_bert_data.py


def test_indexed_bad_files(tmp_path):
    w = IndexedDatasetWriter(tmp_path / "d", np.uint16)
    w.add_documents(np.arange(100, dtype=np.uint16), np.array([40, 60]))
    w.finalize()
    with pytest.raises(FileNotFoundError, match="no indexed dataset at prefix"):
        IndexedDataset(tmp_path / "missing")
    (tmp_path / "only.bin").write_bytes(b"\x00\x00")
    with pytest.raises(FileNotFoundError, match="only.idx does not"):
        IndexedDataset(tmp_path / "only")
    ds = IndexedDataset(tmp_path / "d")
    ds.check_vocab(100)
    with pytest.raises(ValueError, match=r"token id 99 \(recorded maximum\).*model.vocab_size >= 100"):
        ds.check_vocab(99)
    os.remove(tmp_path / "d.stats.json")  # data from Megatron has no stats: the max is read from the .bin
    assert IndexedDataset(tmp_path / "d").max_token_id() == (99, "scanned")
    with open(tmp_path / "d.bin", "ab") as f:
        f.write(b"\x00\x00")
    with pytest.raises(ValueError, match="different runs or one is incomplete"):
        IndexedDataset(tmp_path / "d")
    (tmp_path / "d.idx").write_bytes((tmp_path / "d.idx").read_bytes()[:-8])
    with pytest.raises(ValueError, match="truncated or corrupt"):
        IndexedDataset(tmp_path / "d")
    (tmp_path / "d.idx").write_bytes(b"NOTMMIDX" + bytes(40))
    with pytest.raises(ValueError, match="not a Megatron MMIDIDX"):
        IndexedDataset(tmp_path / "d")



def test_long_documents_go_through_arrays_with_the_same_ids(tmp_path, tokdir, monkeypatch):
    """A document over LONG_TEXT_CHARS (lowered here; a JSONL line of megabytes) is encoded into an array
    (Tokenizer.encode_array: in pieces, test_data_streaming.py holds its ids to the whole text's) between two
    short ones: the written documents are the same as encoding each whole."""
    from titanlike.config.sections import Data
    from titanlike.data import preprocess
    from titanlike.data.tokenizers import build_tokenizer

    monkeypatch.setattr(preprocess, "LONG_TEXT_CHARS", 1000)
    big = "the quick brown fox, 42 jumps  over\nthe lazy dog. " * 400
    src = tmp_path / "big.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in (DOCS[0], big, DOCS[1])))
    assert _run("--input", src, "--output-prefix", tmp_path / "o", "--tokenizer-model", tokdir / "tokenizer.json",
                "--append-eod") == 0
    tok = build_tokenizer(Data(tokenizer=str(tokdir / "tokenizer.json")))
    ds = IndexedDataset(tmp_path / "o_text_document")
    assert [ds.get(i).tolist() for i in range(3)] == [tok.encode(t) + [tok.eod_id] for t in (DOCS[0], big, DOCS[1])]
