"""DeepSeek-V3 family (models/deepseek_v3, parallelize/deepseek_v3.py): HF parity of MLA variants (q LoRA or not, YaRN
or plain RoPE), YaRN against transformers, the hub config, refusals, hand counts and published sizes, checks, and the
debug config training end to end. CPU, fp32, tiny shapes. What every family gets (counts against the built model,
FLOPs, export into transformers, plans on fake ranks): tests/unit/test_model_contract.py; the plans on 2 gloo
processes: tests/multiproc/test_dist_deepseek_v3.py."""
from __future__ import annotations

import dataclasses
import json
import math
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest
import torch

import models
from models.common.moe import MoEArgs
from models.deepseek_v3 import SPEC, ModelArgs, Transformer
from models.deepseek_v3.flavors import deepseek_v3_flavors
from models.deepseek_v3.hf import args_from_hf_config, from_hf, hf_config
from models.deepseek_v3.mla import softmax_scale_factor, yarn_inv_freq

torch.set_num_threads(1)

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "beta_fast": 32.0,
        "beta_slow": 1.0, "mscale": 0.9, "mscale_all_dim": 0.7}  # mscale != mscale_all_dim: cos/sin get scaled too


def tiny_args(**kw) -> ModelArgs:
    base = dict(dim=64, n_layers=3, n_heads=4, vocab_size=128, max_seq_len=32, n_dense_layers=1, dense_hidden_dim=96,
                q_lora_rank=24, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                moe=MoEArgs(num_experts=8, top_k=2, hidden_dim=32, num_shared_experts=1, score_func="sigmoid",
                            route_norm=True, route_scale=2.5, n_groups=4, topk_groups=2))
    base.update(kw)
    return ModelArgs(**base)


def build(args: ModelArgs, seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device="cpu")
    model.init_weights()
    return model


def test_registry_and_flavors():
    assert models.get_spec("deepseek_v3") is SPEC
    assert set(SPEC.flavors) == {"debugmodel", "16B", "16B_4L", "236B", "671B"}
    v3 = deepseek_v3_flavors["671B"]
    assert (v3.dim, v3.n_layers, v3.n_heads, v3.n_dense_layers, v3.q_lora_rank, v3.vocab_size) == (
        7168, 61, 128, 3, 1536, 129280)
    assert (v3.moe.num_experts, v3.moe.top_k, v3.moe.n_groups, v3.moe.topk_groups, v3.moe.route_scale) == (
        256, 8, 8, 4, 2.5)
    lite = deepseek_v3_flavors["16B"]
    assert (lite.dim, lite.n_layers, lite.n_heads, lite.q_lora_rank, lite.dense_hidden_dim, lite.moe.hidden_dim,
            lite.moe.num_experts, lite.moe.top_k, lite.moe.num_shared_experts) == (2048, 27, 16, 0, 10944, 1408,
                                                                                    64, 6, 2)
    assert dataclasses.replace(lite, n_layers=4) == deepseek_v3_flavors["16B_4L"]


def test_args_survive_asdict_and_do_not_share_moe():
    """Checkpoints store dataclasses.asdict(args) and rebuild with ModelArgs(**d); runs derive args with replace."""
    args = deepseek_v3_flavors["debugmodel"]
    again = ModelArgs(**json.loads(json.dumps(dataclasses.asdict(args))))
    assert again == args and isinstance(again.moe, MoEArgs)
    run = dataclasses.replace(args, vocab_size=256)
    assert run.moe is not args.moe and SPEC.find_flavor(run) == "debugmodel"


def test_forward_causal_and_finite():
    args = tiny_args()
    model = build(args)
    tokens = torch.randint(0, args.vocab_size, (2, 12))
    out = model(tokens)
    assert out.shape == (2, 12, args.vocab_size) and torch.isfinite(out).all()
    changed = tokens.clone()
    changed[:, 8] = (changed[:, 8] + 1) % args.vocab_size
    # Not bit-exact: a changed token changes how many rows each expert's matmul gets, hence its blocking.
    torch.testing.assert_close(model(changed)[:, :8], out[:, :8], rtol=0, atol=1e-6)
    assert not torch.allclose(model(changed)[:, 8:], out[:, 8:])
    assert [type(b.moe if b.moe_enabled else b.feed_forward).__name__ for b in model.layers.values()] == [
        "FeedForward", "MoE", "MoE"]


# ------------------------------------------------------------------------------------------------ HF


def _hf_config(q_lora_rank, rope):
    transformers = pytest.importorskip("transformers")
    config = transformers.DeepseekV3Config(
        vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8,
        routed_scaling_factor=2.5, kv_lora_rank=32, q_lora_rank=q_lora_rank, qk_rope_head_dim=8, v_head_dim=16,
        qk_nope_head_dim=16, n_group=4, topk_group=2, num_experts_per_tok=2, first_k_dense_replace=1,
        norm_topk_prob=True, max_position_embeddings=64, rms_norm_eps=1e-6,
        rope_parameters={"rope_theta": 10000.0, **(rope or {"rope_type": "default"})}, tie_word_embeddings=False)
    config._attn_implementation = "eager"
    return config


def _hf_model(q_lora_rank, rope, seed=0):
    transformers = pytest.importorskip("transformers")
    config = _hf_config(q_lora_rank, rope)
    torch.manual_seed(seed)
    hf = transformers.DeepseekV3ForCausalLM(config).float().eval()
    with torch.no_grad():  # larger-than-default random weights (norms too) so mapping bugs show up
        for name, p in hf.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn_like(p) if "norm" in name else 0.15 * torch.randn_like(p))
        for name, b in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.05 * torch.randn_like(b))
    return hf, config


@pytest.mark.parametrize("q_lora_rank, rope", [(None, YARN), (24, YARN), (24, None)],
                         ids=["q_plain-yarn", "q_lora-yarn", "q_lora-plain_rope"])
def test_hf_parity(q_lora_rank, rope):
    hf, config = _hf_model(q_lora_rank, rope)
    args = args_from_hf_config(config.to_dict())
    assert args.q_lora_rank == (q_lora_rank or 0) and args.rope_factor == (4.0 if rope else 1.0)
    model = Transformer(args).eval()
    hf_sd = hf.state_dict()
    model.load_state_dict(from_hf(hf_sd, args), strict=True)
    tokens = torch.randint(0, 128, (2, 40))
    with torch.no_grad():
        ref = hf(tokens).logits
        out = model(tokens)
    assert ref.abs().max() > 1.0  # non-trivial logits
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


def test_yarn_matches_transformers_and_changes_logits():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = _hf_config(24, YARN)
    config.head_dim = config.qk_rope_head_dim
    ref_freq, ref_factor = ROPE_INIT_FUNCTIONS["yarn"](config)
    args = args_from_hf_config(config.to_dict())
    torch.testing.assert_close(yarn_inv_freq(8, 10000.0, 4.0, 16, 32.0, 1.0), ref_freq, rtol=1e-6, atol=0)
    assert softmax_scale_factor(args) == pytest.approx((0.1 * 0.7 * math.log(4.0) + 1) ** 2)
    assert ref_factor == pytest.approx((0.1 * 0.9 * math.log(4.0) + 1) / (0.1 * 0.7 * math.log(4.0) + 1))
    scaled = build(args)
    plain = Transformer(dataclasses.replace(args, rope_factor=1.0))
    plain.load_state_dict(scaled.state_dict())
    tokens = torch.randint(0, 128, (1, 30))
    assert not torch.allclose(scaled(tokens), plain(tokens))


def test_args_from_deepseek_v3_hub_config():
    """DeepSeek-V3's own config.json (transformers 4 layout, with its FP8 and MTP fields) reads as the 671B flavor."""
    cfg = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 7168,
           "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
           "num_attention_heads": 128, "num_key_value_heads": 128, "n_shared_experts": 1, "n_routed_experts": 256,
           "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64,
           "v_head_dim": 128, "qk_nope_head_dim": 128, "topk_method": "noaux_tc", "n_group": 8, "topk_group": 4,
           "num_experts_per_tok": 8, "first_k_dense_replace": 3, "norm_topk_prob": True, "scoring_func": "sigmoid",
           "aux_loss_alpha": 0.001, "seq_aux": True, "hidden_act": "silu", "max_position_embeddings": 163840,
           "rms_norm_eps": 1e-06, "rope_theta": 10000, "vocab_size": 129280, "num_nextn_predict_layers": 1,
           "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                            "original_max_position_embeddings": 4096, "type": "yarn"},
           "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]},
           "tie_word_embeddings": False, "attention_bias": False}
    assert SPEC.find_flavor(args_from_hf_config(cfg)) == "671B"


def test_hf_refusals():
    with pytest.raises(ValueError, match="sigmoid"):
        hf_config(deepseek_v3_flavors["16B"], torch.bfloat16)  # V2-Lite's softmax routing
    assert hf_config(deepseek_v3_flavors["671B"], torch.bfloat16)["q_lora_rank"] == 1536
    with pytest.raises(KeyError, match="dequantize"):
        from_hf({"model.layers.0.self_attn.o_proj.weight_scale_inv": torch.zeros(1)}, tiny_args())
    with pytest.raises(KeyError, match="unexpected HF key"):
        from_hf({"model.bogus.weight": torch.zeros(1)}, tiny_args())
    base = hf_config(tiny_args(), torch.float32)
    with pytest.raises(ValueError, match="rope_interleave"):
        args_from_hf_config(dict(base, rope_interleave=False))
    # DeepSeek-V3's multi-token-prediction layer (model.layers.61 in the real checkpoint) is skipped, as HF does.
    assert from_hf({"model.layers.3.eh_proj.weight": torch.zeros(1)}, tiny_args()) == {}


# ------------------------------------------------------------------------------------------------ counts


def _hand_counts(a: ModelArgs) -> tuple[int, int]:
    """(total, active) from the architecture, by hand."""
    m = a.moe
    h = a.n_heads
    q = a.dim * h * a.qk_head_dim if a.q_lora_rank == 0 else (
        a.dim * a.q_lora_rank + a.q_lora_rank + a.q_lora_rank * h * a.qk_head_dim)
    attn = (q + a.dim * (a.kv_lora_rank + a.qk_rope_head_dim) + a.kv_lora_rank
            + a.kv_lora_rank * h * (a.qk_nope_head_dim + a.v_head_dim) + h * a.v_head_dim * a.dim)
    norms = 2 * a.dim
    dense = 3 * a.dim * a.dense_hidden_dim
    expert = 3 * a.dim * m.hidden_dim
    shared = 3 * a.dim * m.num_shared_experts * m.hidden_dim
    router = a.dim * m.num_experts
    n_moe = a.n_layers - a.n_dense_layers
    common = a.n_layers * (attn + norms) + a.n_dense_layers * dense + n_moe * (router + shared) \
        + 2 * a.vocab_size * a.dim + a.dim
    return common + n_moe * m.num_experts * expert, common + n_moe * m.top_k * expert


@pytest.mark.parametrize("flavor", sorted(deepseek_v3_flavors))
def test_param_counts(flavor):
    args = deepseek_v3_flavors[flavor]
    counts = SPEC.param_counts(args)
    assert (counts.total, counts.active) == _hand_counts(args)
    assert counts.embedding == args.vocab_size * args.dim


def test_published_sizes():
    """The flavors land on the sizes DeepSeek publishes (total / active, in billions)."""
    for flavor, total, active in (("16B", 15.7, 2.4), ("236B", 236, 21), ("671B", 671, 37)):
        c = SPEC.param_counts(deepseek_v3_flavors[flavor])
        emb = c.embedding  # DeepSeek's active count leaves out the input embedding (but not the output)
        assert c.total / 1e9 == pytest.approx(total, rel=0.01), flavor
        assert (c.active - emb) / 1e9 == pytest.approx(active, rel=0.03), flavor


def test_pp_costs_dense_and_moe_differ():
    args = deepseek_v3_flavors["671B"]
    costs = SPEC.pp_costs(args, 4096)
    assert len(costs.layers) == 61 and costs.layers["0"] == costs.layers["2"] != costs.layers["3"]
    total = sum(costs.layers.values()) + costs.output
    assert total == pytest.approx(SPEC.flops_per_token(args, 4096), rel=1e-3)


def test_check():
    par = lambda **kw: dataclasses.replace(_Par(), **kw)  # noqa: E731
    args = deepseek_v3_flavors["16B"]
    assert SPEC.check(args, par(tp=8), "16B") == []
    assert "n_heads=16" in SPEC.check(args, par(tp=3), "16B")[0]
    assert any("ep=3" in p for p in SPEC.check(args, par(ep=3), "16B"))
    dense = dataclasses.replace(tiny_args(), n_layers=1)
    assert "no experts" in SPEC.check(dense, par(ep=2), "x")[0]


@dataclasses.dataclass
class _Par:
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1


# ------------------------------------------------------------------------------------------------ training


def test_debug_config_trains(tmp_path):
    from titanlike.config.load import load_config
    from titanlike.train.trainer import Trainer

    cfg = load_config(["--config", "configs/deepseek_v3_debug.toml", f"--job.dump_folder={tmp_path}",
                       "--training.steps=8", "--training.device=cpu", "--metrics.log_freq=1",
                       "--metrics.enable_tensorboard=false", "--lr_scheduler.warmup_steps=2"])
    trainer = Trainer(cfg)
    try:
        history = trainer.train()
    finally:
        trainer.close()
    losses = [h["loss"] for h in history]
    assert len(losses) == 8 and all(math.isfinite(x) for x in losses)
    assert losses[-1] < losses[0] - 0.5, losses
