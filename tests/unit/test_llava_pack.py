"""Packed llava rows (data.wds_layout = "pack", titanlike/data/webdataset_pack.py): a row of several WebDataset
samples, each with its images in the row's slots, gives each sample the logits, loss and gradients it has alone
(document masking and per-document positions through the trainer's BatchLayout); the loader resumes exactly; the
trainer trains on packed rows (and notes packing without document masking)."""
from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

import models
from models.batch import IGNORE_INDEX, StepContext, build_objective
from titanlike.config.errors import ConfigError
from titanlike.config.sections import Data
from titanlike.data.image_text import PIXELS
from titanlike.data.loader import build_dataloader
from titanlike.train.batch import BatchLayout

pytest.importorskip("PIL")
from titanlike.data.dataset import build_dataset  # noqa: E402
from titanlike.data.webdataset_write import write_shapes_shards  # noqa: E402

torch.set_num_threads(1)
SPEC = models.get_spec("llava")
SLOTS, VOCAB = 3, 64
SEQ = SLOTS * PIXELS + 96  # three slots; a conversation is 16 placeholders + 14 words


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return write_shapes_shards(tmp_path_factory.mktemp("wds_pack"), 12, 6)


def cfg(paths, **kw):
    base = dict(dataset="webdataset", paths=[str(p) for p in paths], image_size=32, image_tokens=16,
                images_per_row=SLOTS, wds_target="json", document_masking=True, reset_position_ids=True)
    return dataclasses.replace(Data(), **{**base, **kw})


def tiny_model():
    args = dataclasses.replace(SPEC.flavors["debugmodel"], vocab_size=VOCAB, max_seq_len=128, images_per_row=SLOTS)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = SPEC.model_cls(args)
    model.to_empty(device="cpu")
    model.init_weights()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # larger than the init, so a position or mask mistake shows in the logits
        for p in model.parameters():
            p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g) if p.ndim == 1 else 0.08 * torch.randn(p.shape,
                                                                                                      generator=g))
    return args, model


def step(model, objective, layout, ids, labels):
    """(logits, summed cross-entropy, target count, gradients) of one batch through objective -> BatchLayout."""
    model.zero_grad()
    b = layout(objective(ids, labels, StepContext(0, 0)), ids)
    out = model(*b.args(), **b.kwargs())
    loss = F.cross_entropy(out.flatten(0, 1), b.labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")
    loss.backward()
    return out.detach(), loss.detach(), int((b.labels != IGNORE_INDEX).sum()), \
        {n: p.grad.clone() for n, p in model.named_parameters()}


def test_packed_row_equals_each_sample_alone(shards):
    packed = build_dataset(cfg(shards, wds_layout="pack"), None, seq_len=SEQ, vocab_size=VOCAB, seed=5)
    alone = build_dataset(cfg(shards), None, seq_len=SEQ, vocab_size=VOCAB)
    assert len(packed) == 4 and sorted(i for r in range(4) for i in packed.row_samples(r)) == list(range(12))
    r = 1
    members = packed.row_samples(r)
    ids, labels = packed[r]
    assert len(members) == SLOTS and labels[:SLOTS].tolist() == [30, 30, 30]
    for k, i in enumerate(members):  # slot k holds the k-th sample's image
        assert torch.equal(ids[k * PIXELS:(k + 1) * PIXELS], alone[i][0][:PIXELS])

    args, model = tiny_model()
    objective = build_objective(SPEC.objective, args)
    layout = BatchLayout(SimpleNamespace(get_mesh=lambda _: None), cfg(shards), eod_id=VOCAB - 2)
    out, loss, count, grads = step(model, objective, layout, ids[None], labels[None])
    want_loss, want_count, want_grads, at = 0.0, 0, None, 0
    for i in members:
        a_ids, a_labels = alone[i]
        a_out, a_loss, a_count, a_grads = step(model, objective, layout, a_ids[None], a_labels[None])
        n = int(labels[members.index(i)])
        assert (out[0, at:at + n] - a_out[0, :n]).abs().max() < 2e-5  # the logits it has alone
        want_loss, want_count = want_loss + a_loss, want_count + a_count
        want_grads = a_grads if want_grads is None else {k: want_grads[k] + g for k, g in a_grads.items()}
        at += n
    assert count == want_count > 0 and abs(loss - want_loss) < 1e-4 * want_loss
    assert max((grads[k] - want_grads[k]).abs().max() for k in grads) < 1e-4
    # without document masking the second and third samples see the first: their logits move
    plain = BatchLayout(SimpleNamespace(get_mesh=lambda _: None), Data(), eod_id=VOCAB - 2)
    assert (step(model, objective, plain, ids[None], labels[None])[0][0, 30:90] - out[0, 30:90]).abs().max() > 1e-3


def test_packed_loader_resumes_exactly(shards):
    kw = dict(local_batch_size=2, seq_len=SEQ, seed=3, vocab_size=VOCAB, dp_rank=0, dp_degree=1)
    loader = build_dataloader(cfg(shards, wds_layout="pack"), None, **kw)
    it = iter(loader)
    next(it)
    state, want = loader.state_dict(), [next(it) for _ in range(3)]  # across the epoch boundary (4 rows)
    for workers in (0, 1):
        again = build_dataloader(cfg(shards, wds_layout="pack", num_workers=workers), None, **kw)
        again.load_state_dict(state)
        got = iter(again)
        assert all(torch.equal(g[0], w[0]) and torch.equal(g[1], w[1]) for g, w in ((next(got), w) for w in want))
    pad = build_dataloader(cfg(shards), None, **kw)
    with pytest.raises(ConfigError, match=r"data.wds_layout 'pack' -> 'pad'"):
        pad.load_state_dict(state)


def test_trains_from_packed_rows(shards, tmp_path):
    from titanlike.config.load import load_config
    from titanlike.config.validate import advise
    from titanlike.train.trainer import Trainer

    folder = shards[0].rsplit("/", 1)[0]
    args = ["--config", "configs/llava_wds_debug.toml", "--training.device=cpu", f"--job.dump_folder={tmp_path}",
            f"--data.paths={folder}", "--data.wds_target=json", f"--data.images_per_row={SLOTS}",
            f"--model.args={{images_per_row = {SLOTS}}}", f"--training.seq_len={SEQ}", "--data.wds_layout=pack",
            "--training.steps=6", "--metrics.log_freq=1", "--training.local_batch_size=2", "--data.num_workers=0"]
    assert any("data.wds_layout='pack' without data.document_masking" in n for n in advise(load_config(args)))
    c = load_config(args + ["--data.document_masking=true", "--data.reset_position_ids=true"])
    assert not any("wds_layout" in n for n in advise(c))
    trainer = Trainer(c)
    try:
        history = trainer.train()
    finally:
        trainer.close()
    print(f"packed rows: loss {history[0]['loss']:.3f} -> {history[-1]['loss']:.3f}")
    assert history[-1]["loss"] < history[0]["loss"] - 1.0, (history[0]["loss"], history[-1]["loss"])
    with pytest.raises(ConfigError, match=r"data.wds_layout='pack' packs caption / conversation rows"):
        build_dataset(cfg(shards, wds_layout="pack", wds_target="cls", image_size=0), None, seq_len=PIXELS)
