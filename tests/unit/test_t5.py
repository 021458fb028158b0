"""T5 family specifics (models/t5): logits against transformers' T5ForConditionalGeneration (v1.1 and the original,
padded encoder and decoder rows), the published sizes, the span-corruption objective (sizes, sentinels, the row
rebuilt from encoder input and targets, determinism by the batch hash) and the refusals (one line each). The
registry-wide contract (counts, FLOPs against torch's counter, plans on fake ranks, the HF export path) is
tests/unit/test_model_contract.py."""
from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

import pytest
import torch

import models
from models.batch import IGNORE_INDEX, StepContext, build_objective

torch.set_num_threads(1)
SPEC = models.get_spec("t5")
V, S = 160, 40
transformers = pytest.importorskip("transformers")


def _pair(flavor: str, tmp_path):
    """Our model with random weights larger than the init, and transformers' loaded from its export (from_pretrained:
    transformers 5 ties lm_head to `shared` when it builds a T5 itself, and unties it when a checkpoint has both)."""
    from safetensors.torch import save_file

    args = dataclasses.replace(SPEC.flavors[flavor], vocab_size=V, max_seq_len=S)
    with torch.device("meta"):
        ours = SPEC.model_cls(args)
    ours.to_empty(device="cpu")
    ours.init_weights()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _, p in ours.named_parameters():
            p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g) if p.ndim == 1 else 0.1 * torch.randn(p.shape,
                                                                                                      generator=g))
    save_file({k: v.contiguous() for k, v in SPEC.hf.to_hf(ours.state_dict(), args).items()},
              str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "config.json").write_text(json.dumps(SPEC.hf.hf_config(args, torch.float32)))
    theirs = transformers.T5ForConditionalGeneration.from_pretrained(str(tmp_path), dtype=torch.float32,
                                                                     attn_implementation="eager").eval()
    return args, ours.eval(), theirs


@pytest.mark.parametrize("flavor", ["debugmodel", "debugmodel_original"])
def test_logits_match_transformers_with_padding(flavor, tmp_path):
    """Encoder rows right-padded (attention_mask), decoder rows padded too (decoder_attention_mask), decoder longer
    than the relative-position exact range: our logits are transformers' within 1e-4 (fp32) on every real position;
    the tied original's lm_head is `shared`, v1.1's its own; from_hf of transformers' state dict is ours."""
    args, ours, theirs = _pair(flavor, tmp_path)
    assert (theirs.lm_head.weight is theirs.shared.weight) == args.tie_embeddings
    g = torch.Generator().manual_seed(1)
    tokens, dec = torch.randint(2, V, (3, S), generator=g), torch.randint(2, V, (3, 23), generator=g)
    mask, dmask = torch.ones(3, S, dtype=torch.long), torch.ones(3, 23, dtype=torch.long)
    mask[1, 30:] = 0
    mask[2, 7:] = 0
    dmask[2, 15:] = 0
    with torch.no_grad():
        got = ours(tokens, decoder_tokens=dec, attention_mask=mask, decoder_attention_mask=dmask)
        want = theirs(input_ids=tokens, attention_mask=mask, decoder_input_ids=dec,
                      decoder_attention_mask=dmask).logits
    real = dmask.bool()
    err = (got - want)[real].abs().max().item()
    assert want[real].abs().max() > 0.25 and err <= 1e-4, err  # (the original scales by dim ** -0.5)
    own = SPEC.hf.from_hf(theirs.state_dict(), args)
    sd = ours.state_dict()
    assert own.keys() == sd.keys() and all(torch.equal(own[k], sd[k]) for k in sd)


def _published(name: str) -> int:
    """transformers' parameter count of the matching config, built on meta (its own T5 ties lm_head to `shared` when
    built directly, so an untied head adds a table)."""
    args = SPEC.flavors[name]
    config = SPEC.hf.hf_config(args, torch.float32)
    cfg = transformers.T5Config(**{k: v for k, v in config.items() if k not in ("architectures", "model_type")})
    with torch.device("meta"):
        model = transformers.T5ForConditionalGeneration(cfg)
    return sum(p.numel() for p in model.parameters()) + (0 if args.tie_embeddings else args.vocab_size * args.dim)


@pytest.mark.parametrize("name", [n for n, a in SPEC.flavors.items() if not n.startswith("debug") and a.is_hf_t5])
def test_published_sizes_match_transformers(name):
    assert SPEC.param_counts(SPEC.flavors[name]).total == _published(name)


def test_published_sizes_are_the_known_ones():
    """The sizes the T5 and T5 v1.1 releases are known by (rounded as their names are)."""
    total = {n: SPEC.param_counts(a).total for n, a in SPEC.flavors.items()}
    assert total["t5-small"] == 60_506_624 and round(total["t5-base"] / 1e6) == 223
    assert round(total["t5-large"] / 1e6) == 738 and round(total["t5-3b"] / 1e9, 1) == 2.9
    assert round(total["t5-11b"] / 1e9, 1) == 11.3 and round(total["t5-v1_1-11b"] / 1e9, 1) == 11.1


def _objective(seq: int = 128, **changes):
    args = dataclasses.replace(SPEC.flavors["debugmodel"], vocab_size=2148, max_seq_len=seq, **changes)
    return args, build_objective(SPEC.objective, args)


def _rebuild(enc: torch.Tensor, target: torch.Tensor, top: int, pad: int) -> list[int]:
    """The original row from the encoder input (kept tokens, sentinel i per span) and the targets (sentinel i, span)."""
    spans, cur = {}, None
    for t in target.tolist():
        if t == IGNORE_INDEX:
            break
        if t > top - 100:
            cur = t
            spans[cur] = []
        else:
            spans[cur].append(t)
    row = []
    for t in enc.tolist():
        row.extend(spans[t] if t in spans else [t])
    return row


def test_span_corruption_sizes_sentinels_and_the_row_rebuilt():
    """128 tokens: 19 noise tokens in 6 spans (T5's rounding), sentinels 2147, 2146, ... in order; the encoder input
    is the 115 kept tokens + 6 sentinels then padding (attention_mask 0 there); the decoder reads its targets shifted
    right after the start token, padded to 32 without targets; encoder input and targets give the row back."""
    args, obj = _objective()
    rows = torch.randint(0, 2048, (4, 128), generator=torch.Generator().manual_seed(0))
    b = obj(rows, rows, StepContext(step=7, seed=3))
    enc, mask, dec, y = b.inputs["tokens"], b.inputs["attention_mask"], b.inputs["decoder_tokens"], b.labels
    assert enc.shape == mask.shape == (4, 128) and dec.shape == y.shape == (4, 32)
    assert (mask.sum(1) == 128 - 19 + 6).all() and (enc[mask == 0] == 0).all()
    assert (y[:, 25:] == IGNORE_INDEX).all() and (y[:, :25] != IGNORE_INDEX).all()
    assert torch.equal(dec[:, 1:25], y[:, :24]) and (dec[:, 0] == 0).all()
    for r in range(4):
        sentinels = [t for t in y[r].tolist() if t >= 2048]
        assert sentinels == list(range(2147, 2141, -1)), sentinels
        assert [t for t in enc[r].tolist() if t >= 2048] == sentinels
        assert _rebuild(enc[r][mask[r] == 1], y[r], 2147, 0) == rows[r].tolist()
    assert b.primary == "tokens" and b.target_count() == 4 * 25


def test_span_corruption_is_a_function_of_the_rows_and_the_step():
    """The same rows at the same step: the same spans, whatever their order in the batch (a layout or a resume sees
    them so); another step or seed: other spans."""
    _, obj = _objective()
    rows = torch.randint(0, 2048, (4, 128), generator=torch.Generator().manual_seed(1))
    a = obj(rows, rows, StepContext(step=5, seed=0))
    perm = torch.tensor([2, 0, 3, 1])
    b = obj(rows[perm], rows[perm], StepContext(step=5, seed=0))
    for k in a.inputs:
        assert torch.equal(a.inputs[k][perm], b.inputs[k]), k
    assert torch.equal(a.labels[perm], b.labels)
    for ctx in (StepContext(step=6, seed=0), StepContext(step=5, seed=1)):
        assert not torch.equal(obj(rows, rows, ctx).inputs["tokens"], a.inputs["tokens"])


def test_refusals_are_one_line_naming_the_key():
    par = SimpleNamespace(tp=3, cp=1, pp=1, ep=1, enable_sequence_parallel=True)
    args = SPEC.flavors["debugmodel"]
    problems = SPEC.check(args, par, "debugmodel")
    assert problems and "n_heads=4" in problems[0] and "parallelism.tp=3" in problems[0]
    assert "model.args.decoder_multiple" in SPEC.check(dataclasses.replace(args, decoder_multiple=6),
                                                       SimpleNamespace(tp=4, cp=1, pp=1, ep=1), "debugmodel")[0]
    for key, par in (("parallelism.pp=2", SimpleNamespace(tp=1, cp=1, pp=2, ep=1)),
                     ("parallelism.cp=2", SimpleNamespace(tp=1, cp=2, pp=1, ep=1))):
        assert any(key in p for p in SPEC.check(args, par, "debugmodel"))
    # a vocabulary with no spare rows for the sentinels: the builtin tokenizer's 2048 tokens and no <extra_id_0>
    from titanlike.config.sections import Data
    from titanlike.data.tokenizers import build_tokenizer

    tokenizer = build_tokenizer(Data(tokenizer="builtin"))
    _, obj = _objective()
    assert obj.tokenizer_problem(tokenizer) is None  # 2148 rows: 100 spare
    small = build_objective(SPEC.objective, dataclasses.replace(args, vocab_size=2048, max_seq_len=128))
    msg = small.tokenizer_problem(tokenizer)
    assert "model.args.sentinel_top" in msg and "2148" in msg and "\n" not in msg
    with pytest.raises(ValueError, match="model.args.sentinel_top") as e:
        build_objective(SPEC.objective, dataclasses.replace(args, vocab_size=50, max_seq_len=128))
    assert "\n" not in str(e.value)
    # the decoder longer than the positions allow: at start-up (the objective) and in the forward
    with pytest.raises(ValueError, match="model.args.max_decoder_len") as e:
        build_objective(SPEC.objective, dataclasses.replace(args, max_seq_len=128, max_decoder_len=16))
    assert "\n" not in str(e.value)
    small_args = dataclasses.replace(args, vocab_size=V, max_seq_len=S, max_decoder_len=8)
    with torch.device("meta"):
        model = SPEC.model_cls(small_args)
    with pytest.raises(ValueError, match="model.args.max_decoder_len"):
        model(torch.zeros(1, 8, dtype=torch.long, device="meta"),
              decoder_tokens=torch.zeros(1, 9, dtype=torch.long, device="meta"))


@pytest.mark.parametrize("flavor", ["debugmodel", "debugmodel_original"])
def test_greedy_generation_equals_transformers_generate(flavor, tmp_path):
    """Encoder once, decoder one token per step through its self-attention cache and the cross-attention cache of the
    encoder output: the tokens are transformers' greedy generate's, token for token (fp32), padded rows included;
    and the cached steps' logits are the full forward's."""
    from models.t5.generate import greedy

    args, ours, theirs = _pair(flavor, tmp_path)
    g = torch.Generator().manual_seed(2)
    tokens = torch.randint(2, V, (3, 17), generator=g)
    mask = torch.ones(3, 17, dtype=torch.long)
    mask[1, 11:] = 0
    got = greedy(ours, tokens, mask, max_new_tokens=20)
    want = theirs.generate(input_ids=tokens, attention_mask=mask, max_new_tokens=20, do_sample=False, num_beams=1,
                           min_new_tokens=0)
    assert got.shape[1] > 10 and torch.equal(got, want), (got, want)
    with torch.no_grad():  # the uncached forward over the generated prefix picks the same tokens
        full = ours(tokens, decoder_tokens=got[:, :-1], attention_mask=mask).argmax(-1)
    live = torch.cat([torch.ones(3, 1, dtype=torch.bool), got[:, 1:-1] != 1], dim=1).cumprod(1).bool()
    assert torch.equal(full[live], got[:, 1:][live])
