"""Packed documents through the trainer, single process: configs/debug_model.toml on short JSONL documents (several per
128-token row) with data.document_masking and data.reset_position_ids. The first step's loss equals the documents
scored one by one, training runs, and compiled blocks take the mask without recompiling from step to step."""
from __future__ import annotations

import json
import math
import random

import pytest
import torch

from models.batch import Batch
from titanlike.config.load import load_config
from titanlike.train.trainer import Trainer

WORDS = ("def class return import self the of and to in is for with value data name None True list dict "
         "open read write file path error raise yield lambda print len range").split()


def _corpus(tmp_path) -> str:
    """400 documents of 3-30 words: a 128-token window packs several, cut at arbitrary places."""
    rng = random.Random(0)
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 30)))})
                            + "\n" for _ in range(400)))
    return str(path)


def _trainer(tmp_path, *flags: str) -> Trainer:
    return Trainer(load_config([
        "--config", "configs/debug_model.toml", f"--job.dump_folder={tmp_path}", "--training.device=cpu",
        "--training.steps=3", "--lr_scheduler.warmup_steps=1", "--metrics.log_freq=1",
        "--metrics.enable_tensorboard=false", "--data.dataset=text", f"--data.paths={_corpus(tmp_path)}", *flags]))


def _documents_of(row: torch.Tensor, eod: int) -> list[tuple[int, int]]:
    """(start, end) of each document of a row, written out: a document ends with its EOD."""
    spans, start = [], 0
    for i, t in enumerate(row.tolist()):
        if t == eod:
            spans.append((start, i + 1))
            start = i + 1
    return spans + ([(start, len(row))] if start < len(row) else [])


def _train(trainer: Trainer, on_step) -> list[dict]:
    """trainer.train(), calling on_step(step, batches) as each step's batches are read."""
    read = trainer.next_batches

    def next_batches(data_iter):
        batches = read(data_iter)
        on_step(trainer.step, batches)
        return batches

    trainer.next_batches = next_batches
    try:
        return trainer.train()
    finally:
        trainer.close()


def test_document_masking_trains_and_equals_documents_alone(tmp_path):
    trainer = _trainer(tmp_path, "--data.document_masking=true", "--data.reset_position_ids=true",
                       "--compile.enable=false")
    eod = trainer.tokenizer.eod_id
    first = {}

    def on_step(step, batches):
        batch, = batches
        inputs, labels, kwargs = batch.inputs["tokens"], batch.labels, batch.kwargs()
        spans = [_documents_of(row, eod) for row in inputs]
        assert all(len(s) >= 3 for s in spans), [len(s) for s in spans]  # the masking has work to do on every row
        assert torch.equal(kwargs["positions"][0, :spans[0][1][1]],
                           torch.cat([torch.arange(b - a) for a, b in spans[0][:2]]))
        if step == 1:  # the weights the first step's loss is taken with: score each document on its own
            with torch.no_grad():
                first["alone"] = sum(trainer.forward_loss(Batch({"tokens": inputs[r:r + 1, a:b]},
                                                                 labels[r:r + 1, a:b]))
                                     for r, row_spans in enumerate(spans) for a, b in row_spans).item()
                first["unmasked"] = trainer.forward_loss(Batch({"tokens": inputs}, labels)).item()
                first["tokens"] = labels.numel()

    history = _train(trainer, on_step)
    losses = [h["loss"] for h in history]
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses), losses
    assert losses[0] == pytest.approx(first["alone"] / first["tokens"], abs=1e-5)
    # the mask made a difference (10x the tolerance above)
    assert abs(losses[0] - first["unmasked"] / first["tokens"]) > 1e-4
    assert losses[-1] < losses[0], losses


@pytest.mark.slow
def test_compiled_blocks_take_the_mask_without_recompiling(tmp_path):
    """compile.enable: the blocks (fullgraph) trace the AttnMask; steps 2 and 3 reuse step 1's graphs (any
    recompile raises) and the losses follow the eager run's."""
    from torch._dynamo.utils import counters

    flags = ("--data.document_masking=true", "--data.reset_position_ids=true")
    eager = [h["loss"] for h in _train(_trainer(tmp_path / "eager", *flags, "--compile.enable=false"),
                                       lambda step, batches: None)]
    torch._dynamo.reset()  # other tests' guards on the shared block code would count as recompiles here
    graphs = {}

    def on_step(step, batches):
        if step == 2:  # step 1 compiled forward and backward; from here on a recompile is an error
            graphs["after_step_1"] = counters["stats"]["unique_graphs"]
            torch._dynamo.config.error_on_recompile = True

    try:
        compiled = [h["loss"] for h in _train(_trainer(tmp_path / "compiled", *flags, "--compile.enable=true",
                                                       "--compile.backend=aot_eager"),
                                              on_step)]
    finally:
        torch._dynamo.config.error_on_recompile = False
        torch._dynamo.reset()
    assert graphs["after_step_1"] >= 1 and counters["stats"]["unique_graphs"] == graphs["after_step_1"]
    assert compiled == pytest.approx(eager, abs=1e-3), (compiled, eager)


def test_document_masking_on_data_without_eod_tokens_says_so(tmp_path, own_log, caplog):
    """Text packed without EOD tokens (data.add_eod=false): every row is one document, the mask a no-op; the first
    log step says which keys changed nothing and the fix, once."""
    trainer = _trainer(tmp_path, "--data.document_masking=true", "--data.add_eod=false", "--compile.enable=false",
                       "--training.steps=2")
    with caplog.at_level("WARNING", logger="titanlike"):
        _train(trainer, lambda step, batches: None)
    said = [line for line in own_log().splitlines() if "end-of-document" in line]
    assert len(said) == 1, own_log()
    assert said[0].startswith(f"data.document_masking found no end-of-document token (id {trainer.tokenizer.eod_id}) "
                              f"inside the first ") and "--append-eod" in said[0] and "data.add_eod" in said[0], said
