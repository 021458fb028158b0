"""Streaming text (JSONL/.gz, Parquet, .txt): on-the-fly packing, DP sharding, exact resume, bad input."""
from __future__ import annotations

import gzip
import json
import logging
from dataclasses import replace

import pytest
import torch

from titanlike.config.sections import Data
from titanlike.data import StreamingTextDataset, build_dataloader
from titanlike.data.streaming import expand_files
from titanlike.data.tokenizers.null import NullTokenizer

SEQ = 8
TOK = NullTokenizer(1000)  # documents are id lists ("3 4 5"): packing is checked token by token; EOD = 1000


def _doc(f, i):
    return " ".join(str((30 * f + i) * 5 + k) for k in range(i % 5 + 1))  # ids unique to the document


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("stream")
    for f in range(2):
        (root / f"part{f}.jsonl").write_text("".join(json.dumps({"text": _doc(f, i)}) + "\n" for i in range(30)))
    with gzip.open(root / "part2.jsonl.gz", "wt") as g:
        g.write("".join(json.dumps({"text": _doc(2, i)}) + "\n" for i in range(30)))
    (root / "part3.txt").write_text(_doc(3, 4))
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({"text": [_doc(4, i) for i in range(25)]}), root / "part4.parquet", row_group_size=6)
    except ImportError:
        pass
    return root


def _cfg(files, **kw):
    return Data(dataset="text", paths=[str(files)], **kw)


def _loader(cfg, **kw):
    return build_dataloader(cfg, TOK, **{**dict(dp_rank=0, dp_degree=1, local_batch_size=2, seq_len=SEQ, seed=0,
                                                split="valid"), **kw})


def test_packs_documents_with_eod_in_order(files):
    paths = expand_files([str(files)])
    ds = StreamingTextDataset(paths, TOK, SEQ, shuffle=False)
    stream = []
    for p in paths:  # the expected stream, built independently
        if p.endswith(".txt"):
            texts = [open(p).read()]
        elif p.endswith(".parquet"):
            import pyarrow.parquet as pq
            texts = pq.read_table(p).column("text").to_pylist()
        else:
            opener = gzip.open if p.endswith(".gz") else open
            with opener(p, "rt") as f:
                texts = [json.loads(line)["text"] for line in f]
        for t in texts:
            stream += TOK.encode(t) + [TOK.eod_id]
    it = iter(ds)
    got = [next(it) for _ in range(len(stream) // SEQ - 1)]
    for i, (x, y) in enumerate(got):
        assert x.tolist() == stream[i * SEQ : i * SEQ + SEQ] and y.tolist() == stream[i * SEQ + 1 : i * SEQ + SEQ + 1]
    x, _ = next(iter(ds))  # a fresh iteration restarts: validation passes are repeatable
    assert x.tolist() == stream[:SEQ]


def test_dp_ranks_take_disjoint_documents(files):
    seen = []
    for r in range(2):
        ds = StreamingTextDataset(expand_files([str(files)]), TOK, SEQ, dp_rank=r, dp_degree=2, shuffle=False)
        it = iter(ds)
        seen.append({t for _ in range(20) for t in next(it)[0].tolist() if t != TOK.eod_id})
    assert not seen[0] & seen[1]


@pytest.mark.parametrize("workers", [0, 1])
def test_resume_exact(files, workers):
    cfg = _cfg(files, num_workers=workers)
    ref = iter(_loader(cfg, split="train"))
    expected = [next(ref)[0] for _ in range(60)]  # > one epoch: file order reshuffles per epoch
    dl = _loader(cfg, split="train")
    it = iter(dl)
    [next(it) for _ in range(23)]
    state = dl.state_dict()
    dl2 = _loader(cfg, split="train")
    dl2.load_state_dict(state)
    it2 = iter(dl2)
    assert all(torch.equal(next(it2)[0], e) for e in expected[23:])
    with pytest.raises(ValueError, match="same DP degree"):
        _loader(cfg, split="train", dp_rank=1, dp_degree=2).load_state_dict(state)


def test_bad_documents_skipped_and_reported(tmp_path, caplog):
    p = tmp_path / "mixed.jsonl"
    p.write_bytes(b'{"text": "1 2 3"}\n{"text": oops\n\xff\xfe\n{"body": "4"}\n{"text": ""}\n'
                  b'{"text": "5 6 7 8 9"}\n' * 3)
    ds = StreamingTextDataset([str(p)], TOK, SEQ, shuffle=False)
    it = iter(ds)
    log = logging.getLogger("titanlike.data.streaming")
    log.addHandler(caplog.handler)  # setup_logging() elsewhere stops "titanlike" propagating to the root
    try:
        with caplog.at_level(logging.WARNING, logger=log.name):
            toks = [t for _ in range(3) for t in next(it)[0].tolist()]
    finally:
        log.removeHandler(caplog.handler)
    assert set(toks) <= {1, 2, 3, 5, 6, 7, 8, 9, TOK.eod_id}
    assert "mixed.jsonl:2: invalid JSON" in caplog.text and "mixed.jsonl:3: not valid UTF-8" in caplog.text
    assert "mixed.jsonl:4: no key 'text'" in caplog.text and ds.state_dict()["bad"] >= 4


def test_startup_errors(tmp_path, files):
    with pytest.raises(FileNotFoundError, match="matches no file"):
        expand_files([str(tmp_path / "none*.jsonl")])
    (tmp_path / "k.jsonl").write_text('{"content": "1 2"}\n')
    with pytest.raises(ValueError, match=r"k.jsonl:1: no key 'text'.*data.text_key"):
        _loader(_cfg(tmp_path / "k.jsonl"))
    assert _loader(_cfg(tmp_path / "k.jsonl", text_key="content")) is not None
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match="unknown file type"):
        _loader(replace(_cfg(files), paths=[str(tmp_path / "x.csv")]))
