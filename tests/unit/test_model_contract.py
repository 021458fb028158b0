"""The contract every registered model family is held to (models.MODELS), so a new family gets these checks by adding
its line there: parameter counts and ModelSpec.shape against the built model (every flavor, on meta); FLOPs per
token and pipeline costs against torch's FLOP counter; args that survive a JSON checkpoint and find their flavor;
the default plan applying TP 2 x FSDP 2 (x EP 2 with experts) on fake ranks with the FQNs kept; and, for a family
with an HF adapter, the export loaded by transformers giving our logits, the round trip of the weights and the
config, and the checkpoint tools' import/export path (titanlike/checkpoint/hf.py).

Run on each family's debug flavors (the flavors named "debug*": every family ships at least one) with a small
vocabulary and context; CPU, fp32. Family-specific behaviour (published sizes, HF variants such as tied checkpoints,
MoE layer patterns, MLA/YaRN, refusals) stays in the family's own test file.
"""
from __future__ import annotations

import dataclasses
import importlib
import json

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

import models

torch.set_num_threads(1)
VOCAB, SEQ = 128, 32
DEBUG = [(name, flavor) for name, spec in sorted(models.MODELS.items()) for flavor in spec.flavors
         if flavor.startswith("debug")]
# (an adapter's optional supports(args): False for a flavor its HF architecture cannot hold, e.g. T5's Megatron one)
WITH_HF = [(name, flavor) for name, flavor in DEBUG if models.MODELS[name].hf is not None
           and getattr(models.MODELS[name].hf, "supports", lambda args: True)(models.MODELS[name].flavors[flavor])]
# Families whose FLOPs the counter cannot see whole (work it has no formula for): their own file accounts for every
# difference exactly; the contract keeps the pipeline-cost checks for them.
OWN_FLOP_COUNT = {"qwen3_next": "tests/unit/test_qwen3_next.py::test_flops_match_flop_counter (the DeltaNet's "
                                "triangular solves are invisible to the counter)",
                  "vit": "tests/unit/test_vit.py::test_flops_per_image_match_the_flop_counter (a loader row is one "
                         "image: its FLOPs per row / seq_len, matmuls only; the counter is held to them per image)",
                  "llava": "its rows start with image slots of pixel bytes (models/llava/objective.py), which the "
                           "contract's short token rows cannot hold; its FLOPs are the decoder family's plus "
                           "models.llava.flops_per_image per slot"}
# Families whose primary input is not token ids (images): their adapter's example_inputs(tokens, args) gives it.
PIXEL_INPUT = {"vit"}


def small_args(spec, flavor: str):
    return dataclasses.replace(spec.flavors[flavor], vocab_size=VOCAB, max_seq_len=SEQ)


def build(spec, args, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    with torch.device("meta"):
        model = spec.model_cls(args)
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights()
    return model


def is_moe(model) -> bool:
    from models.common.moe import MoE

    return any(isinstance(m, MoE) for m in model.modules())  # the hybrids name their MoE "mixer"


def test_every_family_has_a_debug_flavor_and_its_plans():
    assert {name for name, _ in DEBUG} == set(models.MODELS)
    for name, spec in models.MODELS.items():
        assert models.get_spec(name) is spec and spec.name == name
        assert set(importlib.import_module(spec.plans).PLANS) >= {"default", "fsdp_only"}, name


@pytest.mark.parametrize("name", sorted(models.MODELS))
def test_counts_shape_and_args_match_every_flavor(name):
    """Every flavor, on the meta device: param_counts' total is the model's parameter count (shared ones once), the
    embedding count is the input table's; ModelSpec.shape's width and depth are the model's, and its keys and values
    per token and layer are what the attention's projections produce (MLA: per head after wkv_b). The args survive
    a checkpoint's JSON (dataclasses.asdict, then args_cls(**d), nested MoE args too) and find their flavor again,
    also with other run fields."""
    spec = models.get_spec(name)
    for flavor, args in spec.flavors.items():
        shape, counts = spec.shape(args), spec.param_counts(args)
        with torch.device("meta"):
            model = spec.model_cls(args)
        assert counts.total == sum(p.numel() for p in model.parameters()), flavor
        assert counts.active <= counts.total and (counts.active == counts.total) == (shape.moe_topk == 0), flavor
        table = getattr(model, "tok_embeddings", None)  # None: an image model (ViT's patch conv is a matmul)
        assert counts.embedding >= (table.weight.numel() if table is not None else 0), flavor  # GPT: + positions
        width = table.embedding_dim if table is not None else model.layers["0"].attention_norm.normalized_shape[0]
        assert shape.n_layers == len(model.layers) and shape.dim == width, flavor
        # The first attention module (hybrid families have other mixers on some layers, or no attention at all).
        attn = next((m for m in model.modules() if hasattr(m, "wkv_b") or hasattr(m, "wk") and hasattr(m, "wv")),
                    None)
        if attn is None:  # no attention layer: nothing for context parallel to gather
            kv = 0
        elif hasattr(attn, "wkv_b"):  # (k_nope + v) from the latent, plus the shared positional key on every head
            kv = attn.wkv_b.out_features + args.n_heads * args.qk_rope_head_dim
        else:
            kv = attn.wk.out_features + attn.wv.out_features
        assert shape.kv_dim == kv, (flavor, shape, kv)
        assert (shape.moe_topk > 0) == is_moe(model), flavor
        again = spec.args_cls(**json.loads(json.dumps(dataclasses.asdict(args))))
        assert again == args, flavor
        assert spec.find_flavor(dataclasses.replace(args, vocab_size=VOCAB, max_seq_len=SEQ)) == flavor


def _counted_flops(spec, args, model, seq: int, batch: int = 2) -> float:
    """torch's FLOP count of one forward + backward per token, on a batch the family's objective makes of `batch`
    rows of `seq` tokens (an encoder-decoder's decoder inputs come from it). SDPA on the math backend decomposes into
    bmm's the counter sees (the fused CPU kernel has no formula), over the full [S, S] scores, as the specs' formulas
    assume; nothing elementwise (norms, RoPE, softmax, activations, the loss) and no embedding lookup is counted."""
    from models.batch import StepContext, build_objective

    tokens = torch.randint(0, VOCAB, (batch, seq + 1), generator=torch.Generator().manual_seed(0))
    objective = build_objective(spec.objective, dataclasses.replace(args, max_seq_len=seq))
    b = objective(tokens[:, :-1], tokens[:, 1:], StepContext(step=0, seed=0))
    model.train()
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        logits = model(*b.args(), **b.kwargs())
        F.cross_entropy(logits.flatten(0, -2), b.labels.flatten()).backward()
    counts = {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}
    assert "aten.bmm" in counts, f"the attention (or scan) matmuls were not counted: {counts}"
    # torch's formula for a convolution's backward ignores `groups` (a depthwise conv, the hybrid mixers' short conv,
    # is counted as a dense one); its real work is grad-input + grad-weight, twice the forward's.
    total = sum(counts.values())
    if "aten.convolution_backward" in counts:
        total += 2 * counts["aten.convolution"] - counts["aten.convolution_backward"]
    return total / (batch * seq)


@pytest.mark.parametrize("name,flavor", DEBUG)
def test_flops_per_token_and_pp_costs_match_the_flop_counter(name, flavor):
    """Dense: the counter's figure is the spec's formula minus 6 x the 1-D parameters (norm gains, biases: no
    matmul), exactly. MoE: the counter sees the top-k experts each token went through and the router, plus the
    k-way weighted sum (a small bmm the formulas leave out): within 1%. Both: the attention term's growth with the
    sequence, exactly. pp_costs covers the blocks, and its pieces add up to the same FLOPs but for the 1-D
    parameters of the output modules (the final norm)."""
    spec = models.get_spec(name)
    args = small_args(spec, flavor)
    model = build(spec, args)
    one_d = sum(p.numel() for p in model.parameters() if p.ndim == 1)
    if name not in OWN_FLOP_COUNT:
        short, long = _counted_flops(spec, args, model, SEQ // 2), _counted_flops(spec, args, model, SEQ)
        if is_moe(model):
            assert long == pytest.approx(spec.flops_per_token(args, SEQ) - 6 * one_d, rel=1e-2)
        else:
            assert long == spec.flops_per_token(args, SEQ) - 6 * one_d
        assert long - short == spec.flops_per_token(args, SEQ) - spec.flops_per_token(args, SEQ // 2)
    costs = spec.pp_costs(args, SEQ)
    assert sorted(costs.layers, key=int) == sorted(model.layers, key=int)
    out_1d = sum(p.numel() for m in spec.output_modules if getattr(model, m) is not None  # (absent in a layout)
                 for p in getattr(model, m).parameters() if p.ndim == 1)
    total = sum(costs.layers.values()) + costs.embedding + costs.output
    if name in PIXEL_INPUT:  # vit: matmuls only, per image / seq_len (floats): the pieces add up to the whole
        assert total == pytest.approx(spec.flops_per_token(args, SEQ), rel=1e-12)
        return
    assert total == spec.flops_per_token(args, SEQ) - 6 * out_1d, (total, out_1d)


@pytest.mark.parametrize("name", sorted(models.MODELS))
def test_default_plan_shards_on_fake_ranks_and_keeps_fqns(name):
    """The family's default plan on 4 fake ranks (titanlike/planner/fake.py, the memory estimate's backend): TP 2 x
    FSDP 2 (FSDP 4 for a family whose check refuses TP, in one line), with EP 2 where the family has experts; every
    parameter becomes a DTensor, the FQNs are the one-process model's and a tie stays a tie. fsdp_only refuses TP."""
    from parallelize import PlanSections, get_plan
    from titanlike.config.sections import JobConfig
    from titanlike.distributed.parallel_dims import ParallelDims
    from titanlike.planner.fake import fake_world

    spec = models.get_spec(name)
    flavor = next(f for n, f in reversed(DEBUG) if n == name)  # the last: an MoE one where the family has it
    args = dataclasses.replace(spec.flavors[flavor], vocab_size=VOCAB, max_seq_len=SEQ)
    with torch.device("meta"):
        model = spec.model_cls(args)
    names = [n for n, _ in model.named_parameters()]
    cfg = JobConfig()
    cfg.model.name, cfg.model.flavor, cfg.compile.enable = name, flavor, False
    ep = 2 if is_moe(model) else 1
    # A family without a TP plan yet refuses tp in one line naming the key; it is then checked under FSDP 4.
    tp = 1 if spec.check(args, ParallelDims(dp_shard=2, tp=2, ep=ep, world_size=4), flavor) else 2
    with fake_world(0, 4):
        dims = ParallelDims(dp_shard=4 // tp, tp=tp, ep=ep, world_size=4)
        dims.build_mesh("cpu")
        refused = ParallelDims(dp_shard=2, tp=2, ep=ep, world_size=4)
        refused.build_mesh("cpu")
        with pytest.raises(ValueError, match="parallelism.tp=2") as e:
            with torch.device("meta"):
                get_plan(name, "fsdp_only" if tp > 1 else "default")(spec.model_cls(args), refused,
                                                                     PlanSections.of(cfg))
        assert "\n" not in str(e.value)
        model = get_plan(name, "default")(model, dims, PlanSections.of(cfg))
        params = dict(model.named_parameters())
        assert list(params) == names
        assert all(type(p).__name__ == "DTensor" for p in params.values()), [n for n, p in params.items()
                                                                              if type(p).__name__ != "DTensor"]
        if getattr(args, "tie_embeddings", False):
            assert model.output.weight is model.tok_embeddings.weight


def randomized(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Every parameter random and larger than the init (norm gains and biases too, so a mapping or permutation bug
    shows; router logits spread far from top-k ties). Buffers (RoPE, the zero expert bias) as init_weights left
    them."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_((0.5 if "router" in name else 0.08) * torch.randn(p.shape, generator=g))
    return model.eval()


def _inputs(spec, tokens: torch.Tensor, args) -> tuple[torch.Tensor, dict, dict]:
    """Our forward's primary input and keyword inputs, and transformers' inputs, for the same logits: the adapter's
    example_inputs where it has them (an encoder-decoder's decoder ids; an image model's pixels, args=its args),
    else the tokens alone."""
    example = getattr(spec.hf, "example_inputs", None)
    if example is None:
        return tokens, {}, {"input_ids": tokens}
    if spec.name in PIXEL_INPUT:
        return example(tokens, args)
    return (tokens, *example(tokens))


def assert_logits_match(ours, theirs, spec, args) -> torch.Tensor:
    tokens = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))
    primary, ours_kw, theirs_kw = _inputs(spec, tokens, args)
    with torch.no_grad():
        got, want = ours.eval()(primary, **ours_kw), theirs(**theirs_kw).logits
    # non-trivial logits (above 1 but for the original T5, whose tied head scales by dim ** -0.5: 0.33)
    assert want.abs().max() > 0.25
    # fp32 through differently ordered kernels: 3e-5 of the largest logit, at least 1e-4 (qwen3_next's debug model:
    # 2.1e-4 at logits of 9.9, where its own chunked and token-by-token delta rules differ by 1.6e-4)
    tol = max(1e-4, 3e-5 * want.abs().max().item())
    assert (got - want).abs().max().item() <= tol, ((got - want).abs().max().item(), tol)
    return got


@pytest.mark.parametrize("name,flavor", WITH_HF)
def test_hf_export_loads_in_transformers_with_our_logits_and_round_trips(name, flavor, tmp_path):
    """spec.hf both ways on random weights: to_hf + hf_config written as a folder load in transformers'
    AutoModelForCausalLM (or the adapter's AUTO_CLASS: AutoModelForMaskedLM for BERT,
    AutoModelForSeq2SeqLM for T5), which has the same
    parameter count and computes our logits (1e-4, or 3e-5 of the largest logit); from_hf gives our state dict
    back exactly, from to_hf's names and from transformers' own state dict. Then the checkpoint tools' path
    (titanlike/checkpoint/hf.py, scripts/convert_hf.py): a titanlike step exported by export_hf loads in transformers
    alike, and import_hf of that folder (args_from_hf_config of the written config.json) gives a step whose model
    computes the same logits bitwise, a tie kept."""
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import save_file

    from titanlike.checkpoint import load_model_weights, model_from_meta
    from titanlike.checkpoint.hf import export_hf, import_hf, write_model_step

    spec = models.get_spec(name)
    args = small_args(spec, flavor)
    ours = randomized(build(spec, args))
    sd = ours.state_dict()
    exported = spec.hf.to_hf(sd, args)
    back = spec.hf.from_hf(exported, args)
    assert back.keys() == sd.keys() and all(torch.equal(back[k], sd[k]) for k in sd), sorted(set(back) ^ set(sd))
    config = spec.hf.hf_config(args, torch.float32)

    folder = tmp_path / "direct"
    folder.mkdir()
    save_file({k: v.contiguous() for k, v in exported.items()}, str(folder / "model.safetensors"),
              metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config))
    auto = getattr(transformers, getattr(spec.hf, "AUTO_CLASS", "AutoModelForCausalLM"))  # an encoder's: masked-LM
    theirs = auto.from_pretrained(str(folder), dtype=torch.float32, attn_implementation="eager").eval()
    assert type(theirs).__name__ == config["architectures"][0]
    assert sum(p.numel() for p in theirs.parameters()) == spec.param_counts(args).total
    logits = assert_logits_match(ours, theirs, spec, args)
    own = spec.hf.from_hf(theirs.state_dict(), args)  # transformers' own names (5.x: fused experts), tie included
    assert own.keys() == sd.keys() and all(torch.equal(own[k], sd[k]) for k in sd), sorted(set(own) ^ set(sd))

    step = str(tmp_path / "step")
    write_model_step(step, name, args, sd, {}, "test", "test", "test")
    out = export_hf(step, str(tmp_path / "exported"), dtype="float32", progress=False, with_tokenizer=False)
    theirs = auto.from_pretrained(out, dtype=torch.float32, attn_implementation="eager").eval()
    assert_logits_match(ours, theirs, spec, args)
    imported = import_hf(out, str(tmp_path / "imported"), progress=False)
    assert imported["model"] == name
    again, _ = model_from_meta(imported["path"])
    again.to_empty(device="cpu")
    again.init_weights()
    load_model_weights(str(tmp_path / "imported"), again)
    if getattr(args, "tie_embeddings", False):
        assert again.output.weight is again.tok_embeddings.weight  # the tie survives the checkpoint load
    tokens = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        primary, ours_kw, _ = _inputs(spec, tokens, args)
        assert torch.equal(again.eval()(primary, **ours_kw), logits)
