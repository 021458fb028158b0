"""Data faults a user meets, each reproduced with tiny files: data with no usable document (must fail at once, not
spin over epochs), broken .idx headers, every JSON line bad, garbage tokenizer files, resuming with other data /
seq_len / global batch, and the start-up data summary. Each error is one line naming the file (or key) and the fix."""
from __future__ import annotations

import multiprocessing as mp
import queue
import struct
from dataclasses import replace

import numpy as np
import pytest

from titanlike.config import ConfigError
from titanlike.config.sections import Data
from titanlike.data import IndexedDatasetWriter, StreamingTextDataset, build_dataloader
from titanlike.data.indexed import MAGIC
from titanlike.data.tokenizers.null import NullTokenizer

TOK = NullTokenizer(1000)  # documents are id lists ("3 4 5"); EOD = 1000
SEQ = 8


def _within(seconds: float, fn, *args, **kwargs):
    """fn(*args, **kwargs) in a forked process: ("ok", "", "") or ("raised", type name, message). A hang (the bug these
    tests guard against) kills the process and fails the test instead of stalling the suite."""
    ctx = mp.get_context("fork")
    q = ctx.Queue()

    def target():
        try:
            fn(*args, **kwargs)
            q.put(("ok", "", ""))
        except BaseException as e:  # noqa: BLE001 - reported to the test as data
            q.put(("raised", type(e).__name__, str(e)))

    p = ctx.Process(target=target)
    p.start()
    try:
        return q.get(timeout=seconds)
    except queue.Empty:
        pytest.fail(f"{getattr(fn, '__name__', fn)} still running after {seconds}s: it hangs", pytrace=False)
    finally:
        if p.is_alive():
            p.kill()
        p.join()


def _loader(paths, **kw):
    cfg = Data(dataset="text", paths=[str(p) for p in paths], **kw.pop("cfg", {}))
    args = dict(dp_rank=0, dp_degree=1, local_batch_size=2, seq_len=SEQ, seed=0, split="train")
    return build_dataloader(cfg, TOK, **{**args, **kw})


def _first_batch(paths, **kw):
    next(iter(_loader(paths, **kw)))


def _iterate_dataset(path):  # no start-up check: the iteration itself must stop after one empty epoch
    next(iter(StreamingTextDataset([str(path)], TOK, SEQ, shuffle=False)))


def test_the_config_and_the_data_package_name_the_same_datasets():
    from titanlike.config.validate_data import DATASET_NAMES
    from titanlike.data import DATASETS

    assert tuple(DATASETS) == DATASET_NAMES  # the config accepts exactly the kinds the loader builds


# ------------------------------------------------------------------------------------- 1. no usable document

@pytest.mark.parametrize("name, content, expect", [
    ("empty.jsonl", b"", "no documents at all"),
    ("blank.jsonl", b'{"text": ""}\n' * 3, "empty document x3"),
    ("bad.txt", b"\xff", "not valid UTF-8 x1"),
])
def test_no_usable_document_fails_at_once(tmp_path, name, content, expect):
    path = tmp_path / name
    path.write_bytes(content)
    status, kind, msg = _within(60, _first_batch, [path])
    assert status == "raised" and kind in ("ValueError", "ConfigError"), (status, kind, msg)
    assert str(path) in msg and expect in msg and "\n" not in msg
    status, kind, msg = _within(60, _iterate_dataset, path)  # the iteration's own guard, without the check
    assert status == "raised" and str(path) in msg and "\n" not in msg, (status, kind, msg)


def test_usable_data_still_trains(tmp_path):
    path = tmp_path / "ok.jsonl"
    path.write_text('{"text": "1 2 3"}\n{"text": ""}\n')  # 4 tokens an epoch < one sample: repeats, no error
    assert _within(60, _first_batch, [path])[0] == "ok"


def test_too_few_documents_for_the_shards(tmp_path):
    path = tmp_path / "one.jsonl"
    path.write_text('{"text": "1 2 3"}\n')
    status, kind, msg = _within(60, _first_batch, [path], dp_rank=1, dp_degree=2)
    assert kind == "ConfigError" and "none for shard 1 of 2" in msg and "data.num_workers" in msg, msg


def _empty_prefix(prefix, lengths=()):
    """An index with the given (possibly zero) document lengths and an empty .bin."""
    n = len(lengths)
    with open(f"{prefix}.idx", "wb") as f:
        f.write(struct.pack("<9sQBQQ", MAGIC, 1, 8, n, n + 1))
        f.write(np.asarray(lengths, np.int32).tobytes() + np.zeros(n, np.int64).tobytes()
                + np.arange(n + 1, dtype=np.int64).tobytes())
    open(f"{prefix}.bin", "wb").close()


def _indexed_batch(prefix):
    cfg = Data(dataset="indexed", paths=[str(prefix)], split="100,0,0", cache_dir=str(prefix) + "_cache")
    next(iter(build_dataloader(cfg, None, dp_rank=0, dp_degree=1, local_batch_size=2, seq_len=SEQ, seed=0,
                               vocab_size=256)))


@pytest.mark.parametrize("lengths, expect", [((), "holds no documents"), ((0, 0), "hold no tokens")])
def test_indexed_without_tokens_fails_at_once(tmp_path, lengths, expect):
    prefix = tmp_path / "d_text_document"
    _empty_prefix(prefix, lengths)
    status, kind, msg = _within(60, _indexed_batch, prefix)
    assert status == "raised" and f"{prefix}.idx" in msg and expect in msg and "preprocess_data.py" in msg, msg


# ------------------------------------------------------------------------------------- 2. broken .idx headers

def _good_prefix(tmp_path):
    prefix = str(tmp_path / "c_text_document")
    w = IndexedDatasetWriter(prefix, np.uint16)
    for n in (5, 7):
        w.add_document(np.arange(n) + 1)
    w.finalize()
    return prefix


@pytest.mark.parametrize("patch, expect", [
    (lambda h: h[:9] + struct.pack("<Q", 2) + h[17:], r"MMIDIDX index version 2, expected 1 .*Megatron"),
    (lambda h: h[:17] + bytes([99]) + h[18:], r"token dtype code 99 in the MMIDIDX header, expected one of 1=uint8"),
    (lambda h: b"TNTIDX\x00\x00" + h[8:], r"old 'lazy'/'cached' index .*mmap"),
    (lambda h: b"PK\x03\x04garbage" + h[13:], r"not a Megatron MMIDIDX index \(first bytes b'PK"),
    (lambda h: h[:20], r"20 bytes, shorter than the 34-byte MMIDIDX header: the file is truncated"),
    (lambda h: h[:-3], r"bytes, but its header promises .*truncated or corrupt"),
])
def test_idx_header_errors_say_file_found_expected_and_fix(tmp_path, patch, expect):
    from titanlike.data import IndexedDataset

    prefix = _good_prefix(tmp_path)
    with open(prefix + ".idx", "rb") as f:
        head = f.read()
    with open(prefix + ".idx", "wb") as f:
        f.write(patch(head))
    with pytest.raises(ValueError, match=expect) as e:
        IndexedDataset(prefix)
    msg = str(e.value)
    assert msg.startswith(prefix + ".idx: ") and "preprocess_data.py" in msg and "\n" not in msg


# ------------------------------------------------------------------------------------- 3. every JSON line bad

def _preprocess(*argv, tokenizer=("--tokenizer-type", "NullTokenizer", "--vocab-size", "1000")) -> int:
    """scripts/preprocess_data.py's main(), as its users run it (the script is not a package module)."""
    import importlib.util

    from tests.launch import REPO_ROOT

    spec = importlib.util.spec_from_file_location("_preprocess_cli", REPO_ROOT / "scripts" / "preprocess_data.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script.main([str(a) for a in (*argv, *tokenizer, "--no-progress")])


@pytest.mark.parametrize("lines, expect, fix", [
    ('{"content": "1 2"}\n' * 3, "no key 'text' x3", "--json-keys"),
    ('{"text": 5}\n' * 2, "key 'text' holds int", "--json-keys"),
    ("1 2 3\nnot json\n", "invalid JSON x2", "JSON Lines"),
    ("", "no lines to preprocess", "--input"),
])
def test_preprocess_every_line_bad_names_the_flag(tmp_path, capsys, lines, expect, fix):
    (tmp_path / "in.jsonl").write_text(lines)
    assert _preprocess("--input", tmp_path / "in.jsonl", "--output-prefix", tmp_path / "out") == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error: ") and str(tmp_path / "in.jsonl") in err and expect in err and fix in err, err
    assert "data.text_key" not in err  # the training knob does not exist on this command line
    assert not list(tmp_path.glob("out*"))  # nothing written, not even an empty .bin/.idx


@pytest.mark.parametrize("lines, expect, fix, kind", [
    ('{"content": "1 2"}\n' * 2, "no key 'text' (found ['content'])", "set data.text_key", ConfigError),
    ('oops\n{"content": "1 2"}\n{"content": "3"}\n', "no key 'text' x2", "set data.text_key", ConfigError),
    ("1 2 3\nnot json\n", "invalid JSON x2", "one JSON object", ValueError),
])
def test_training_every_line_bad_names_the_key(tmp_path, lines, expect, fix, kind):
    (tmp_path / "in.jsonl").write_text(lines)
    with pytest.raises(kind) as e:
        _loader([tmp_path / "in.jsonl"])
    msg = str(e.value)
    assert str(tmp_path / "in.jsonl") in msg and expect in msg and fix in msg and "\n" not in msg, msg
    assert "--json-keys" not in msg and (kind is ConfigError or "text_key" not in msg)


# ------------------------------------------------------------------------------------- 4. garbage tokenizer files

GARBAGE = np.random.default_rng(0).bytes(3000)


@pytest.mark.parametrize("name, content, extra, expect", [
    ("tokenizer.json", GARBAGE, {}, "not a Hugging Face tokenizer.json"),
    ("tokenizer.json", b'{"version": "1.0"}', {"tokenizer_type": "HuggingFaceTokenizer"},
     "not a Hugging Face tokenizer.json"),
    ("tokenizer.model", GARBAGE, {}, "not a sentencepiece model"),
    ("tokenizer.model", GARBAGE, {"tokenizer_type": "TikTokenizer"}, "not a tiktoken rank line"),
    ("tokenizer.model", b"YQ== 0\nYg== 0\n", {}, "ranks are not 0..1"),  # tiktoken would panic (Rust)
    ("tokenizer.model", b"YQ== 0\nYg== 1\n", {}, "254 of the 256 single bytes have no rank"),  # panics on encode
])
def test_garbage_tokenizer_file_is_one_line(tmp_path, capfd, name, content, extra, expect):
    from titanlike.data.tokenizers import build_tokenizer

    path = tmp_path / name
    path.write_bytes(content)
    for spec in (path, tmp_path):  # the file, or the folder holding it
        with pytest.raises(ValueError) as e:
            build_tokenizer(Data(tokenizer=str(spec), **extra))
        msg = str(e.value)
        assert msg.startswith(f"{path}") and expect in msg and "\n" not in msg, msg
        assert "point data.tokenizer at" in msg and "set data.tokenizer_type to" in msg
    assert "panicked" not in capfd.readouterr().err


def test_garbage_gpt2_files(tmp_path):
    from titanlike.data.tokenizers import build_tokenizer

    (tmp_path / "vocab.json").write_bytes(GARBAGE)
    (tmp_path / "merges.txt").write_bytes(GARBAGE)
    with pytest.raises(ValueError, match=r"vocab.json / .*merges.txt: not GPT-2 BPE files .*point data.vocab_file / "
                                         r"data.merge_file at"):
        build_tokenizer(Data(vocab_file=str(tmp_path / "vocab.json"), merge_file=str(tmp_path / "merges.txt")))


def test_garbage_tokenizer_in_preprocessing_names_its_flags(tmp_path, capsys):
    (tmp_path / "tokenizer.json").write_bytes(GARBAGE)
    (tmp_path / "in.jsonl").write_text('{"text": "hello"}\n')
    assert _preprocess("--input", tmp_path / "in.jsonl", "--output-prefix", tmp_path / "out",
                       tokenizer=("--tokenizer-model", tmp_path / "tokenizer.json")) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {tmp_path / 'tokenizer.json'}: not a Hugging Face tokenizer.json")
    assert "\n" not in err
    assert "point --tokenizer-model at" in err and "set --tokenizer-type to" in err and "data." not in err, err


# ------------------------------------------------------------------------------------- 5. resume with other data

def _write_prefix(prefix, seed, docs=60):
    rng = np.random.default_rng(seed)
    w = IndexedDatasetWriter(prefix, np.uint16)
    for _ in range(docs):
        w.add_document(np.append(rng.integers(0, 255, rng.integers(3, 30)), 255))
    w.finalize()
    return prefix


@pytest.fixture(scope="module")
def prefixes(tmp_path_factory):
    root = tmp_path_factory.mktemp("resume")
    return root, _write_prefix(str(root / "a"), 1), _write_prefix(str(root / "b"), 2)


def _indexed_loader(root, paths, *, seq_len=SEQ, global_batch_size=8, dp_rank=0, dp_degree=1, local=4, split="90,10,0"):
    cfg = Data(dataset="indexed", paths=paths, split=split, cache_dir=str(root / "cache"))
    return build_dataloader(cfg, None, dp_rank=dp_rank, dp_degree=dp_degree, local_batch_size=local, seq_len=seq_len,
                            seed=3, vocab_size=256, global_batch_size=global_batch_size)


def _saved_state(root, a):
    dl = _indexed_loader(root, [a])
    it = iter(dl)
    [next(it) for _ in range(2)]
    return dl.state_dict()


@pytest.mark.parametrize("change, expect", [
    (dict(seq_len=2 * SEQ), f"training.seq_len {SEQ} -> {2 * SEQ}"),
    (dict(global_batch_size=16), "training.global_batch_size 8 -> 16"),
    (dict(split="80,20,0"), "data.split '90,10,0' -> '80,20,0'"),
    ("b", "data.paths ["),
    ("blend", "blend weights 'by token count' -> [0.5, 0.5]"),
])
def test_resume_with_other_data_is_one_config_error(prefixes, change, expect):
    root, a, b = prefixes
    state = _saved_state(root, a)
    if change == "b":
        dl = _indexed_loader(root, [b])
    elif change == "blend":
        dl = _indexed_loader(root, [f"0.5 {a} 0.5 {b}"])
    else:
        dl = _indexed_loader(root, [a], **change)
    with pytest.raises(ConfigError) as e:
        dl.load_state_dict(state)
    msg = str(e.value)
    assert expect in msg and "\n" not in msg, msg
    assert "start a new run with a different job.run_name" in msg and "checkpoint.initial_load_path=" in msg
    if change == "b":
        assert f"[{a}] -> [{b}]" in msg


def test_resume_reshard_moved_files_and_old_states_still_load(prefixes, tmp_path):
    import shutil

    root, a, _ = prefixes
    ref = _indexed_loader(root, [a])
    expected = [row for _, (x, _) in zip(range(4), ref) for row in x.tolist()]
    state = _saved_state(root, a)
    # the same global batch of 8 on 2 ranks x 4 (half the accumulation): rank 0 and 1 split the next 8 samples
    got = []
    for r in range(2):
        dl = _indexed_loader(root, [a], dp_rank=r, dp_degree=2)
        dl.load_state_dict(state)
        got += next(iter(dl))[0].tolist()
    assert sorted(got) == sorted(expected[8:16])
    for suffix in (".bin", ".idx"):  # copied elsewhere: identified by content, not path
        shutil.copy(a + suffix, tmp_path / f"moved{suffix}")
    dl = _indexed_loader(root, [str(tmp_path / "moved")])
    dl.load_state_dict(state)
    assert next(iter(dl))[0].tolist() == expected[8:12]
    old = {k: v for k, v in state.items() if k != "built_with"}  # a checkpoint written before the record
    dl = _indexed_loader(root, [a], global_batch_size=16)  # (not comparable then: loads)
    dl.load_state_dict(old)
    assert next(iter(dl))[0].tolist() == expected[8:12]


def test_streaming_resume_with_other_seq_len_or_layout(tmp_path):
    path = tmp_path / "s.jsonl"
    path.write_text("".join(f'{{"text": "{i} {i + 1} {i + 2}"}}\n' for i in range(40)))
    dl = _loader([path])
    it = iter(dl)
    next(it)
    state = dl.state_dict()
    with pytest.raises(ConfigError, match=f"training.seq_len {SEQ} -> {2 * SEQ}.*job.run_name"):
        _loader([path], seq_len=2 * SEQ).load_state_dict(state)
    with pytest.raises(ConfigError, match=r"data-parallel degree 1 -> 2: .*same DP degree.*\.bin/\.idx"):
        _loader([path], dp_rank=0, dp_degree=2).load_state_dict(state)
    dl2 = _loader([path])
    dl2.load_state_dict(state)
    assert next(iter(dl2))[0].tolist() == next(it)[0].tolist()


# ------------------------------------------------------------------------------------- 6. the data summary

@pytest.fixture
def summary_log(caplog):
    import logging

    log = logging.getLogger("titanlike.data.summary")
    # caplog's handler right on the logger, propagation off: each record once, whether or not setup_logging() ran
    # elsewhere in this process (it stops "titanlike" propagating to the root, where caplog listens)
    log.addHandler(caplog.handler)
    log.propagate = False
    try:
        with caplog.at_level(logging.INFO, logger=log.name):
            yield caplog
    finally:
        log.removeHandler(caplog.handler)
        log.propagate = True


def _lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "titanlike.data.summary"]


def test_summary_of_an_indexed_blend(tmp_path, summary_log):
    a, b = str(tmp_path / "sa"), str(tmp_path / "sb")
    for prefix, docs in ((a, [10] * 20), (b, [5] * 40)):  # 200 tokens each: 20 x 10 and 40 x 5
        w = IndexedDatasetWriter(prefix, np.uint16)
        for n in docs:
            w.add_document(np.arange(n) + 1)
        w.finalize()
    cfg = Data(dataset="indexed", paths=[f"0.3 {a} 0.7 {b}"], split="90,10,0", cache_dir=str(tmp_path / "cache"))
    kw = dict(dp_rank=0, dp_degree=1, local_batch_size=2, seq_len=SEQ, seed=0, vocab_size=256)
    build_dataloader(cfg, None, **kw, global_batch_size=4, steps=10)  # the run reads 40 samples
    assert _lines(summary_log) == [
        # train = 90% of each prefix's documents: 18 x 10 + 36 x 5 tokens; 180 // 8 = 22 samples each per epoch
        "data train: 2 indexed dataset(s), 54 documents, 360 tokens, 44 samples of 8 tokens per epoch, "
        "0.89 epochs for the run's 40 samples; blend:",
        f"  {a}: weight 0.3 -> 30.00% of samples, 18 documents, 180 tokens, 22 samples per epoch, "
        "0.53 epochs for its 12 samples",
        f"  {b}: weight 0.7 -> 70.00% of samples, 36 documents, 180 tokens, 22 samples per epoch, "
        "1.24 epochs for its 28 samples",
    ]
    summary_log.clear()
    build_dataloader(replace(cfg, paths=[a]), None, **kw, split="valid")  # no run length: no epochs
    assert _lines(summary_log) == [f"data validation (valid): 1 indexed dataset(s), 2 documents, 20 tokens, "
                                   f"2 samples of 8 tokens per epoch ({a})"]


def test_summary_of_streaming_mock_and_stdlib_tokens(tmp_path, summary_log):
    from titanlike.data.dataset import TokenWindowDataset
    from titanlike.data.summary import describe

    (tmp_path / "s.jsonl").write_text('{"text": "1 2 3"}\n' * 100)
    _loader([tmp_path / "s.jsonl"], steps=5)  # local 2 x 1 rank
    build_dataloader(Data(dataset="mock"), None, dp_rank=0, dp_degree=2, local_batch_size=2, seq_len=SEQ, seed=0,
                     vocab_size=100, steps=5)
    assert _lines(summary_log) == [
        "data train: streaming text, 1 file(s) (jsonl), 0.0 MB; documents, tokens and samples are not known ahead "
        "(tokenised while training); the run's samples: 10 (80 tokens)",
        "data train: mock, random tokens below 100, no files, no epochs; the run's samples: 20",
    ]
    np.save(tmp_path / "tokens.npy", np.arange(1000, dtype=np.uint16))
    ds = TokenWindowDataset(tmp_path / "tokens.npy", SEQ, 0, 801)
    assert describe(ds, split="train", seq_len=SEQ, samples=200) == [
        "data train: stdlib corpus, 801 tokens, 100 samples of 8 tokens per epoch, 2.00 epochs for the run's 200 "
        "samples (documents not counted: one cached token stream)"]
