"""Preference pairs (titanlike/data/preference.py), the reference table's keys, the LoRA hook and the [dpo] config
rules."""
import json

import pytest
import torch

from models.batch import IGNORE_INDEX
from titanlike.config.errors import ConfigError
from titanlike.config import validate
from titanlike.config.load import config_from_dict
from titanlike.data import build_dataloader
from titanlike.data.preference import PreferenceDataset
from titanlike.data.tokenizers.null import NullTokenizer
from models.common.lora import LoraLinear, adapters_disabled, has_lora
from titanlike.train.dpo_reference import ReferenceTable, row_keys

X = IGNORE_INDEX
TOK = NullTokenizer(100)  # text = token ids; EOS = 100


def _write(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def test_sample_is_the_pair_with_labels_on_the_response_only(tmp_path):
    f = _write(tmp_path / "p.jsonl", [{"prompt": "5 6 7", "chosen": "8 9", "rejected": "10"}])
    ds = PreferenceDataset([f], TOK, seq_len=8)
    ids, labels = ds[0]
    assert ids.shape == labels.shape == (2, 8)
    # chosen: 5 6 7 | 8 9 EOS, then EOS padding; labels = the next token where it is a response token
    assert ids[0].tolist() == [5, 6, 7, 8, 9, 100, 100, 100]
    assert labels[0].tolist() == [X, X, 8, 9, 100, X, X, X]
    assert ids[1].tolist() == [5, 6, 7, 10, 100, 100, 100, 100]
    assert labels[1].tolist() == [X, X, 10, 100, X, X, X, X]
    ds_bos = PreferenceDataset([f], TOK, seq_len=8, add_bos=True)  # BOS joins the prompt: no target on it either
    assert ds_bos[0][0][0].tolist()[:4] == [100, 5, 6, 7] and ds_bos[0][1][0].tolist()[:4] == [X, X, X, 8]


def test_truncation_and_dropped_pairs_are_counted(tmp_path, caplog):
    f = _write(tmp_path / "p.jsonl", [
        {"prompt": "1 2", "chosen": "3 4 5 6 7 8", "rejected": "9"},  # chosen cut to the window
        {"prompt": "1 2 3 4 5 6", "chosen": "7", "rejected": "8"},  # the prompt fills the window: dropped
        "",  # blank lines are skipped
        {"prompt": "1", "chosen": "2", "rejected": "3"}])
    with caplog.at_level("INFO", logger="titanlike"):
        ds = PreferenceDataset([f], TOK, seq_len=5)
    assert len(ds) == 2 and ds.truncated == 1 and ds.dropped == 1
    ids, labels = ds[0]
    assert ids[0].tolist() == [1, 2, 3, 4, 5] and labels[0].tolist() == [X, 3, 4, 5, 6]  # keep_start: end cut
    assert "1 of 4 sequences cut" in caplog.text and "1 pair(s) dropped" in caplog.text
    assert f"{f}:2" in caplog.text


@pytest.mark.parametrize("rows,expect", [
    ([{"prompt": "1", "chosen": "2 3", "rejected": "4"}, {"prompt": "1", "chosen": "5", "rejected": "5"}],
     ":2): they carry no preference; remove them from the data"),
    (["{not json"], ":1: not a JSON object"),
    ([{"prompt": "1", "chosen": "2"}], "needs the fields \"prompt\", \"chosen\" and \"rejected\" (found ['chosen', "
                                       "'prompt'])"),
    ([{"prompt": "1", "chosen": 2, "rejected": "3"}], "must be strings or lists"),
])
def test_bad_rows_fail_at_build_with_one_line(tmp_path, rows, expect):
    f = _write(tmp_path / "p.jsonl", rows)
    with pytest.raises(ValueError) as e:
        PreferenceDataset([f], TOK, seq_len=8)
    msg = str(e.value)
    assert expect in msg and "\n" not in msg and msg.startswith("data.paths: "), msg


def test_loader_stacks_pairs_and_keeps_the_data_identity(tmp_path):
    f = _write(tmp_path / "p.jsonl", [{"prompt": f"{i}", "chosen": f"{i + 1} {i + 2}", "rejected": f"{i + 3}"}
                                      for i in range(10)])
    cfg = config_from_dict({"data": {"dataset": "preference", "paths": [f]}})
    loader = build_dataloader(cfg.data, TOK, dp_rank=0, dp_degree=1, local_batch_size=4, seq_len=6, seed=0)
    ids, labels = next(iter(loader))
    assert ids.shape == labels.shape == (4, 2, 6)
    state = loader.state_dict()
    assert state["built_with"]["sources"] == [[f, loader.dataset.file_digests[0]]]
    assert loader.batch_sampler.fingerprint == loader.dataset.fingerprint != ""
    _write(tmp_path / "p.jsonl", [{"prompt": "1", "chosen": "2", "rejected": "3"}] * 10)  # other pairs: refused
    other = build_dataloader(cfg.data, TOK, dp_rank=0, dp_degree=1, local_batch_size=4, seq_len=6, seed=0)
    with pytest.raises(ConfigError, match="other data settings"):
        other.load_state_dict(state)


def _pairs(n=10, seed=0):
    import random

    rng = random.Random(seed)
    words = lambda lo, hi, k: " ".join(str(rng.randrange(lo, hi)) for _ in range(k))  # noqa: E731
    return [{"prompt": words(1, 50, rng.randrange(1, 6)), "chosen": words(50, 75, rng.randrange(1, 7)),
             "rejected": words(75, 99, rng.randrange(1, 7))} for _ in range(n)]


def test_packed_rows_hold_whole_pairs_with_the_padded_targets(tmp_path, caplog):
    """Every pair lands whole in one row, chosen then rejected; each sequence's tokens and targets are those of the
    padded layout, its last position and the padding have none; the rows are fuller than padding."""
    from titanlike.train.dpo_packed import segment_index

    f = _write(tmp_path / "p.jsonl", _pairs(10))
    pad = PreferenceDataset([f], TOK, seq_len=31)
    with caplog.at_level("INFO", logger="titanlike"):
        pack = PreferenceDataset([f], TOK, seq_len=31, layout="pack")
    assert pack.num_pairs == pad.num_pairs == 10 and pack.truncated == 0 and 3 <= len(pack) < 10
    assert f"10 pairs in {len(pack)} rows of 32 (pack: " in caplog.text
    seen = []
    for i in range(len(pack)):
        ids, labels = pack[i]
        assert ids.shape == labels.shape == (31,)
        seg = segment_index(labels[None])[0]
        runs = int(seg.max()) + 1
        assert runs % 2 == 0 and runs > 0
        pos = 0
        for k in range(runs):
            first = int((seg == k).nonzero().min())
            pair, side = pack.packed.row_pairs[pack.packed.row_starts[i] + k // 2], k % 2
            want_ids, want_labels = pad[pair][0][side], pad[pair][1][side]
            n = int((want_ids != TOK.eos_id).sum()) + 1  # the prompt, the response and its EOS
            assert ids[pos:pos + n].tolist()[:31 - pos] == want_ids[:n].tolist()[:31 - pos]
            assert labels[pos:pos + n].tolist()[:31 - pos] == want_labels[:n].tolist()[:31 - pos]
            assert first - pos == int((want_labels != X).nonzero().min())  # the targets start where padded ones do
            seen.append((int(pair), side))
            pos += n  # (each ends with EOS, the end-of-document token: no separator)
        assert (ids[pos:] == TOK.eod_id).all() and (labels[pos:] == X).all()  # EOD padding, no targets
    assert sorted(seen) == [(p, s) for p in range(10) for s in (0, 1)]
    assert pack.fingerprint != pad.fingerprint and pack.sources() == pad.sources()


def test_packed_pairs_are_cut_to_fit_a_row_or_dropped(tmp_path, caplog):
    """A pair longer than a row keeps its starts, both sides capped so it fits (the longer response loses its end);
    a pair whose prompt leaves no response token for both sides is dropped; both counted."""
    from titanlike.data.preference_pack import fit_pair

    assert fit_pair([5, 4], [True, True], 2, 12) == ([5, 4], 9)
    assert fit_pair([9, 4], [True, True], 2, 12) == ([7, 4], 12)  # chosen cut to 7, its separator, then 4
    assert fit_pair([9, 9], [True, True], 2, 12) == ([5, 5], 12)  # both cut: 5 + 1 + 5 (+ 1 off the row's end)
    assert fit_pair([9, 9], [True, True], 6, 12) is None  # 7 + 1 + 7 > 12: no room for a response on both sides
    assert fit_pair([3, 3], [False, False], 1, 8) == ([3, 3], 8)  # separators after both (the last may fall off)
    f = _write(tmp_path / "p.jsonl", [
        {"prompt": "1 2", "chosen": "3 4 5 6 7 8", "rejected": "9"},  # 9 + 4 tokens: cut to fit 12
        {"prompt": "1 2 3 4 5 6", "chosen": "7", "rejected": "8"},  # 8 + 8: dropped
        {"prompt": "1", "chosen": "2", "rejected": "3"}])
    with caplog.at_level("INFO", logger="titanlike"):
        ds = PreferenceDataset([f], TOK, seq_len=11, layout="pack")
    assert ds.num_pairs == 2 and ds.truncated == 1 and ds.dropped == 1
    assert "1 of 4 sequences cut so that each pair fits a row of 12 tokens" in caplog.text
    assert "1 pair(s) dropped, their prompts leave no room for both responses" in caplog.text
    ids, labels = ds[0]  # (the cut pair, placed first: the longest)
    assert ids.tolist() == [1, 2, 3, 4, 5, 6, 7, 100, 1, 2, 9]  # chosen cut to 7 tokens, its separator, rejected
    assert labels.tolist() == [X, 3, 4, 5, 6, 7, X, X, X, 9, 100]  # (the rejected's EOS: the row's last label)


def test_packed_layout_refuses_an_end_of_document_token_inside_a_sequence(tmp_path):
    f = _write(tmp_path / "p.jsonl", [{"prompt": "5 6", "chosen": "7", "rejected": "8"}])
    with pytest.raises(ValueError) as e:  # NullTokenizer's BOS is its EOS = EOD: add_bos puts one at every start
        PreferenceDataset([f], TOK, seq_len=16, add_bos=True, layout="pack")
    msg = str(e.value)
    assert "\n" not in msg and "2 sequences of data.paths hold it before their end" in msg
    assert msg.endswith("set data.eod_token to a token the pairs do not use, or use data.preference_layout='pad'")


def test_resume_with_another_layout_is_refused(tmp_path):
    f = _write(tmp_path / "p.jsonl", _pairs(10))
    cfg = lambda layout: config_from_dict({"data": {"dataset": "preference", "paths": [f],  # noqa: E731
                                                    "preference_layout": layout}})
    build = lambda layout: build_dataloader(cfg(layout).data, TOK, dp_rank=0, dp_degree=1,  # noqa: E731
                                            local_batch_size=2, seq_len=31, seed=0)
    packed = build("pack")
    ids, labels = next(iter(packed))
    assert ids.shape == labels.shape == (2, 31)  # rows, not pairs
    with pytest.raises(ConfigError, match="data.preference_layout 'pack' -> 'pad'"):
        build("pad").load_state_dict(packed.state_dict())


def test_row_keys_and_table_lookup():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 50, (64, 12), generator=g)
    labels = ids.roll(-1, 1).masked_fill(torch.rand(64, 12, generator=g) < 0.3, X)
    keys = row_keys(ids, labels)
    assert keys.unique().numel() == 64
    swapped = ids.clone()
    swapped[:, [0, 1]] = swapped[:, [1, 0]]  # the same tokens in another order: another key
    assert (row_keys(swapped, labels) != keys).sum() >= 60
    masked = labels.clone()
    masked[:, 0] = X  # the same tokens, another response mask: another key
    changed = labels[:, 0] != X
    assert (row_keys(ids, masked) != keys)[changed].all()
    values = torch.randn(64)
    table = ReferenceTable(keys, values)
    perm = torch.randperm(64, generator=g)
    torch.testing.assert_close(table.lookup(ids[perm], labels[perm]), values[perm], rtol=0, atol=0)
    assert table.lookup(ids[:1] + 1, labels[:1]).isnan().all()  # never seen: NaN, not another row's value
    again = ReferenceTable.from_state(table.state_dict(), torch.device("cpu"))
    torch.testing.assert_close(again.lookup(ids, labels), values, rtol=0, atol=0)


def test_adapters_disabled_gives_the_base_model():
    def adapted():
        layer = LoraLinear(4, 4, rank=2, alpha=4.0)
        torch.nn.init.normal_(layer.lora_B.weight)  # nonzero adapters (B starts at zero)
        return layer

    torch.manual_seed(0)
    model = torch.nn.Sequential(adapted(), torch.nn.ReLU(), adapted())
    x = torch.randn(3, 4)
    plain = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 4))
    plain.load_state_dict({k: v for k, v in model.state_dict().items() if "lora" not in k})
    assert has_lora(model) and not has_lora(plain)
    with_adapters = model(x)
    with adapters_disabled(model):
        torch.testing.assert_close(model(x), plain(x))
    torch.testing.assert_close(model(x), with_adapters)  # restored on exit
    assert not torch.allclose(with_adapters, plain(x))


def _rules(**sections):
    base = {"data": {"dataset": "preference", "paths": ["p.jsonl"]}}
    for name, values in sections.items():
        base.setdefault(name, {}).update(values)
    with pytest.raises(ConfigError) as e:
        validate(config_from_dict(base))
    return str(e.value)


@pytest.mark.parametrize("sections,expect", [
    ({"parallelism": {"pp": 2, "pp_microbatches": 3}, "training": {"local_batch_size": 4}},
     "parallelism.pp_microbatches=3 must divide training.local_batch_size=4"),  # (a micro-batch would cut a pair)
    ({"training": {"loss_chunk_tokens": 1024}}, "set training.loss_chunk_tokens=0"),
    ({"data": {"document_masking": True}}, "turn data.document_masking off, or pack pairs with "
                                           "data.preference_layout=\"pack\""),
    ({"data": {"preference_layout": "pack", "document_masking": True}}, "set data.reset_position_ids=true"),
    ({"data": {"preference_layout": "packed"}}, "data.preference_layout='packed' is not one of pad, pack"),
    ({"data": {"preference_layout": "pack", "document_masking": True, "reset_position_ids": True,
               "eod_mask_loss": True}}, "turn data.eod_mask_loss off"),
    ({"validation": {"enable": True}}, "needs validation.paths"),
    ({"dpo": {"loss_type": "simpo"}}, "dpo.loss_type='simpo' is not one of sigmoid, ipo, length_normalized"),
    ({"dpo": {"reference": "none"}}, "dpo.reference='none' is not one of precompute, frozen_copy"),
    ({"dpo": {"beta": 0.0}}, "dpo.beta=0.0 must be a finite number > 0"),
    ({"dpo": {"label_smoothing": 0.5}}, "dpo.label_smoothing=0.5 must be in [0, 0.5)"),
    ({"dpo": {"loss_type": "ipo", "label_smoothing": 0.1}}, "set it to 0 with dpo.loss_type=\"ipo\""),
    ({"data": {"paths": []}}, "data.paths is empty but the dataset is 'preference'"),
    ({"eval": {"enable": True, "perplexity_sets": ["mock"]}}, "empty eval.perplexity_sets (eval.tasks work)"),
    ({"fault_tolerance": {"enable": True, "group_size": 1}}, "does not run with fault_tolerance.enable yet"),
])
def test_config_rules_name_the_key(sections, expect):
    msg = _rules(**sections)
    assert expect in msg, msg


def test_refusal_is_one_line():
    msg = _rules(training={"loss_chunk_tokens": 1024})
    assert "\n" not in msg and msg.startswith("data.dataset=\"preference\" (DPO) needs the logits")


@pytest.mark.parametrize("layout", ["pad", "pack"])
@pytest.mark.parametrize("parallelism", [{"pp": 2, "pp_microbatches": 2}, {"cp": 2}, {"pp": 2, "cp": 2}])
def test_pipeline_and_context_parallel_are_accepted(parallelism, layout):
    packed = {"preference_layout": "pack", "document_masking": True, "reset_position_ids": True}
    validate(config_from_dict({"data": {"dataset": "preference", "paths": ["p.jsonl"],
                                        **(packed if layout == "pack" else {})},
                               "training": {"local_batch_size": 4}, "parallelism": parallelism}))


def test_batch_split_keeps_extras_and_row_targets():
    """Batch.split (the pipeline's micro-batches) cuts extras and row targets with the rows; target_count sums them."""
    from models.batch import Batch

    b = Batch(inputs={"tokens": torch.arange(24).view(6, 4)}, labels=torch.zeros(6, 4, dtype=torch.long),
              extras={"reference_logps": torch.arange(6.0)}, row_targets=torch.tensor([1, 0, 1, 0, 1, 0]))
    parts = b.split(3)
    assert [p.extras["reference_logps"].tolist() for p in parts] == [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0]]
    assert [int(p.target_count()) for p in parts] == [1, 1, 1] and int(b.target_count()) == 3
    plain = Batch(inputs={"tokens": torch.zeros(2, 3)}, labels=torch.tensor([[1, X, 2], [X, X, 3]]))
    assert int(plain.target_count()) == 3 and plain.split(2)[0].extras == {}


def test_pairs_count_once_over_context_parallel_ranks():
    """Every CP rank of a data rank holds chunks of the same pairs: only the first counts them (row_targets), so the
    global pair count the loss is divided by is right; the reference log-probs are every rank's."""
    from models.batch import NextToken, StepContext
    from titanlike.train.dpo import PairObjective

    ids, labels = torch.arange(24).view(3, 2, 4), torch.ones(3, 2, 4, dtype=torch.long)
    ref = lambda i, y, b: torch.arange(float(i.shape[0]))  # noqa: E731
    first = PairObjective(NextToken(), ref)(ids, labels, StepContext(1, 0))
    other = PairObjective(NextToken(), ref, counting=False)(ids, labels, StepContext(1, 0))
    assert first.row_targets.tolist() == [1, 0, 1, 0, 1, 0] and int(first.target_count()) == 3
    assert int(other.target_count()) == 0 and other.extras["reference_logps"].tolist() == list(range(6))
