"""Indexed data: GPT sample index (EOD-joined windows, seeded shuffle, epochs, disk cache), splits, blends, the
loader on top (exact resume, worker-count change, data-change refusal) and the config rules around it."""
from __future__ import annotations

import os
from dataclasses import replace

import numpy as np
import pytest
import torch

from titanlike.config import ConfigError, load_config
from titanlike.config.sections import Data, Validation
from titanlike.data import (
    BlendedDataset, GPTDataset, IndexedDataset, IndexedDatasetWriter, build_dataloader, build_dataset, parse_blend,
    validation_data_config,
)
from titanlike.data.gpt_dataset import split_document_ranges

EOD = 255
SEQ = 16


def _write(prefix, seed, docs=200, hi=EOD):
    rng = np.random.default_rng(seed)
    w = IndexedDatasetWriter(prefix, np.uint16)
    docs = [np.append(rng.integers(0, hi, rng.integers(3, 40)), EOD) for _ in range(docs)]
    for d in docs:
        w.add_document(d)
    w.finalize()
    return docs


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("indexed")
    docs = {name: _write(str(root / name), seed) for name, seed in (("a", 1), ("b", 2))}
    return root, docs, str(root / "cache")


def test_windows_join_documents_and_cross_epochs(data):
    root, docs, cache = data
    stream = np.concatenate(docs["a"])
    ds = GPTDataset(IndexedDataset(root / "a"), (0, 200), SEQ, shuffle=False, cache_dir=cache)
    for i in (0, 1, 7, len(stream) // SEQ - 1, len(stream) // SEQ + 3):  # the last ones wrap into epoch 2
        assert ds.window(i).tolist() == np.concatenate([stream, stream])[i * SEQ : i * SEQ + SEQ + 1].tolist()
    x, y = ds[3]
    assert x.dtype == torch.int64 and torch.equal(x[1:], y[:-1]) and x.shape == (SEQ,)


def test_shuffle_is_a_seeded_permutation_cached_on_disk(data):
    root, _, cache = data
    idx = IndexedDataset(root / "a")
    before = set(os.listdir(os.path.join(cache, "index"))) if os.path.isdir(os.path.join(cache, "index")) else set()
    ds = GPTDataset(idx, (0, 200), SEQ, seed=3, cache_dir=cache)
    k = ds.samples_per_block
    assert sorted(ds.physical_index(i) for i in range(k)) == list(range(k))  # one block = a permutation
    assert sorted(ds.physical_index(i) for i in range(k, 2 * k)) == list(range(k, 2 * k))
    first = [ds.window(i).tolist() for i in range(2 * k)]
    built = set(os.listdir(os.path.join(cache, "index"))) - before
    assert len(built) >= 5 and not [f for f in built if ".tmp" in f]  # orders/ends of 2 epochs + 2 block perms
    again = GPTDataset(idx, (0, 200), SEQ, seed=3, cache_dir=cache)
    mtimes = {f: os.stat(os.path.join(cache, "index", f)).st_mtime_ns for f in built}
    assert [again.window(i).tolist() for i in range(2 * k)] == first  # same sequence, read from the cache
    assert mtimes == {f: os.stat(os.path.join(cache, "index", f)).st_mtime_ns for f in built}
    other = GPTDataset(idx, (0, 200), SEQ, seed=4, cache_dir=cache)
    assert [other.window(i).tolist() for i in range(10)] != first[:10]


def test_split_ranges_megatron_rounding():
    assert split_document_ranges(1000, "949,50,1") == [(0, 949), (949, 999), (999, 1000)]
    assert split_document_ranges(10, "98/2") == [(0, 10), (10, 10), (10, 10)]
    with pytest.raises(ValueError, match="data.split='1,x'"):
        split_document_ranges(10, "1,x")


def test_train_valid_test_are_disjoint_documents(data):
    root, docs, cache = data
    cfg = Data(dataset="indexed", paths=[str(root / "a")], split="80,15,5", cache_dir=cache)
    tr, va, te = (build_dataset(cfg, None, seq_len=SEQ, split=s, vocab_size=256) for s in ("train", "valid", "test"))
    assert (tr.seq_lo, tr.seq_hi, va.seq_lo, va.seq_hi, te.seq_lo, te.seq_hi) == (0, 160, 160, 190, 190, 200)
    assert va.window(0).tolist() == np.concatenate(docs["a"][160:])[: SEQ + 1].tolist()  # valid: in order


def test_blend_reproduces_the_mixture(data):
    root, _, cache = data
    parts = [GPTDataset(IndexedDataset(root / n), (0, 200), SEQ, cache_dir=cache) for n in ("a", "b")]
    blend = BlendedDataset(parts, [0.3, 0.7])
    n = 3 * BlendedDataset.CHUNK // 2  # crosses a chunk boundary
    src = np.array([blend.source(i) for i in range(0, n)])
    share = np.cumsum(src[:, 0] == 0) / np.arange(1, n + 1)
    assert np.all(np.abs(share * np.arange(1, n + 1) - 0.3 * np.arange(1, n + 1)) <= 1.0)  # within one sample
    for d in (0, 1):  # each dataset's samples are taken in order, none skipped or repeated
        assert src[src[:, 0] == d, 1].tolist() == list(range(int((src[:, 0] == d).sum())))
    far = 10**9  # random access far out, no prefix walk
    assert abs(sum(blend.source(i)[0] == 1 for i in range(far, far + 1000)) - 700) <= 2
    assert torch.equal(blend[5][0], parts[blend.source(5)[0]][blend.source(5)[1]][0])


def test_parse_blend():
    assert parse_blend(["0.3 a 0.7 b"]) == (["a", "b"], [0.3, 0.7])
    assert parse_blend(["a", "b"]) == (["a", "b"], None)
    for bad, msg in (("0.3 a 0.7", "the last weight has no prefix"), ("x a 0.7 b", "'x' at position 1"),
                     ("0.3 a b 0.7", "'b' at position 3 should be a weight"), ("-1 a", "positive")):
        with pytest.raises(ValueError, match=msg):
            parse_blend([bad])


def test_vocab_check_at_startup(data):
    root, _, cache = data
    cfg = Data(dataset="indexed", paths=[f"1 {root / 'a'} 1 {root / 'b'}"], cache_dir=cache)
    with pytest.raises(ValueError, match=r"token id 255 .* vocabulary has 200"):
        build_dataset(cfg, None, seq_len=SEQ, vocab_size=200)


@pytest.mark.parametrize("workers", [0, 1])
def test_loader_resume_exact_and_refuses_other_data(data, workers):
    root, _, cache = data
    cfg = Data(dataset="indexed", paths=[f"0.4 {root / 'a'} 0.6 {root / 'b'}"], cache_dir=cache, num_workers=workers)

    def make(c=cfg, **kw):
        return build_dataloader(c, None, **{**dict(dp_rank=0, dp_degree=1, local_batch_size=4, seq_len=SEQ, seed=1,
                                                   vocab_size=256), **kw})

    ref = iter(make())
    expected = [next(ref)[0] for _ in range(7)]
    dl = make()
    it = iter(dl)
    [next(it) for _ in range(3)]
    state = dl.state_dict()
    for c in (cfg, replace(cfg, num_workers=1 - workers)):  # also resumes under another worker count
        dl2 = make(c)
        dl2.load_state_dict(state)
        it2 = iter(dl2)
        assert all(torch.equal(next(it2)[0], e) for e in expected[3:])
    dl3 = make(replace(cfg, paths=[f"0.5 {root / 'a'} 0.5 {root / 'b'}"]))
    with pytest.raises(ConfigError, match=r"blend weights \[0.4, 0.6\] -> \[0.5, 0.5\]"):
        dl3.load_state_dict(state)  # refused at load, before torchdata restores anything
    with pytest.raises(ConfigError, match="fingerprint"):  # a state from before the record: the sampler's check
        dl3.load_state_dict({k: v for k, v in state.items() if k != "built_with"})


def test_validation_data_config_and_rules(data):
    root, _, _ = data
    d = Data(dataset="indexed", paths=[str(root / "a")])
    assert validation_data_config(d, Validation(split="test")) == (d, "test")
    vd, split = validation_data_config(d, Validation(paths=[str(root / "b")]))
    assert vd.paths == [str(root / "b")] and vd.split == "0,100,0" and split == "valid"  # the whole held-out prefix
    for argv, msg in ((["--data.dataset=indexed"], "data.paths is empty"),
                      (["--data.paths=a"], "data.dataset=indexed"),
                      (["--data.dataset=indexed", "--data.paths=0.5 a 0.5"], "cannot parse the blend"),
                      (["--data.dataset=indexed", "--data.paths=a", "--data.split=1,2,3,4"], "data.split"),
                      (["--validation.split=dev"], "validation.split"),
                      (["--data.tokenizer_type=Bert"], "data.tokenizer_type"),
                      (["--data.vocab_file=v.json"], "data.merge_file")):
        with pytest.raises(ConfigError, match=msg):
            load_config(argv)
