"""Chat data as a dataset (titanlike/data/sft.py, sft_read.py), single process: a packed row through the llama3 debug
model with document masking equals each conversation alone (fp32, <= 1e-5); truncation is counted; bad records are
skipped and counted, files without conversations or assistant turns refused in one line; prompt/response records and
saved HF datasets read alike; splits and seeds; a resumed loader reads what an uninterrupted one does; the export
carries the template; DPO pairs as chat messages. (Rendering against transformers: tests/unit/test_sft_data.py.)"""
from __future__ import annotations

import dataclasses
import json
import logging
import pickle
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

import models
from models.batch import IGNORE_INDEX, Batch
from titanlike.config.errors import ConfigError
from titanlike.config.sections import Data
from titanlike.data import build_dataloader
from titanlike.data.chat import ChatTemplateError, load_chat_template, render_with_masks
from titanlike.data.sft import build_chat_dataset
from titanlike.data.tokenizers import build_tokenizer
from titanlike.train.batch import BatchLayout

from chat_fixtures import (  # tests/unit/chat_fixtures.py
    CORPUS, CONVERSATIONS, make_folder, ours, write_file, folder_maker, train_tokenizer_json)

transformers = pytest.importorskip("transformers")
torch.set_num_threads(2)


@pytest.fixture(scope="module")
def tokenizer_json(tmp_path_factory) -> str:
    return train_tokenizer_json(tmp_path_factory)


@pytest.fixture
def folder(tmp_path, tokenizer_json):
    return folder_maker(tmp_path, tokenizer_json)


# ------------------------------------------------------------------------------------------ the dataset

def _jsonl(path, records) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return str(path)


def _dataset(folder_path, paths, tmp_path, which="train", seq_len=256, seed=0, **data):
    cfg = Data(dataset="chat", tokenizer=str(folder_path), paths=list(paths), cache_dir=str(tmp_path / "cache"),
               **data)
    tok = build_tokenizer(cfg)
    return build_chat_dataset(cfg, tok, seq_len=seq_len, split=which, seed=seed, vocab_size=tok.vocab_size), tok, cfg


def _many(n: int) -> list[dict]:
    out = []
    for i in range(n):
        words = " ".join(CORPUS[(i + j) % len(CORPUS)] for j in range(i % 3 + 1))
        out.append({"messages": [{"role": "user", "content": f"q{i} {words[:20 + 7 * (i % 5)]}"},
                                 {"role": "assistant", "content": words[: 10 + 9 * (i % 7)]}]} if i % 2 else
                   {"prompt": f"q{i}: {words[:15]}", "response": words[: 5 + 11 * (i % 6)]})
    return out


def test_packed_row_equals_each_conversation_alone(folder, tmp_path):
    """A packed row through the llama3 debug model (document_masking + reset_position_ids, as the trainer's
    BatchLayout builds them) gives each conversation's logits and per-token losses as that conversation alone: fp32,
    max difference <= 1e-5. The labels are exactly each conversation's assistant tokens (render_with_masks)."""
    path = folder("qwen")
    records = _many(24)
    # Qwen's EOS is <|im_end|>, which ends every turn: documents are separated by another token (see
    # test_an_end_of_document_token_inside_conversations_is_refused)
    ds, tok, cfg = _dataset(path, [_jsonl(tmp_path / "c.jsonl", records)], tmp_path, seq_len=256,
                            document_masking=True, reset_position_ids=True, eod_token="<|end_of_text|>")
    assert ds.num_truncated == 0 and len(ds) < len(records)  # several conversations per row
    i = max(range(len(ds)), key=lambda r: len(ds.rows(r)))
    inputs, labels = ds[i]
    row = torch.from_numpy(ds.row(i)[0])  # the S + 1 tokens: inputs are the first S
    assert len(ds.rows(i)) >= 3
    spec = models.get_spec("llama3")
    args = dataclasses.replace(spec.flavors["debugmodel"], vocab_size=tok.vocab_size, n_layers=2, max_seq_len=256)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = spec.model_cls(args)
    model.to_empty(device="cpu")
    model.init_weights()
    layout = BatchLayout(SimpleNamespace(get_mesh=lambda name: None), cfg, tok.eod_id)
    batch = layout(Batch({"tokens": inputs[None]}, labels[None]))
    with torch.no_grad():
        packed = model(batch.inputs["tokens"], **batch.kwargs()).float()[0]
        pos, supervised = 0, 0
        for k in ds.rows(i):
            conv = int(ds.ids[k])
            rec = records[conv]
            msgs = rec.get("messages") or [{"role": "user", "content": rec["prompt"]},
                                           {"role": "assistant", "content": rec["response"]}]
            ids, mask = render_with_masks(load_chat_template(cfg, tok), msgs, tok)
            n = len(ids)
            m = min(n, len(inputs) - pos)  # the row's last conversation may end at its very last token (no input)
            assert row[pos:pos + n].tolist() == ids and (pos + n == len(row) or int(row[pos + n]) == tok.eod_id)
            alone_labels = torch.tensor([t if s else IGNORE_INDEX for t, s in zip(ids[1:], mask[1:])] + [IGNORE_INDEX])
            assert torch.equal(labels[pos:pos + m], alone_labels[:m])  # the last target is the separator: ignored
            alone = model(torch.tensor([ids])).float()[0, :m]
            assert (packed[pos:pos + m] - alone).abs().max().item() <= 1e-5
            loss_packed = F.cross_entropy(packed[pos:pos + m], labels[pos:pos + m], reduction="none")
            loss_alone = F.cross_entropy(alone, alone_labels[:m], reduction="none")
            assert (loss_packed - loss_alone).abs().max().item() <= 1e-5
            pos, supervised = pos + n + 1, supervised + int((alone_labels[:m] != IGNORE_INDEX).sum())
        assert (labels[pos:] == IGNORE_INDEX).all() and int((labels != IGNORE_INDEX).sum()) == supervised > 0


def test_truncation_is_counted_and_logged(folder, tmp_path, caplog):
    path = folder("qwen")
    records = _many(40)
    tok, template = ours(path)
    lengths = []
    for r in records:
        msgs = r.get("messages") or [{"role": "user", "content": r["prompt"]}, {"role": "assistant",
                                                                                 "content": r["response"]}]
        lengths.append(len(render_with_masks(template, msgs, tok)[0]))
    seq_len = sorted(lengths)[len(lengths) // 2]  # about half are longer than a row of seq_len + 1
    longer = sum(n > seq_len + 1 for n in lengths)
    files = [_jsonl(tmp_path / "c.jsonl", records)]
    with caplog.at_level(logging.INFO, logger="titanlike"):
        kept, _, _ = _dataset(path, files, tmp_path, seq_len=seq_len, split="100,0,0")
    assert kept.num_truncated == longer > 0 and kept.ids.size == len(records) - kept.num_unlearnable
    assert f"{longer} of {len(records)} conversations are longer than a row" in caplog.text
    assert all(len(ds_row) <= seq_len + 1 for ds_row in (kept.row(i)[0] for i in range(len(kept))))
    dropped, _, _ = _dataset(path, files, tmp_path, seq_len=seq_len, split="100,0,0", sft_truncation="drop")
    assert dropped.num_truncated == longer and dropped.ids.size == len(records) - longer
    assert "left out (data.sft_truncation='drop')" in caplog.text


def test_bad_records_are_skipped_counted_and_named(folder, tmp_path, caplog):
    good = _many(6)
    bad = ["not json", {"text": "no conversation"}, {"messages": "hi"}, {"messages": [{"content": "no role"}]},
           {"messages": [{"role": "user", "content": "no reply"}]}, [1, 2]]
    records = good[:3] + bad + good[3:]
    with caplog.at_level(logging.WARNING, logger="titanlike"):
        ds, _, _ = _dataset(folder("qwen"), [_jsonl(tmp_path / "c.jsonl", records)], tmp_path, split="100,0,0")
    assert ds.chat.stats["skipped"] == len(bad) and len(ds.chat) == len(good)
    assert f"skipped {len(bad)} of {len(records)} records" in caplog.text
    for lineno, why in ((4, "invalid JSON"), (5, "no key 'messages' and no 'prompt'/'response' pair"),
                        (6, "'messages' holds str"), (7, "'messages'[0] is not an object with a string 'role'"),
                        (8, "no assistant turn"), (9, "not a JSON object")):
        assert f"c.jsonl:{lineno}: {why}" in caplog.text
    # the template refuses a conversation (Mistral's alternation rule): that record only
    mistral = [{"messages": [{"role": "assistant", "content": "first"}]}, *good]
    ds, _, _ = _dataset(folder("mistral"), [_jsonl(tmp_path / "m.jsonl", mistral)], tmp_path, split="100,0,0")
    assert ds.chat.stats["skipped"] == 1 and "Conversation roles must alternate" in ds.chat.stats["skipped_first"][0]


def test_files_without_conversations_or_replies_fail_in_one_line(folder, tmp_path):
    path = folder("qwen")
    cases = (([{"text": "a"}, {"text": "b"}], "no record holds a conversation .* set data.messages_key"),
             ([{"messages": [{"role": "user", "content": "a"}, {"role": "gpt", "content": "b"}]}],
              r"no conversation has an assistant turn \(roles found: \['gpt', 'user'\]\)"))
    for i, (records, says) in enumerate(cases):
        with pytest.raises(ConfigError, match=says) as e:
            _dataset(path, [_jsonl(tmp_path / f"{i}.jsonl", records)], tmp_path)
        assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="is not a conversation file"):
        _dataset(path, [str(write_file(tmp_path / "x.txt", "text"))], tmp_path)
    with pytest.raises(ChatTemplateError, match="data.chat_template is empty"):
        _dataset(make_folder(tmp_path / "bare", (path / "tokenizer.json").read_text(), None, None, "</s>"),
                 [_jsonl(tmp_path / "ok.jsonl", _many(4))], tmp_path)


def test_prompt_response_keys_and_saved_hf_datasets_read_alike(folder, tmp_path):
    datasets = pytest.importorskip("datasets")
    path = folder("llama3")
    pairs = [{"question": f"q{i} {CORPUS[i % 5]}", "answer": CORPUS[(i + 1) % 5]} for i in range(12)]
    as_messages = [{"messages": [{"role": "user", "content": p["question"]},
                                 {"role": "assistant", "content": p["answer"]}]} for p in pairs]
    ref, _, _ = _dataset(path, [_jsonl(tmp_path / "m.jsonl", as_messages)], tmp_path, split="100,0,0")
    keyed, _, _ = _dataset(path, [_jsonl(tmp_path / "p.jsonl", pairs)], tmp_path, split="100,0,0",
                           prompt_key="question", response_key="answer")
    datasets.Dataset.from_list(as_messages).save_to_disk(str(tmp_path / "hf"))
    datasets.DatasetDict({"train": datasets.Dataset.from_list(pairs)}).save_to_disk(str(tmp_path / "hfdict"))
    saved, _, _ = _dataset(path, [str(tmp_path / "hf")], tmp_path, split="100,0,0")
    saved_dict, _, _ = _dataset(path, [str(tmp_path / "hfdict")], tmp_path, split="100,0,0",
                                prompt_key="question", response_key="answer")
    for other in (keyed, saved, saved_dict):
        assert len(other) == len(ref)
        for i in range(len(ref)):
            assert all(torch.equal(a, b) for a, b in zip(ref[i], other[i]))


def test_splits_are_disjoint_and_the_order_is_seeded(folder, tmp_path):
    path = folder("qwen")
    files = [_jsonl(tmp_path / "c.jsonl", _many(40))]
    train, _, _ = _dataset(path, files, tmp_path, split="80,20,0")
    valid, _, _ = _dataset(path, files, tmp_path, "valid", split="80,20,0")
    assert set(train.ids.tolist()) | set(valid.ids.tolist()) == set(range(40))
    assert set(valid.ids.tolist()) == set(range(32, 40))  # the last 20% in file order
    again, _, _ = _dataset(path, files, tmp_path, split="80,20,0")
    other, _, _ = _dataset(path, files, tmp_path, split="80,20,0", seed=1, sft_layout="pad")
    padded, _, _ = _dataset(path, files, tmp_path, split="80,20,0", sft_layout="pad")
    rows = [[ds.rows(i) for i in range(len(ds))] for ds in (train, again, other, padded)]
    assert rows[1] == rows[0] and again.fingerprint == train.fingerprint
    assert len(padded) == 32 and rows[2] != rows[3] and sorted(rows[2]) == sorted(rows[3])
    copy = pickle.loads(blob := pickle.dumps(train))  # what DataLoader workers receive: no token arrays inside
    assert len(blob) < 20_000 and all(torch.equal(a, b) for i in range(len(train)) for a, b in zip(copy[i], train[i]))
    inputs, labels = padded[0]
    n = int(padded.lengths[padded.rows(0)[0]])  # one conversation, then EOD padding with ignored labels
    assert (inputs[n:] == padded.eod_id).all() and (labels[n - 1:] == IGNORE_INDEX).all()
    with pytest.raises(ConfigError, match="the test split of data.split='80,20,0' has no conversations"):
        _dataset(path, files, tmp_path, "test", split="80,20,0")


def test_an_end_of_document_token_inside_conversations_is_refused(folder, tmp_path):
    """Mistral's template ends every reply with </s>, its EOS and so the default separator: document masking would cut
    a multi-turn conversation at each reply. One reply (</s> last) is fine and needs no separator after it."""
    path = folder("mistral")
    single = [{"prompt": p["prompt"], "response": p.get("response", "")} for p in _many(8)[::2]]
    ds, tok, _ = _dataset(path, [_jsonl(tmp_path / "one.jsonl", single)], tmp_path, split="100,0,0", seq_len=256,
                          document_masking=True)
    inputs, _ = ds[0]
    first = int(ds.lengths[ds.rows(0)[0]])
    assert int(inputs[first - 1]) == tok.eod_id and int(inputs[first]) == tok.bos_id  # </s> then the next <s>
    multi = [{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                           {"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}]}] * 4
    with pytest.raises(ConfigError, match="set data.eod_token to a token the template does not write"):
        _dataset(path, [_jsonl(tmp_path / "multi.jsonl", multi)], tmp_path, split="100,0,0", document_masking=True)
    _dataset(path, [_jsonl(tmp_path / "multi.jsonl", multi)], tmp_path, split="100,0,0",
             document_masking=True, eod_token="<|end_of_text|>")


def test_resumed_loader_reads_what_an_uninterrupted_one_does(folder, tmp_path):
    path = folder("qwen")
    cfg = Data(dataset="chat", tokenizer=str(path), paths=[_jsonl(tmp_path / "c.jsonl", _many(60))],
               cache_dir=str(tmp_path / "cache"), split="100,0,0")
    tok = build_tokenizer(cfg)

    def loader(rank=0, dp=1, batch=4):
        return build_dataloader(cfg, tok, dp_rank=rank, dp_degree=dp, local_batch_size=batch, seq_len=96, seed=3,
                                global_batch_size=4)

    whole = iter(loader())
    reference = [next(whole) for _ in range(12)]  # past an epoch (the rows reshuffle per epoch)
    first = loader()
    it = iter(first)
    for _ in range(5):
        next(it)
    state = first.state_dict()
    resumed = loader()
    resumed.load_state_dict(state)
    it = iter(resumed)
    for ref in reference[5:]:
        got = next(it)
        assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
    halves = [loader(r, 2, 2) for r in range(2)]  # the same position under two data-parallel ranks
    for h in halves:
        h.load_state_dict(state)
    its = [iter(h) for h in halves]
    for ref in reference[5:8]:
        parts = [next(i) for i in its]
        assert torch.equal(torch.cat([p[0] for p in parts]), ref[0])
    worker = build_dataloader(dataclasses.replace(cfg, num_workers=1), tok, dp_rank=0, dp_degree=1,
                              local_batch_size=4, seq_len=96, seed=3, global_batch_size=4)
    for ref, got in zip(reference[:3], worker):  # a DataLoader worker process reads the same rows
        assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
    other = dataclasses.replace(cfg, sft_layout="pad")
    moved = build_dataloader(other, tok, dp_rank=0, dp_degree=1, local_batch_size=4, seq_len=96, seed=3,
                             global_batch_size=4)
    with pytest.raises(ConfigError, match="data.sft_layout 'pack' -> 'pad'"):
        moved.load_state_dict(state)


def test_config_keys_are_checked(tmp_path):
    from titanlike.config.load import load_config
    from titanlike.config.validate import advise

    with pytest.raises(ConfigError) as e:
        load_config(["--data.dataset=chat", "--data.sft_layout=packed", "--data.sft_truncation=cut",
                     "--data.response_key=prompt"])
    for says in ("data.paths is empty but the dataset is 'chat'", "data.sft_layout='packed' is not one of pack, pad",
                 "data.sft_truncation='cut' is not one of truncate, drop",
                 "data.prompt_key and data.response_key are both 'prompt'"):
        assert says in str(e.value)
    cfg = load_config(["--data.dataset=chat", "--data.paths=x.jsonl"])
    assert any("without data.document_masking" in n for n in advise(cfg))
    cfg = load_config(["--data.dataset=chat", "--data.paths=x.jsonl", "--data.document_masking=true"])
    assert not any("document_masking" in n for n in advise(cfg))


def test_export_writes_the_run_template_and_its_stop_token(folder, tmp_path):
    """The HF export of a chat run (titanlike/checkpoint/hf_tokenizer.py): the template the run used goes to
    chat_template.jinja (replacing the folder's own), transformers applies it as the run did, and its one-token end of
    turn joins the stop ids."""
    from titanlike.checkpoint.hf_tokenizer import token_ids, write_tokenizer

    data = Data(dataset="chat", tokenizer=str(folder("chatml_gen")), chat_template="chatml")
    tok = build_tokenizer(data)
    out = tmp_path / "out"
    out.mkdir()
    write_tokenizer(tok, data, str(out))
    assert (out / "chat_template.jinja").read_text() == load_chat_template(data, tok).text
    assert "chat_template" not in json.loads((out / "tokenizer_config.json").read_text())
    hf = transformers.AutoTokenizer.from_pretrained(str(out))
    for convo in CONVERSATIONS:
        assert hf.apply_chat_template(convo, return_dict=True)["input_ids"] == \
            render_with_masks(load_chat_template(data, tok), convo, tok)[0]
    assert token_ids((tok, data), str(tmp_path))["stop"] == [tok.eos_id, tok.token_to_id("<|im_end|>")]
    plain = Data(tokenizer=data.tokenizer)  # a pretraining run: its ids as before, the folder's files as they are
    assert token_ids((tok, plain), str(tmp_path))["stop"] == tok.eos_id


def test_chat_message_preference_pairs_render_through_the_template(folder, tmp_path):
    """DPO pairs given as chat messages (titanlike/data/preference.py): each side is the template's rendering of
    prompt + reply, cut after the reply's last assistant token; labels only on the reply (its end-of-turn included)."""
    from titanlike.data.preference import build_preference_dataset

    path = folder("qwen")
    prompt = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "two plus two"}]
    rows = [{"prompt": prompt, "chosen": "four", "rejected": [{"role": "assistant", "content": "five"}]},
            {"prompt": "hello", "chosen": "hi", "rejected": "go away"}]
    cfg = Data(dataset="preference", tokenizer=str(path), paths=[_jsonl(tmp_path / "pairs.jsonl", rows)])
    tok = build_tokenizer(cfg)
    template = load_chat_template(cfg, tok)
    ds = build_preference_dataset(cfg, tok, seq_len=64, split="train")
    ids, labels = ds[0]  # the chat-message pair
    for side, reply in enumerate(("four", "five")):
        full, mask = render_with_masks(template, prompt + [{"role": "assistant", "content": reply}], tok)
        end = max(j for j, m in enumerate(mask) if m) + 1
        n = end - 1  # the window's real inputs: all tokens but the last (it is only a label)
        assert ids[side, :n].tolist() == full[:n]
        supervised = [full[j + 1] for j in range(n) if labels[side, j] != -100]
        assert supervised == [t for t, m in zip(full[:end], mask) if m]  # exactly the reply's tokens
    ids, _ = ds[1]  # plain strings stay plain text (no template), as TRL treats non-conversational pairs
    plain = tok.encode("hello") + tok.encode("hi", eos=True)
    assert ids[0, :len(plain) - 1].tolist() == plain[:-1]
    bad = [{"prompt": prompt, "chosen": [{"role": "user", "content": "x"}], "rejected": "y"}]
    cfg_bad = Data(dataset="preference", tokenizer=str(path), paths=[_jsonl(tmp_path / "bad.jsonl", bad)])
    with pytest.raises(ValueError, match="does not render the prompt") as e:
        build_preference_dataset(cfg_bad, tok, seq_len=64, split="train")
    assert "\n" not in str(e.value)
