"""float8 for the encoder families (BERT, T5; ViT's filter too): which Linears convert (the output heads and the
tied decoder stay in high precision), the tie survives, and a Trainer run on CPU tracks the same run without
float8 and saves a state dict that loads into a plain model (strict). TP + float8 for these families: their plans
use torch's plain styles, as every decoder plan does (float8.tp_styles is not picked by any plan; see
test_encoder_plans_use_plain_tp_styles).

CPU float8 GEMMs are slow (~0.5 s per step of these tiny models): few steps, one block per stack for T5.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

import float8
from tests.unit.test_float8 import LOSS_TOL, f8cfg, float8_fqns
from titanlike.config.load import config_from_dict

torch.set_num_threads(1)


def meta(name: str, flavor: str = "debugmodel", **changes):
    import models

    spec = models.get_spec(name)
    with torch.device("meta"):
        return spec, spec.model_cls(dataclasses.replace(spec.flavors[flavor], **changes))


def test_bert_keeps_decoder_pooler_and_binary_head():
    spec, model = meta("bert", binary_head=True)
    conv = float8.convert(model, f8cfg(), model_keep=spec.float8_keep)
    assert sorted(conv.skipped) == ["binary", "output", "pooler"]
    assert "mlm_dense" in conv.converted and len(conv.converted) == 2 * 6 + 1  # wq wk wv wo w1 w2 per block
    assert model.output.weight is model.tok_embeddings.weight  # still tied
    # float8.keep_model_heads=false converts the pooler (the 2-way classifier stays: 2 is not a multiple of 16);
    # a converted tied decoder keeps the tie (Float8Linear reuses the Parameter) ...
    spec, model = meta("bert", binary_head=True)
    conv = float8.convert(model, f8cfg(filter_fqns=[], keep_model_heads=False), model_keep=spec.float8_keep)
    assert {"pooler", "output"} <= set(conv.converted) and list(conv.skipped) == ["binary"]
    assert model.output.weight is model.tok_embeddings.weight
    # ... except under the FSDP float8 all-gather, whose weight wrapper would be a second Parameter: kept there.
    spec, model = meta("bert")
    conv = float8.convert(model, f8cfg(filter_fqns=[], enable_fsdp_float8_all_gather=True), fsdp_enabled=True,
                          model_keep=spec.float8_keep)
    assert "output" in conv.skipped and "tied" in conv.skipped["output"]
    assert model.output.weight is model.tok_embeddings.weight


@pytest.mark.parametrize("flavor", ["debugmodel", "debugmodel_original"])
def test_t5_keeps_lm_head(flavor):
    spec, model = meta("t5", flavor)
    conv = float8.convert(model, f8cfg(), model_keep=spec.float8_keep)
    assert list(conv.skipped) == ["output"] and conv.converted == float8_fqns(model)
    per_ffn = 3 if model.args.gated else 2
    assert len(conv.converted) == 2 * (4 + per_ffn) + 2 * (8 + per_ffn)  # encoder blocks, decoder blocks
    assert model.tied == (model.output.weight is model.tok_embeddings.weight)


def test_vit_keeps_classifier():
    spec, model = meta("vit", n_classes=32)  # (a 16-aligned class count: the dims rule alone would convert it)
    conv = float8.convert(model, f8cfg(), model_keep=spec.float8_keep)
    assert list(conv.skipped) == ["head"] and len(conv.converted) == 2 * 6


def test_encoder_plans_use_plain_tp_styles():
    """No plan picks float8.tp_styles (decoders included): under TP a Float8Linear gets torch's Colwise/Rowwise
    styles, whose DTensor weight torchao's Float8Linear handles. BERT and T5 follow the decoder plans."""
    from parallelize.bert import bert_tp_plan
    from parallelize.gpt import gpt_tp_plan
    from parallelize.t5 import t5_tp_plan

    def kinds(plan):
        return {type(style).__name__ for key, style in plan.items() if key.split(".")[-1] in ("wq", "wo", "w1", "w2")}

    assert kinds(bert_tp_plan()) == kinds(t5_tp_plan()) == kinds(gpt_tp_plan()) == {"ColwiseParallel",
                                                                                     "RowwiseParallel"}


FAMILIES = {  # tiny runs on stdlib text: the masked token and the sentinels are spare rows past the tokenizer's 2048
    "bert": {"name": "bert", "flavor": "debugmodel", "vocab_size": 2064, "args": {"mask_token_id": -1}},
    "t5": {"name": "t5", "flavor": "debugmodel", "vocab_size": 2160,
           "args": {"sentinel_top": -1, "n_layers": 1, "n_decoder_layers": 1}},
}
# Loss tolerance against the same run without float8, 3 AdamW steps (lr 5e-4) on stdlib text. LOSS_TOL (2e-3, the
# decoder reference model's) is too tight here: measured max |diff| bert 3.6e-3 (2.6e-3 at lr 1e-3), t5 2.6e-2 -
# the T5 one already at step 0, i.e. the forward's e4m3 rounding of the freshly initialised model, not drift.
TOL = {"bert": 2.5 * LOSS_TOL, "t5": 25 * LOSS_TOL}
STEPS, LR = 3, 5e-4


@pytest.mark.parametrize("name", ["bert", "t5"])
def test_trainer_float8_tracks_plain_and_resumes_without_float8(name, tmp_path):
    """Trainer wiring: float8 keeps only the LM head / tied decoder ("output") in high precision, tracks the plain
    run (TOL) and falls, and its state dict loads into the plain model (strict)."""
    from titanlike.train.trainer import Trainer

    def run(tag, **float8_kw):
        cfg = config_from_dict({
            "job": {"dump_folder": str(tmp_path / tag)}, "model": FAMILIES[name],
            "training": {"steps": STEPS, "seq_len": 32, "local_batch_size": 2, "device": "cpu"},
            "optimizer": {"lr": LR}, "data": {"dataset": "stdlib"}, "lr_scheduler": {"warmup_steps": 1},
            "metrics": {"log_freq": 1, "enable_tensorboard": False}, "float8": float8_kw})
        return Trainer(cfg)

    t8 = run("f8", enable=True, recipe="tensorwise")
    try:
        assert list(t8.float8.skipped) == ["output"] and float8_fqns(t8.model) == t8.float8.converted
        got = [h["loss"] for h in t8.train()]
        sd8 = t8.model.state_dict()
    finally:
        t8.close()
    plain = run("plain")
    try:
        assert float8_fqns(plain.model) == []
        ref = [h["loss"] for h in plain.train()]
        plain.model.load_state_dict(sd8, strict=True)
    finally:
        plain.close()
    assert max(abs(a - b) for a, b in zip(ref, got)) <= TOL[name], (ref, got)
    assert got[-1] < got[0] and ref[-1] < ref[0], got
