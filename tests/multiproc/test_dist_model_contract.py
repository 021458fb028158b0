"""The model contract holds for families the library has never heard of (tests/toy_family).

A toy decoder (learned positions, LayerNorm, GELU MLP, its own module names: not Llama) is defined entirely under
tests/toy_family as `toy_models` (its ModelSpec) and `toy_plans` (its PLANS); beside it a bidirectional encoder
trained by masked-LM (`toy_encoder`, the spec's objective "masked_lm") and an image classifier whose input is a
pixel tensor and whose patch projection is frozen (`toy_vision`, its own objective). toy_family_worker.py registers
them with `models.MODELS[name] = SPEC` (no library edit) and trains each with titanlike's Trainer:

- reference: 1 process, the decoder and the vision model from seed checkpoints (written by the Trainer itself), the
  encoder from seeded_init's layout-independent weights;
- fsdp: 2 processes (gloo), parallelism.dp_shard=-1, from the same weights; the vision run saves its last step and
  a new Trainer resumes from it.

Library families ride along in the same launches: nemotron_h's debugmodel (Mamba-2, attention and MLP layers), on
packed documents (doc_ids into the Mamba scan and the attention mask) with full activation checkpointing; and BERT's
debugmodel (masked-LM with 80/10/10, tied MLM decoder) under FSDP 2 and, in the 2-process launch, TP 2 + sequence
parallel ("bert_tp"), both held to the one-process run; T5's debugmodel (encoder-decoder, span corruption) the same
way ("t5", "t5_tp": TP 2 + SP over both stacks and the cross-attention); and BERT on Megatron's BERT data (token
types, padding mask, MLM + sentence order; "bert_sop", data preprocessed by the reference phase) under PP 2
("bert_pp", 1F1B) and TP 2 + sequence parallel ("bert_sop_tp": the pooler's first token gathered from the shards);
ViT's debugmodel on the synthetic shapes (images + class labels, its own objective) under FSDP 2 and TP 2 +
sequence parallel ("vit", "vit_tp"); LLaVA (ViT tower, projector, Llama; images spliced at placeholders) on
shapes_captions under FSDP 2 ("llava"). The 2-process runs carry the plans' other steps (the worker's LAYOUT): BERT
and ViT FSDP 2 with per-op selective AC and aot_eager compile, their TP runs with full AC; T5 and LLaVA FSDP 2 with
full AC and compile, T5's TP run with per-op AC; nemotron_h per-op AC (its reference: full). Checkpoints reshard
(the worker's RESHARD): step 5, saved by the Trainer under one layout, is resumed under another (BERT FSDP 2 -> TP 2,
T5 TP 2 -> FSDP 2, ViT 1 process -> TP 2, LLaVA 1 process -> FSDP 2 with per-op AC) for steps 6 and 7.

Checks: the loss is finite and falls over 10 steps; each 2-process run equals the 1-process run step by step (fp32 on
CPU: only the reduction order differs; observed relative differences ~1e-7 for the loss, ~3e-6 for the grad norm, so
LOSS_RTOL 1e-5 and GRAD_NORM_RTOL 1e-4 leave a wide margin yet catch any real divergence such as a missing or
double-counted shard, a wrong gradient scale or a different initialisation), and every parameter's gradient, gathered
whole, equals the reference's within GRAD_TOL 1e-5 elementwise at step 1 (and at step 6 for BERT, T5, ViT and LLaVA,
the resumed runs' first step; worst seen 2.1e-6, LLaVA's, whose largest gradient is 18); the trainer counted with
the spec's functions (its flops_per_token, the logged TFLOP/s per token/s, the parameter line of its log).
Single-process checks beside it keep the toy spec's own counts honest (meta-built numel, FlopCounterMode).
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from tests.launch import REPO_ROOT, run_torchrun

WORKER = Path(__file__).with_name("toy_family_worker.py")
TOY_DIR = REPO_ROOT / "tests" / "toy_family"
LOSS_RTOL = 1e-5
GRAD_NORM_RTOL = 1e-4
GRAD_TOL = 1e-5  # every gradient, elementwise (as the worker asserts; the worst seen goes to the JSON)
STEPS, SEQ = 10, 32  # as in the worker



def _toy(monkeypatch):
    monkeypatch.syspath_prepend(str(TOY_DIR))  # undone after the test, like the registry entry below
    import toy_models

    return toy_models


def _launch(root: str, phase: str, nproc: int) -> dict:
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), str(TOY_DIR), os.environ.get("PYTHONPATH")]))}
    run_torchrun(WORKER, nproc, args=[root, phase], timeout=180, env=env)
    with open(os.path.join(root, f"{phase}.json")) as f:
        return json.load(f)


def _same_run(ref_run: dict, run: dict, first: int = 1, last: int = STEPS) -> None:
    """A 2-process run == 1 process, step by step (same initial weights, same global batch of 4 rows): the loss and
    the grad norm of each of steps first..last, and every parameter's gradient at step `first` (the worker held each,
    gathered whole, to the reference's within GRAD_TOL: llava_cases.check_grads)."""
    ref_h = [h for h in ref_run["history"] if first <= h["step"] <= last]
    two_h = run["history"]
    assert [h["step"] for h in ref_h] == [h["step"] for h in two_h] == list(range(first, last + 1))
    assert all(math.isfinite(h["loss"]) for h in ref_h), ref_h
    for a, b in zip(ref_h, two_h):
        assert b["loss"] == pytest.approx(a["loss"], rel=LOSS_RTOL), (a["step"], a["loss"], b["loss"])
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=GRAD_NORM_RTOL), (a["step"], a, b)
        assert b["lr"] == a["lr"]
    assert first in run["grad_steps"] and run["grads_checked"] > 0, (first, run["grad_steps"])
    assert run["grad_diff"] <= GRAD_TOL, run["grad_diff"]


@pytest.mark.dist
def test_toy_family_trains_under_fsdp_like_one_process(tmp_path, monkeypatch):
    root = str(tmp_path)
    ref = _launch(root, "reference", 1)
    fsdp = _launch(root, "fsdp", 2)
    assert ref["world"] == 1 and fsdp["world"] == 2
    toy = _toy(monkeypatch)
    spec = toy.SPEC
    # (bert, vit: + per-op selective AC + aot_eager compile; t5, llava: + full AC + compile; nemotron_h: per-op AC)
    for family in ("toy", "toy_encoder", "toy_vision", "nemotron_h", "bert", "bert_sop", "t5", "vit", "llava"):
        _same_run(ref["runs"][family], fsdp["runs"][family])
    # BERT and T5 under TP 2 + sequence parallel (the same 2 processes, no FSDP) follow the one-process run too
    # (bert_tp: + full AC; t5_tp: + per-op selective AC).
    _same_run(ref["runs"]["bert"], fsdp["runs"]["bert_tp"])
    _same_run(ref["runs"]["t5"], fsdp["runs"]["t5_tp"])
    # ViT under TP 2 + SP (+ full AC): the class token sits on rank 0's token shard; the plan gathers it.
    _same_run(ref["runs"]["vit"], fsdp["runs"]["vit_tp"])
    # BERT on Megatron's data (token types and padding mask to both stages, MLM + sentence order, the tied decoder's
    # copy on the last stage) under PP 2 follows the one-process run too.
    _same_run(ref["runs"]["bert_sop"], fsdp["runs"]["bert_pp"])
    # ... and under TP 2 + SP with the binary head: the pooler reads token 0, on rank 0's sequence shard only, so
    # the plan gathers its input (a wrong token on rank 1 or a double-counted gradient would show here).
    _same_run(ref["runs"]["bert_sop"], fsdp["runs"]["bert_sop_tp"])
    # Checkpoints reshard: step 5 saved by the Trainer under one layout and loaded (full state) under another, the
    # next two steps as the uninterrupted one-process run's (BERT FSDP 2 -> TP 2, T5 TP 2 -> FSDP 2, ViT 1 process
    # -> TP 2, LLaVA 1 process -> FSDP 2).
    for family in ("bert", "t5", "vit", "llava"):
        _same_run(ref["runs"][family], fsdp["runs"][f"{family}_reshard"], first=6, last=7)
    # Validation at the last step with the family's metrics (BERT: MLM loss and accuracy, sentence-order accuracy;
    # T5: decoder token accuracy), summed over the data ranks before dividing: 2 data ranks (FSDP), TP 2 and PP 2
    # give the one-process numbers on the same held-out rows.
    pairs = (("bert", "bert"), ("bert", "bert_tp"), ("t5", "t5"), ("t5", "t5_tp"), ("bert_sop", "bert_sop"),
             ("bert_sop", "bert_pp"), ("bert_sop", "bert_sop_tp"))
    for one, two in pairs:
        a, b = ref["runs"][one]["validation"], fsdp["runs"][two]["validation"]
        keys = {"bert": {"loss", "mlm_loss", "mlm_accuracy"}, "t5": {"loss", "token_accuracy"}}.get(
            one, {"loss", "mlm_loss", "mlm_accuracy", "sop_accuracy"})
        assert set(a) == set(b) == keys, (two, a, b)
        assert 0 <= a["mlm_accuracy" if "mlm_accuracy" in a else "token_accuracy"] < 1, (one, a)
        for key in a:  # accuracies: counts of argmax hits, exact unless a near-tie flips; losses as the training's
            assert b[key] == pytest.approx(a[key], rel=LOSS_RTOL, abs=1e-6), (two, key, a, b)
    ref_run, fsdp_run = ref["runs"]["toy"], fsdp["runs"]["toy"]

    # It learns: finite throughout, and clearly lower at the end (real text; ~7.64 -> ~7.06 here).
    losses = [h["loss"] for h in ref_run["history"]]
    assert losses[-1] < losses[0] - 0.3, losses
    assert max(losses[-3:]) < min(losses[:3]), losses

    # The trainer counted with the spec's functions, for the args it built (vocab from the tokenizer, seq_len).
    for run in (ref_run, fsdp_run):
        args = spec.args_cls(**{**dataclasses.asdict(spec.flavors["tiny"]), **run["args"]})
        assert run["args"]["max_seq_len"] == SEQ and run["args"]["n_layers"] == spec.flavors["tiny"].n_layers
        counts = spec.param_counts(args)
        assert run["counts"] == {"total": counts.total, "active": counts.active, "embedding": counts.embedding}
        assert run["flops_per_token"] == run["spec_flops_per_token"] == spec.flops_per_token(args, SEQ)
        assert any(line.startswith(f"model toy tiny: {counts.total:,} params ({counts.total - counts.embedding:,} "
                                   f"non-embedding)") for line in run["log"]), run["log"]
        for h in run["history"]:  # the logged TFLOP/s per device is tokens/s x the spec's FLOPs per token
            per_token = h["throughput/tflops_per_device"] * 1e12 / h["throughput/tokens_per_sec_per_device"]
            assert per_token == pytest.approx(spec.flops_per_token(args, SEQ), rel=1e-9)
    assert ref_run["local_params"] == ref_run["counts"]["total"]
    assert fsdp["local_params_all_ranks"] == fsdp_run["counts"]["total"]  # the shards add up to the model
    assert fsdp_run["local_params"] < fsdp_run["counts"]["total"]  # and rank 0 holds only its share

    # The masked-LM encoder and the image classifier learn too (slowly: 15% of 128 tokens / 4 images per step;
    # ~7.57 -> ~7.43 and ~2.18 -> ~1.99 here).
    for family in ("toy_encoder", "toy_vision", "nemotron_h", "bert", "bert_sop", "t5", "vit", "llava"):
        losses = [h["loss"] for h in ref["runs"][family]["history"]]
        assert losses[-1] < losses[0], (family, losses)
    # Masked-LM's loss is over the masked tokens only: a fresh model's is near ln(vocab), as for next-token.
    assert abs(ref["runs"]["toy_encoder"]["history"][0]["loss"] - math.log(ref_run["args"]["vocab_size"])) < 0.5

    # Frozen parameters: the patch projection ends as the seed checkpoint had it (1 process and FSDP: loaded, never
    # updated), the trainable position table moved; the FSDP run's checkpoint holds the projection as model state
    # and no optimizer state for it (the worker also checked the optimizer's groups and state, and that a resume
    # loaded the same moments and weights).
    seed = ref["vision_seed_sums"]
    for run in (ref["runs"]["toy_vision"], fsdp["runs"]["toy_vision"]):
        for name in ("patch_embed.proj.weight", "patch_embed.proj.bias"):
            assert run["patch_sums"][name] == seed[name], (name, run["patch_sums"], seed)
        assert run["patch_sums"]["patch_embed.pos"] != seed["patch_embed.pos"]
    saved = fsdp["runs"]["toy_vision"]
    assert saved["resumed_patch_sums"] == saved["patch_sums"]
    keys = saved["saved_keys"]
    assert "model.patch_embed.proj.weight" in keys and "model.patch_embed.pos" in keys, keys
    optim = [k for k in keys if k.startswith("optimizer.")]
    assert any("patch_embed.pos" in k for k in optim) and not any("patch_embed.proj" in k for k in optim), optim


# ------------------------------------------------------------------------------------ the toy spec, one process


def test_toy_spec_counts_are_exact(monkeypatch):
    """param_counts against the meta-built model; flops_per_token against torch's FLOP counter (every matmul of one
    forward + backward, SDPA on the math backend so its bmm's are counted, full [S, S] scores as in the formula)."""
    toy = _toy(monkeypatch)
    spec = toy.SPEC
    args = dataclasses.replace(spec.flavors["tiny"], vocab_size=512, max_seq_len=SEQ)
    with torch.device("meta"):
        meta = spec.model_cls(args)
    counts = spec.param_counts(args)
    assert counts.total == counts.active == sum(p.numel() for p in meta.parameters())
    assert counts.embedding == meta.wte.weight.numel() + meta.wpe.weight.numel()

    torch.manual_seed(0)
    model = spec.model_cls(args)
    model.init_weights()
    batch = 2
    tokens = torch.randint(0, args.vocab_size, (batch, SEQ + 1))
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        logits = model(tokens[:, :-1])
        F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
    assert counter.get_total_flops() == batch * SEQ * spec.flops_per_token(args, SEQ)

    costs = spec.pp_costs(args, SEQ)
    assert sum(costs.layers.values()) + costs.embedding + costs.output == spec.flops_per_token(args, SEQ)
    assert spec.check(args, type("Par", (), {"tp": 2, "pp": 1, "cp": 1, "ep": 1})(), "tiny")  # refuses TP


def test_toy_plans_found_through_the_registry(monkeypatch):
    """get_plan finds a registered family's plans by its spec alone (the registry entry is undone afterwards)."""
    import models
    from parallelize import get_plan

    toy = _toy(monkeypatch)
    import toy_plans

    monkeypatch.setitem(models.MODELS, "toy", toy.SPEC)
    assert get_plan("toy", "default") is toy_plans.parallelize_toy
    with pytest.raises(ValueError, match="unknown plan 'nope' for model 'toy'"):
        get_plan("toy", "nope")
    assert models.get_spec("toy").find_flavor(dataclasses.replace(toy.SPEC.flavors["tiny"], vocab_size=7)) == "tiny"
