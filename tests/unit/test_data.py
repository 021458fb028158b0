"""Tokenizer, corpus cache, datasets, DP-sharded sampler and stateful loader (CPU, a few seconds).

A small slice of the stdlib keeps every build quick; the default caps are exercised by the debug run itself.
"""
from __future__ import annotations

import threading
import time
from dataclasses import replace

import numpy as np
import pytest
import torch

from titanlike.config.sections import Data
from titanlike.data import GlobalBatchSampler, MockDataset, build_dataloader, build_dataset
from titanlike.data.cache import build_once, cache_root
from titanlike.data.dataset import split_token_range
from titanlike.data.token_cache import load_tokens, stdlib_token_file
from titanlike.data.tokenizers import build_tokenizer
from titanlike.data.tokenizers.hf import BUILTIN_BOS, BUILTIN_EOS, HFTokenizer, train_bytelevel_bpe

TRAIN_BYTES = 300_000  # tokenizer training slice
CORPUS_BYTES = 400_000  # data slice: ~150k tokens, ~1k windows of 128
VOCAB = 512
SEQ = 128


@pytest.fixture(scope="session")
def cfg(tmp_path_factory) -> Data:
    return Data(builtin_vocab_size=VOCAB, cache_dir=str(tmp_path_factory.mktemp("cache")))


@pytest.fixture(scope="session")
def tok(cfg):
    return build_tokenizer(cfg, max_train_bytes=TRAIN_BYTES)


def loader(cfg, tok, **kw):
    args = dict(dp_rank=0, dp_degree=1, local_batch_size=4, seq_len=SEQ, seed=0)
    args.update(kw)
    return build_dataloader(cfg, tok, max_corpus_bytes=CORPUS_BYTES, **args)


def take(it, n):
    return [tuple(t.clone() for t in next(it)) for _ in range(n)]


def assert_same_batches(a, b):
    assert len(a) == len(b)
    for (xa, ya), (xb, yb) in zip(a, b):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)


# ---------------------------------------------------------------- tokenizer

@pytest.mark.parametrize("text", [
    "def f(x):\n    return x + 1  # ascii\n\n\tindented\r\n  trailing  ",
    "Grüße, naïve café — 東京 🚀 ∑ ẞ\u200b\x00 end",
    " leading space", "", "<|end_of_text|> looks special but is text",
])
def test_round_trip(tok, text):
    assert tok.decode(tok.encode(text)) == text


def test_special_tokens(tok):
    assert tok.vocab_size == VOCAB
    assert (tok.bos_id, tok.eos_id) == (0, 1)
    ids = tok.encode("hello", bos=True, eos=True)
    assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id
    assert tok.decode(ids) == f"{BUILTIN_BOS}hello{BUILTIN_EOS}"
    # markup in the data must never turn into control tokens
    assert tok.eos_id not in tok.encode("a <|end_of_text|> b")
    assert max(tok.encode("東京 🚀 " * 10)) < tok.vocab_size


def test_builtin_cache_hit_identical_and_fast(cfg, tok):
    t0 = time.perf_counter()
    again = build_tokenizer(cfg, max_train_bytes=TRAIN_BYTES)
    assert time.perf_counter() - t0 < 1.0
    assert again.path == tok.path and again.fingerprint == tok.fingerprint
    assert str(tok.path).startswith(str(cache_root(cfg.cache_dir)))
    text = "import os\nprint(os.getcwd())\n"
    assert again.encode(text) == tok.encode(text)


def test_builtin_training_deterministic(cfg, tok, tmp_path):
    other = build_tokenizer(replace(cfg, cache_dir=str(tmp_path)), max_train_bytes=TRAIN_BYTES)
    assert other.path != tok.path and other.path.read_bytes() == tok.path.read_bytes()


def test_cache_dir_from_env(monkeypatch, tmp_path):
    monkeypatch.setenv("TITANLIKE_CACHE", str(tmp_path))
    assert cache_root("") == tmp_path
    assert str(cache_root("/elsewhere")) == "/elsewhere"  # an explicit data.cache_dir wins over the env


def test_build_once_concurrent(tmp_path):
    calls = []

    def build(tmp):
        calls.append(1)
        time.sleep(0.2)  # long enough that the other thread arrives while we hold the lock
        tmp.write_text("done")

    target = tmp_path / "sub" / "artefact.txt"
    threads = [threading.Thread(target=build_once, args=(target, build)) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert target.read_text() == "done" and len(calls) == 1
    assert not [p for p in target.parent.iterdir() if p.name.endswith(".tmp")]


def _save_user_tokenizer(folder, specials):
    folder.mkdir(parents=True, exist_ok=True)
    hf = train_bytelevel_bpe(["some user text " * 50, "more text here"], 300, special_tokens=specials)
    hf.save(str(folder / "tokenizer.json"))
    return folder / "tokenizer.json"


def test_user_tokenizer_json(tmp_path):
    path = _save_user_tokenizer(tmp_path / "llama2like", ["<s>", "</s>"])
    for spec in (str(path), str(path.parent)):  # the file or its folder
        t = build_tokenizer(Data(tokenizer=spec))
        assert isinstance(t, HFTokenizer)
        assert t.bos_id == t._tok.token_to_id("<s>") and t.eos_id == t._tok.token_to_id("</s>")
        assert t.vocab_size == t._tok.get_vocab_size(with_added_tokens=True)
        assert t.decode(t.encode("some user text")) == "some user text"


def test_user_tokenizer_config_hint_and_gpt2_style(tmp_path):
    path = _save_user_tokenizer(tmp_path / "hinted", ["<|x_start|>", "<|x_stop|>", "</s>"])
    (path.parent / "tokenizer_config.json").write_text(
        '{"bos_token": "<|x_start|>", "eos_token": {"content": "<|x_stop|>"}}')
    t = build_tokenizer(Data(tokenizer=str(path)))
    assert (t.bos_id, t.eos_id) == (t._tok.token_to_id("<|x_start|>"), t._tok.token_to_id("<|x_stop|>"))
    # only a document separator: it serves as both bos and eos
    t2 = build_tokenizer(Data(tokenizer=str(_save_user_tokenizer(tmp_path / "gpt2like", ["<|endoftext|>"]))))
    assert t2.bos_id == t2.eos_id == t2._tok.token_to_id("<|endoftext|>")


def test_user_tokenizer_without_eos(tmp_path):
    path = _save_user_tokenizer(tmp_path / "bare", [])
    with pytest.raises(ValueError, match="no eos token"):
        build_tokenizer(Data(tokenizer=str(path)))


def test_missing_tokenizer_path(tmp_path):
    missing = tmp_path / "nope" / "tokenizer.json"
    with pytest.raises(FileNotFoundError) as e:
        build_tokenizer(Data(tokenizer=str(missing)))
    assert str(missing) in str(e.value) and "builtin" in str(e.value)


# ---------------------------------------------------------------- corpus cache and datasets

def test_token_cache_hit(cfg, tok):
    path = stdlib_token_file(tok, cfg.cache_dir, CORPUS_BYTES)
    t0 = time.perf_counter()
    assert stdlib_token_file(tok, cfg.cache_dir, CORPUS_BYTES) == path
    tokens = load_tokens(path)
    assert time.perf_counter() - t0 < 1.0
    assert tokens.dtype == np.uint16 and tokens.size > 50_000
    assert tokens.max() < tok.vocab_size and tokens[-1] == tok.eos_id
    # documents are separated by EOS and decode back to real source text
    first_doc = tokens[: int(np.argmax(tokens == tok.eos_id))]
    assert "import" in tok.decode(first_doc.tolist()) or "def " in tok.decode(first_doc.tolist())


def test_windows_shifted_by_one(cfg, tok):
    ds = build_dataset(cfg, tok, seq_len=SEQ, max_corpus_bytes=CORPUS_BYTES)
    tokens = load_tokens(ds.path)
    for i in (0, 1, len(ds) - 1):
        x, y = ds[i]
        assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (SEQ,)
        assert torch.equal(x[1:], y[:-1])
        assert torch.equal(x, torch.from_numpy(tokens[i * SEQ : i * SEQ + SEQ].astype(np.int64)))
    assert torch.equal(ds[0][1][-1], ds[1][0][0])  # consecutive windows share their boundary token
    with pytest.raises(IndexError):
        ds[len(ds)]


def test_valid_split_disjoint(cfg, tok):
    train = build_dataset(cfg, tok, seq_len=SEQ, split="train", max_corpus_bytes=CORPUS_BYTES)
    valid = build_dataset(cfg, tok, seq_len=SEQ, split="valid", max_corpus_bytes=CORPUS_BYTES)
    assert len(valid) >= 1 and len(valid) < len(train) * 0.05
    last_train_token = train.start + len(train) * SEQ  # inclusive end of the last train label
    assert last_train_token < valid.start and valid.start + len(valid) * SEQ < valid.stop
    assert split_token_range(10_000, 100, "train")[1] <= split_token_range(10_000, 100, "valid")[0]
    xv, _ = next(iter(loader(cfg, tok, split="valid")))
    assert xv.shape == (4, SEQ)
    with pytest.raises(ValueError, match="split"):
        build_dataset(cfg, tok, seq_len=SEQ, split="test", max_corpus_bytes=CORPUS_BYTES)


def test_mock_dataset():
    cfg = Data(dataset="mock")
    a = take(iter(build_dataloader(cfg, None, dp_rank=0, dp_degree=1, local_batch_size=4, seq_len=32, seed=3,
                                   vocab_size=100)), 3)
    b = take(iter(build_dataloader(cfg, None, dp_rank=0, dp_degree=1, local_batch_size=4, seq_len=32, seed=3,
                                   vocab_size=100)), 3)
    assert_same_batches(a, b)
    x, y = a[0]
    assert x.shape == (4, 32) and x.dtype == torch.int64 and 0 <= int(x.min()) and int(x.max()) < 100
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert not torch.equal(MockDataset(100, 32, seed=4)[0][0], MockDataset(100, 32, seed=3)[0][0])
    assert not torch.equal(MockDataset(100, 32, split="valid")[0][0], MockDataset(100, 32)[0][0])


def test_unknown_dataset(tok):
    with pytest.raises(ValueError, match="stdlib"):
        build_dataset(Data(dataset="nope"), tok, seq_len=SEQ)


# ---------------------------------------------------------------- sampler / loader: sharding and resume

@pytest.mark.parametrize("shuffle", [True, False])
def test_sampler_global_batch_independent_of_dp(shuffle):
    n, G, steps = 37, 8, 12  # 4 batches per epoch: covers three epoch rollovers
    ref = iter(GlobalBatchSampler(n, dp_rank=0, dp_degree=1, local_batch_size=G, seed=5, shuffle=shuffle))
    ref_batches = [next(ref) for _ in range(steps)]
    for D in (2, 4, 8):
        its = [iter(GlobalBatchSampler(n, dp_rank=r, dp_degree=D, local_batch_size=G // D, seed=5, shuffle=shuffle))
               for r in range(D)]
        for b in range(steps):
            parts = [next(it) for it in its]
            assert sum(parts, []) == ref_batches[b]
    if shuffle:  # epochs of all n samples back to back (no tail dropped), each a fresh order
        flat = sum(ref_batches, [])
        for e in range(2):
            assert sorted(flat[e * n : (e + 1) * n]) == list(range(n))
        assert flat[:n] != flat[n : 2 * n]


def test_sampler_resume_across_epochs():
    make = lambda: iter(GlobalBatchSampler(20, dp_rank=1, dp_degree=2, local_batch_size=3, seed=1))
    it = make()
    for _ in range(4):  # 3 batches per epoch: state is taken in the second epoch
        next(it)
    state = it.state_dict()
    expected = [next(it) for _ in range(5)]
    it2 = make()
    it2.load_state_dict(state)
    assert [next(it2) for _ in range(5)] == expected
    for key, value in (("seed", 2), ("num_samples", 21), ("fingerprint", "other-data")):
        with pytest.raises(ValueError, match=key):
            make().load_state_dict(dict(state, **{key: value}))


def test_sampler_resume_under_other_layout():
    """Position-based state: D=2 x L=3 resumes as D=3 x L=1 (and back) at the same global sample, none lost."""
    n = 23
    ref = iter(GlobalBatchSampler(n, dp_rank=0, dp_degree=1, local_batch_size=6, seed=4))
    stream = sum((next(ref) for _ in range(12)), [])  # 72 positions: three epochs
    old = [iter(GlobalBatchSampler(n, dp_rank=r, dp_degree=2, local_batch_size=3, seed=4)) for r in range(2)]
    seen = [sum((next(it) for it in old), []) for _ in range(5)]  # 5 micro-batches of 6 = 30 samples
    state = old[0].state_dict()
    assert state == old[1].state_dict() and state["position"] == 30
    new = [iter(GlobalBatchSampler(n, dp_rank=r, dp_degree=3, local_batch_size=1, seed=4)) for r in range(3)]
    for it in new:
        it.load_state_dict(state)
    seen += [sum((next(it) for it in new), []) for _ in range(14)]  # 14 x 3 = 42 more
    assert sum(seen, []) == stream


@pytest.mark.parametrize("D", [1, 2, 4])
def test_loader_dp_shards_partition_global_batch(cfg, tok, D):
    G = 8
    ref = take(iter(loader(cfg, tok, local_batch_size=G)), 3)
    shards = [take(iter(loader(cfg, tok, dp_rank=r, dp_degree=D, local_batch_size=G // D)), 3) for r in range(D)]
    for b in range(3):
        x = torch.cat([shards[r][b][0] for r in range(D)])
        y = torch.cat([shards[r][b][1] for r in range(D)])
        assert torch.equal(x, ref[b][0]) and torch.equal(y, ref[b][1])
        rows = {tuple(row.tolist()) for row in x}
        assert len(rows) == G  # ranks got disjoint samples


@pytest.mark.parametrize("num_workers", [0, 1])
def test_loader_resume_exact(cfg, tok, num_workers):
    wcfg = replace(cfg, num_workers=num_workers)
    dl = loader(wcfg, tok)
    it = iter(dl)
    take(it, 3)
    state = dl.state_dict()
    expected = take(it, 4)
    dl2 = loader(wcfg, tok)
    dl2.load_state_dict(state)
    assert_same_batches(take(iter(dl2), 4), expected)


def test_loader_state_reshards_across_dp(cfg, tok):
    """A data state saved under dp=1 resumes under dp=2 with the same global batches (same global batch size)."""
    dl = loader(cfg, tok, local_batch_size=8)
    it = iter(dl)
    take(it, 2)
    state = dl.state_dict()
    expected = take(it, 2)
    shards = []
    for r in range(2):
        d = loader(cfg, tok, dp_rank=r, dp_degree=2, local_batch_size=4)
        d.load_state_dict(state)
        shards.append(take(iter(d), 2))
    for b in range(2):
        assert torch.equal(torch.cat([shards[0][b][0], shards[1][b][0]]), expected[b][0])


def test_long_windows(cfg, tok):
    """Long-context runs read the same loader: 32k-token windows (a 180k-token corpus holds five) come back whole,
    labels shifted by one, and the loader resumes mid-epoch."""
    seq = 32768
    dl = loader(cfg, tok, local_batch_size=1, seq_len=seq)
    it = iter(dl)
    x, y = next(it)
    assert x.shape == y.shape == (1, seq) and torch.equal(x[0, 1:], y[0, :-1])
    state = dl.state_dict()
    second = next(it)
    resumed = loader(cfg, tok, local_batch_size=1, seq_len=seq)
    resumed.load_state_dict(state)
    assert_same_batches([second], [next(iter(resumed))])
