"""BERT family specifics (models/bert): logits against transformers' own models built from their configs (the
binary head of BertForPreTraining and MegatronBertForPreTraining, padding masks, token types, RoBERTa's positions),
the published sizes, the refusals (one line each) and the masked-LM objective's 80/10/10 draw. The registry-wide
contract (counts, FLOPs, plans on fake ranks, the HF export path) is tests/unit/test_model_contract.py."""
from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

import models
from models.batch import IGNORE_INDEX, StepContext, build_objective

torch.set_num_threads(1)
SPEC = models.get_spec("bert")
V, S = 96, 20
transformers = pytest.importorskip("transformers")


def _theirs(cls_name: str, args):
    """A transformers model of `cls_name` from our hf_config, random weights (fp32, eager attention)."""
    config = SPEC.hf.hf_config(args, torch.float32)
    cfg = transformers.AutoConfig.for_model(config.pop("model_type"),
                                            **{k: v for k, v in config.items() if k != "torch_dtype"})
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = getattr(transformers, cls_name)(cfg).eval()
    with torch.no_grad():  # larger than the init, so a mapping error shows in the logits
        for name, p in model.named_parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


def _ours(args, hf_model):
    with torch.device("meta"):
        model = SPEC.model_cls(args)
    model.to_empty(device="cpu")
    model.init_weights()
    sd = SPEC.hf.from_hf(hf_model.state_dict(), args)
    missing, unexpected = model.load_state_dict(sd, strict=True, assign=False)
    assert model.output.weight is model.tok_embeddings.weight
    return model.eval()


def _inputs(pad_id: int, types: int):
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(2, V, (3, S), generator=g)
    mask = torch.ones(3, S, dtype=torch.long)
    mask[1, 13:] = 0  # right padding in one row
    mask[2, 5:] = 0
    tokens[mask == 0] = pad_id
    token_types = torch.randint(0, types, (3, S), generator=g)
    return tokens, mask, token_types


@pytest.mark.parametrize("flavor,cls_name", [("debugmodel", "BertForPreTraining"),
                                             ("debugmodel_preln", "MegatronBertForPreTraining"),
                                             ("debugmodel", "BertForMaskedLM"),
                                             ("debugmodel_roberta", "RobertaForMaskedLM")])
def test_logits_match_transformers_with_padding_and_token_types(flavor, cls_name):
    """Random transformers model -> from_hf -> our model: MLM logits (and the binary head's) within 1e-4 in fp32 on
    padded rows with token types; to_hf gives transformers' tensors back (its tied decoder aside)."""
    binary = cls_name.endswith("PreTraining")
    args = dataclasses.replace(SPEC.flavors[flavor], vocab_size=V, max_seq_len=S, binary_head=binary)
    theirs = _theirs(cls_name, args)
    assert sum(p.numel() for p in theirs.parameters()) == SPEC.param_counts(args).total
    ours = _ours(args, theirs)
    tokens, mask, types = _inputs(args.pad_token_id, args.type_vocab_size)
    with torch.no_grad():
        want = theirs(input_ids=tokens, attention_mask=mask, token_type_ids=types)
        got = ours(tokens, token_types=types, attention_mask=mask)
    mlm, seq = got if binary else (got, None)
    want_mlm = want.prediction_logits if binary else want.logits
    assert want_mlm.abs().max() > 1.0
    err = (mlm - want_mlm).abs().max().item()
    assert err <= 1e-4, err
    if binary:
        assert (seq - want.seq_relationship_logits).abs().max().item() <= 1e-4
        assert want.seq_relationship_logits.abs().max() > 0.1
    exported = SPEC.hf.to_hf(ours.state_dict(), args)
    for key, value in theirs.state_dict().items():
        if key in exported:
            assert torch.equal(exported[key], value), key
    dropped = set(theirs.state_dict()) - set(exported)
    assert all(k.endswith(("decoder.weight", "decoder.bias", "position_ids", "token_type_ids")) for k in dropped), \
        dropped


def test_config_round_trip_and_published_sizes():
    """args_from_hf_config(hf_config(args)) gives the args back (run knobs aside); the flavors' counts are the
    published models' (BertForMaskedLM base / large, RobertaForMaskedLM base / large, Megatron's 345M), with the
    binary head BertForPreTraining's."""
    for flavor, args in SPEC.flavors.items():
        again = SPEC.hf.args_from_hf_config(SPEC.hf.hf_config(args, torch.float32))
        arch = {f.name for f in dataclasses.fields(args)} - {"mask_token_id", "mask_rate", "mask_random",
                                                              "mask_keep", "hidden_dropout"}
        assert {k: getattr(again, k) for k in arch} == {k: getattr(args, k) for k in arch}, flavor
    total = {f: SPEC.param_counts(a).total for f, a in SPEC.flavors.items()}
    assert total["bert-base"] == 109_514_298 and total["roberta-base"] == 124_697_433
    assert total["bert-large"] == 335_174_458 and total["roberta-large"] == 355_412_057
    assert total["megatron-bert-345m"] == 335_246_208
    nsp = dataclasses.replace(SPEC.flavors["bert-base"], binary_head=True)
    assert SPEC.param_counts(nsp).total == 110_106_428  # BertForPreTraining, bert-base-uncased


def _par(**kw):
    return SimpleNamespace(**{"tp": 1, "pp": 1, "cp": 1, "ep": 1, **kw})


def test_refusals_are_one_line_naming_the_key():
    args = SPEC.flavors["bert-base"]
    (heads,) = SPEC.check(args, _par(tp=5), "bert-base")
    assert "n_heads=12" in heads and "parallelism.tp=5" in heads and "use tp in {1,2,3,4,6,12}" in heads
    assert SPEC.check(dataclasses.replace(args, binary_head=True), _par(), "bert-base") == []  # the data's call
    # the binary head under TP: planned (parallelize/bert.py gathers the pooler's input from the sequence shards)
    (binary,) = SPEC.check(dataclasses.replace(args, binary_head=True), _par(tp=2, enable_loss_parallel=True),
                           "bert-base")
    assert "model.args.binary_head" in binary and "parallelism.enable_loss_parallel=false" in binary
    assert SPEC.check(dataclasses.replace(args, binary_head=True), _par(tp=2, enable_loss_parallel=False),
                      "bert-base") == []
    assert SPEC.check(args, _par(pp=2), "bert-base") == []  # PP: the tied decoder's copy on the last stage
    for key in ("cp", "ep"):
        (line,) = SPEC.check(args, _par(**{key: 2}), "bert-base")
        assert f"parallelism.{key}=2" in line and f"set parallelism.{key}=1" in line
    assert SPEC.check(args, _par(tp=4), "bert-base") == []
    problems = SPEC.check(dataclasses.replace(args, binary_head=True), _par(tp=4, cp=2), "bert-base")
    assert all("\n" not in p for p in problems)


class _Tok:
    def __init__(self, vocab_size: int, special: dict):
        self.vocab_size, self.special = vocab_size, special

    def token_to_id(self, name):
        return self.special.get(name)


def test_mask_token_must_be_the_tokenizers_or_a_spare_row():
    """The objective's mask id against the run's tokenizer (the trainer asks at start-up): BERT's [MASK], RoBERTa's
    <mask> or a row past the tokenizer's vocabulary pass; a real token of a tokenizer without a mask token, or not
    its mask token, is refused in one line naming model.args.mask_token_id and the fix."""
    base = build_objective("masked_lm", dataclasses.replace(SPEC.flavors["bert-base"], vocab_size=30522))
    assert base.mask_id == 103 and base.tokenizer_problem(_Tok(30522, {"[MASK]": 103})) is None
    roberta = build_objective("masked_lm", SPEC.flavors["roberta-base"])
    assert roberta.tokenizer_problem(_Tok(50265, {"<mask>": 50264})) is None
    spare = build_objective("masked_lm", dataclasses.replace(SPEC.flavors["debugmodel"], vocab_size=2056))
    assert spare.mask_id == 2055 and spare.tokenizer_problem(_Tok(2048, {})) is None
    none = build_objective("masked_lm", dataclasses.replace(SPEC.flavors["debugmodel"], vocab_size=2048))
    line = none.tokenizer_problem(_Tok(2048, {}))
    assert "model.args.mask_token_id" in line and "no mask token" in line and "model.vocab_size above 2048" in line
    assert "\n" not in line
    wrong = base.tokenizer_problem(_Tok(30522, {"[MASK]": 4}))
    assert "mask token is 4" in wrong and "mask_token_id to 4" in wrong


def test_masked_lm_80_10_10_is_deterministic_and_layout_free():
    """BERT's draw: ~15% of the positions get targets; of those ~80% the mask id, ~10% a random token, ~10% their
    own token; the same rows give the same batch whatever their place in the batch (so any DP/TP layout and a
    resume see it), another step another one."""
    args = dataclasses.replace(SPEC.flavors["debugmodel"], vocab_size=1000)
    obj = build_objective("masked_lm", args)
    tokens = torch.randint(0, 999, (64, 256), generator=torch.Generator().manual_seed(0))
    b = obj(tokens, tokens, StepContext(step=7, seed=3))
    target = b.labels != IGNORE_INDEX
    assert torch.equal(b.labels[target], tokens[target])
    share = target.float().mean().item()
    x = b.inputs["tokens"][target]
    masked = (x == obj.mask_id).float().mean().item()
    kept = (x == tokens[target]).float().mean().item()
    assert 0.14 < share < 0.16 and 0.78 < masked < 0.82 and 0.09 < kept < 0.12, (share, masked, kept)
    assert torch.equal(b.inputs["tokens"][~target], tokens[~target])
    assert int(b.inputs["tokens"].max()) < args.vocab_size
    half = obj(tokens[32:], tokens[32:], StepContext(step=7, seed=3))  # another rank's rows, alone
    assert torch.equal(half.inputs["tokens"], b.inputs["tokens"][32:]) and torch.equal(half.labels, b.labels[32:])
    other = obj(tokens, tokens, StepContext(step=8, seed=3))
    assert not torch.equal(other.labels, b.labels)
