"""Unit tests for models/ and the Llama 3 family (CPU, tiny shapes, fp32). What every registered family is checked on
(counts and shape, FLOPs, HF export, plans on fake ranks): tests/unit/test_model_contract.py."""

from __future__ import annotations

import copy
import dataclasses
import math
import os
import pathlib
import re

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest
import torch

import models
from models.common.norms import RMSNorm
from models.common.rope import apply_rotary_emb, precompute_rope_cache
from models.common.attention import causal_attention
from models.common.ffn import ffn_hidden_dim
from models.llama3 import ModelArgs, Transformer
from models.llama3.flavors import llama3_flavors
from models.llama3.hf import args_from_hf_config, from_hf, to_hf

torch.set_num_threads(1)
MODELS_DIR = pathlib.Path(models.__file__).parent


def tiny_args(**kw) -> ModelArgs:
    base = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=128, multiple_of=16, rope_theta=10000.0,
                max_seq_len=32)
    base.update(kw)
    return ModelArgs(**base)


def build(args: ModelArgs, seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device="cpu")
    model.init_weights()
    return model


# ------------------------------------------------------------------------------------ registry


def test_registry():
    spec = models.get_spec("llama3")
    assert spec.model_cls is Transformer and spec.args_cls is ModelArgs
    assert set(spec.flavors) == {"debugmodel", "1B", "3B", "8B", "8B_4L", "70B", "70B_4L", "405B"}
    with pytest.raises(ValueError, match=r"'nope'.*llama3"):
        models.get_spec("nope")


def test_no_torch_distributed_import_under_models():
    pattern = re.compile(r"torch\.distributed|from\s+torch\s+import\s+[^\n]*\bdistributed\b")
    files = list(MODELS_DIR.rglob("*.py"))
    assert files
    offenders = [str(f) for f in files if pattern.search(f.read_text())]
    assert not offenders, offenders


# ------------------------------------------------------------------------------------ forward


def test_forward_shape_and_dtype():
    args = tiny_args()
    model = build(args)
    tokens = torch.randint(0, args.vocab_size, (2, 16))
    logits = model(tokens)
    assert logits.shape == (2, 16, args.vocab_size) and logits.dtype == torch.float32
    assert torch.isfinite(logits).all()
    out_bf16 = model.to(torch.bfloat16)(tokens)
    assert out_bf16.dtype == torch.bfloat16 and torch.isfinite(out_bf16.float()).all()


def test_seq_longer_than_rope_table_raises():
    args = tiny_args(max_seq_len=8)
    with pytest.raises(ValueError, match="max_seq_len"):
        build(args)(torch.zeros(1, 9, dtype=torch.long))


def test_debugmodel_runs():
    args = llama3_flavors["debugmodel"]
    model = build(dataclasses.replace(args, max_seq_len=16))
    assert model(torch.randint(0, args.vocab_size, (1, 16))).shape == (1, 16, args.vocab_size)


def test_rmsnorm_bf16_matches_fp32():
    torch.manual_seed(0)
    norm = RMSNorm(64, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(64))
    x = 30 * torch.randn(4, 64)  # large values: a bf16 sum of squares would lose precision
    ref = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * norm.weight
    out = norm.to(torch.bfloat16)(x.bfloat16())
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)


def test_causal():
    args = tiny_args()
    model = build(args)
    tokens = torch.randint(0, args.vocab_size, (1, 12))
    changed = tokens.clone()
    changed[0, 8] = (changed[0, 8] + 1) % args.vocab_size
    a, b = model(tokens), model(changed)
    torch.testing.assert_close(a[:, :8], b[:, :8], rtol=0, atol=0)
    assert not torch.allclose(a[:, 8:], b[:, 8:])


def _reference_attention(q, k, v):
    """Plain math: [B,S,H,D] q, [B,S,Hkv,D] k/v, query head h reads KV head h // (H/Hkv)."""
    n_rep = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(n_rep, dim=2), v.repeat_interleave(n_rep, dim=2)
    scores = torch.einsum("bshd,bthd->bhst", q, k) / math.sqrt(q.shape[-1])
    mask = torch.ones(q.shape[1], q.shape[1], dtype=torch.bool).tril()
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.einsum("bhst,bthd->bshd", scores.softmax(-1), v)


@pytest.mark.parametrize("repeat", [False, True], ids=["enable_gqa", "repeat_kv"])
@pytest.mark.parametrize("n_kv", [4, 2, 1])
def test_attention_core_gqa(n_kv, repeat):
    """Both ways of handing grouped KV heads to SDPA give the reference, forward and backward."""
    torch.manual_seed(0)
    q = torch.randn(2, 10, 4, 8, requires_grad=True)
    k, v = torch.randn(2, 10, n_kv, 8, requires_grad=True), torch.randn(2, 10, n_kv, 8, requires_grad=True)
    out, ref = causal_attention(q, k, v, repeat_kv_heads=repeat), _reference_attention(q, k, v)
    torch.testing.assert_close(out, ref)
    dout = torch.randn_like(out)
    for g, g_ref in zip(torch.autograd.grad(out, (q, k, v), dout), torch.autograd.grad(ref, (q, k, v), dout)):
        torch.testing.assert_close(g, g_ref)


@pytest.mark.parametrize("n_kv", [4, 2, 1])
def test_gqa_models_run(n_kv):
    args = tiny_args(n_kv_heads=n_kv)
    model = build(args)
    assert model.layers["0"].attention.wk.weight.shape == (n_kv * 16, 64)
    assert torch.isfinite(model(torch.randint(0, 128, (2, 8)))).all()


def test_attention_is_tp_shardable():
    """Simulate 2-way TP: each 'rank' keeps half the q heads and half the kv heads (column-sharded
    wq/wk/wv, row-sharded wo). The module must infer local heads, and the partial outputs sum to the full."""
    args = tiny_args(n_heads=4, n_kv_heads=2)
    model = build(args)
    attn = model.layers["0"].attention
    x = torch.randn(2, 8, 64)
    full = attn(x, model.rope_cache)
    hd = args.head_dim
    total = torch.zeros_like(full)
    for rank in range(2):
        local = copy.deepcopy(attn)
        q_rows = slice(rank * 2 * hd, (rank + 1) * 2 * hd)
        kv_rows = slice(rank * hd, (rank + 1) * hd)
        with torch.no_grad():
            local.wq.weight = torch.nn.Parameter(attn.wq.weight[q_rows].clone())
            local.wk.weight = torch.nn.Parameter(attn.wk.weight[kv_rows].clone())
            local.wv.weight = torch.nn.Parameter(attn.wv.weight[kv_rows].clone())
            local.wo.weight = torch.nn.Parameter(attn.wo.weight[:, q_rows].clone())
        total += local(x, model.rope_cache)
    torch.testing.assert_close(total, full, atol=1e-5, rtol=1e-5)


def test_rope_matches_complex_reference():
    """Interleaved real-valued RoPE equals Meta's complex-multiplication formulation."""
    torch.manual_seed(0)
    head_dim, seq = 16, 10
    cache = precompute_rope_cache(head_dim, 32, 10000.0)
    xq, xk = torch.randn(2, seq, 3, head_dim), torch.randn(2, seq, 1, head_dim)
    oq, ok = apply_rotary_emb(xq, xk, cache)
    freqs = torch.outer(torch.arange(seq).float(), 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim)))
    rot = torch.polar(torch.ones_like(freqs), freqs)[None, :, None, :]
    for x, o in ((xq, oq), (xk, ok)):
        ref = torch.view_as_real(torch.view_as_complex(x.unflatten(-1, (-1, 2))) * rot).flatten(-2)
        torch.testing.assert_close(o, ref, atol=1e-5, rtol=1e-5)


def test_pipeline_stages_compose():
    args = tiny_args(n_layers=4)
    full = build(args)
    tokens = torch.randint(0, args.vocab_size, (2, 8))
    stage0, stage1 = copy.deepcopy(full), copy.deepcopy(full)
    stage0.norm = stage0.output = None
    del stage0.layers["2"], stage0.layers["3"]
    stage1.tok_embeddings = None
    del stage1.layers["0"], stage1.layers["1"]
    hidden = stage0(tokens)
    assert hidden.shape == (2, 8, args.dim)
    torch.testing.assert_close(stage1(hidden), full(tokens))
    # A stage still initialises (depth-scaled std uses each block's own layer_id).
    stage1.init_weights()
    assert stage1.layers["3"].layer_id == 3


# ------------------------------------------------------------------------------------ init


def test_meta_init_sets_every_param():
    args = tiny_args(n_layers=3)
    with torch.device("meta"):
        model = Transformer(args)
    assert all(p.is_meta for p in model.parameters())
    model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float("nan"))
        model.rope_cache.fill_(float("nan"))
    model.init_weights()
    for name, p in model.named_parameters():
        assert torch.isfinite(p).all(), name
    torch.testing.assert_close(model.rope_cache, precompute_rope_cache(16, 32, 10000.0))
    assert "rope_cache" not in model.state_dict()
    assert torch.isfinite(model(torch.randint(0, 128, (1, 8)))).all()


def test_init_statistics():
    args = tiny_args(dim=256, n_heads=4, n_kv_heads=4, n_layers=4, vocab_size=512, multiple_of=64)
    model = build(args)
    assert abs(model.tok_embeddings.weight.std().item() - 1.0) < 0.05
    assert torch.equal(model.norm.weight, torch.ones(256))
    assert torch.equal(model.layers["1"].ffn_norm.weight, torch.ones(256))
    out_std = 256**-0.5
    w = model.output.weight
    assert abs(w.std().item() / out_std - 1) < 0.1 and w.abs().max() <= 3 * out_std + 1e-6
    for i in range(4):
        blk = model.layers[str(i)]
        depth_std = 0.02 / math.sqrt(2 * (i + 1))
        assert abs(blk.attention.wq.weight.std().item() / 0.02 - 1) < 0.1
        assert abs(blk.attention.wo.weight.std().item() / depth_std - 1) < 0.1
        assert abs(blk.feed_forward.w2.weight.std().item() / depth_std - 1) < 0.1


# ------------------------------------------------------------------------------------ counts


EXPECTED_COUNTS = {
    "8B": 8_030_261_248,
    "1B": 1_498_482_688,  # untied; Llama 3.2 1B (tied) is 1,235,814,400
    "3B": 3_606_752_256,
    "70B": 70_553_706_496,
    "405B": 405_853_388_800,
}


LLAMA3 = models.get_spec("llama3")


@pytest.mark.parametrize("flavor", sorted(EXPECTED_COUNTS))
def test_param_counts(flavor):
    """The spec's counts against published sizes and against the parameters of the model built on meta."""
    args = llama3_flavors[flavor]
    assert LLAMA3.flavors[flavor] is args
    counts = LLAMA3.param_counts(args)
    with torch.device("meta"):
        model = Transformer(args)
    numel = sum(p.numel() for p in model.parameters())
    assert counts.total == numel == EXPECTED_COUNTS[flavor]
    assert counts.active == counts.total  # dense: every parameter is active
    assert counts.embedding == args.vocab_size * args.dim == model.tok_embeddings.weight.numel()


# ------------------------------------------------------------------------------------ HF parity


def _hf_model(rope_scaling: bool, tie: bool = False):
    transformers = pytest.importorskip("transformers")
    kw = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
              intermediate_size=172, max_position_embeddings=64, rms_norm_eps=1e-5, tie_word_embeddings=tie)
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16} if rope_scaling else None
    try:  # transformers >= 5 folds rope_theta into rope_parameters
        config = transformers.LlamaConfig(**kw, rope_parameters={"rope_type": "default", **(rope or {}),
                                                                 "rope_theta": 10000.0})
    except TypeError:
        config = transformers.LlamaConfig(**kw, rope_theta=10000.0, rope_scaling=rope)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(config).float().eval()
    with torch.no_grad():  # larger-than-default random weights (incl. norms) so mapping bugs show up
        for name, p in hf.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn_like(p) if "norm" in name else 0.15 * torch.randn_like(p))
    return hf, config


def test_hf_parity_and_roundtrip_with_llama31_rope_scaling():
    """From HF (llama3 RoPE scaling, an odd FFN width) and back; the plain debug flavor both ways, and every other
    family: tests/unit/test_model_contract.py."""
    rope_scaling = True
    hf, config = _hf_model(rope_scaling)
    args = args_from_hf_config(config.to_dict())
    assert args.use_scaled_rope == rope_scaling
    model = Transformer(args).eval()
    hf_sd = {k: v for k, v in hf.state_dict().items()}
    model.load_state_dict(from_hf(hf_sd, args), strict=True)

    tokens = torch.randint(0, 256, (2, 40))
    with torch.no_grad():
        ref = hf(tokens).logits
        out = model(tokens)
    assert ref.abs().max() > 1.0  # non-trivial logits
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)

    back = to_hf(model.state_dict(), args)
    assert set(back) == set(hf_sd)
    for k in back:
        assert torch.equal(back[k], hf_sd[k]), k
    hf2, _ = _hf_model(rope_scaling)
    hf2.load_state_dict(back, strict=True)
    with torch.no_grad():
        torch.testing.assert_close(hf2(tokens).logits, ref, atol=0, rtol=0)


def test_rope_scaling_changes_logits():
    """Guard that the scaled-RoPE parity case actually exercises the scaling."""
    args = tiny_args(max_seq_len=64, use_scaled_rope=True, rope_original_max_position=16)
    scaled = build(args)
    plain = Transformer(dataclasses.replace(args, use_scaled_rope=False))
    plain.load_state_dict(scaled.state_dict())
    tokens = torch.randint(0, 128, (1, 40))
    assert not torch.allclose(scaled(tokens), plain(tokens))


def test_hf_tied_checkpoint_unties():
    hf, config = _hf_model(False, tie=True)
    args = args_from_hf_config(config.to_dict())
    sd = {k: v for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    converted = from_hf(sd, args)
    assert torch.equal(converted["output.weight"], converted["tok_embeddings.weight"])
    assert converted["output.weight"].data_ptr() != converted["tok_embeddings.weight"].data_ptr()


def test_from_hf_rejects_unknown_keys():
    with pytest.raises(KeyError, match="bogus"):
        from_hf({"model.bogus.weight": torch.zeros(1)}, tiny_args())


def test_args_from_hf_config_llama31_8b():
    cfg = {  # Meta-Llama-3.1-8B config.json (transformers 4.x layout)
        "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
        "num_key_value_heads": 8, "vocab_size": 128256, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
        "max_position_embeddings": 131072, "tie_word_embeddings": False,
        "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    }
    args = args_from_hf_config(cfg)
    assert dataclasses.replace(args, max_seq_len=131072) == llama3_flavors["8B"]
    cfg_32_1b = dict(cfg, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                     rope_scaling=dict(cfg["rope_scaling"], factor=32.0))
    args_1b = args_from_hf_config(cfg_32_1b)
    # Several (multiple_of, multiplier) pairs give the same FFN width; only the width matters.
    assert ffn_hidden_dim(args_1b.dim, args_1b.multiple_of, args_1b.ffn_dim_multiplier) == 8192
    same = dict(multiple_of=1, ffn_dim_multiplier=None, max_seq_len=8192)
    assert dataclasses.replace(args_1b, **same) == dataclasses.replace(llama3_flavors["1B"], **same)
    with pytest.raises(ValueError, match="rope_type"):
        args_from_hf_config(dict(cfg, rope_scaling={"rope_type": "yarn", "factor": 4.0}))


def test_args_from_hf_config_arbitrary_ffn_width():
    for dim, width in [(64, 172), (64, 171), (512, 1000), (4096, 11008)]:
        a = args_from_hf_config({"hidden_size": dim, "intermediate_size": width, "num_hidden_layers": 1,
                                 "num_attention_heads": 4, "vocab_size": 10})
        assert ffn_hidden_dim(dim, a.multiple_of, a.ffn_dim_multiplier) == width
