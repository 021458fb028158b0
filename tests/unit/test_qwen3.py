"""Qwen3 (dense and MoE): HF parity and round trip of the variants (tied checkpoints, MoE layer patterns, routing
norms), published shapes (counts, plans, compile, training: test_qwen3_plans.py; the debug flavors' export into
transformers, counts and FLOPs, as every family's: test_model_contract.py).

CPU, float32, tiny shapes; transformers builds the references from its config classes (no downloads).
"""
from __future__ import annotations

import dataclasses
import json
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest
import torch

import models
from models.qwen3 import SPEC, Qwen3Args, Transformer
from models.qwen3.hf import args_from_hf_config, from_hf, hf_config, to_hf

transformers = pytest.importorskip("transformers")
torch.set_num_threads(1)

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, rope_theta=1e6, max_position_embeddings=64, rms_norm_eps=1e-6)
# head_dim 32 with 4 heads: n_heads * head_dim = 128 != hidden 64, as in the real Qwen3 shapes.
TINY_MOE = dict(TINY, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2)


def randomize(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Every parameter random (norm gains too, so the q/k norm permutation is exercised; the router's logits spread
    enough that top-k choices are far from ties)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_((0.5 if "gate.weight" in name else 0.08) * torch.randn(p.shape, generator=g))
    return model


def hf_model(moe: bool, seed: int = 0, **kw):
    if moe:
        cfg = transformers.Qwen3MoeConfig(**{**TINY_MOE, **kw})
        model = transformers.Qwen3MoeForCausalLM(cfg)
    else:
        cfg = transformers.Qwen3Config(**{**TINY, **kw})
        model = transformers.Qwen3ForCausalLM(cfg)
    return randomize(model, seed).eval()


def build(args: Qwen3Args, state_dict: dict | None = None, seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device="cpu")
    model.init_weights()
    if state_dict is not None:
        model.load_state_dict(state_dict)  # strict: every tensor named, nothing left over
    return model.eval()


def from_hf_model(hf, hf_sd: dict | None = None) -> tuple[Transformer, dict]:
    args = args_from_hf_config(hf.config.to_dict())
    sd = from_hf(hf.state_dict() if hf_sd is None else hf_sd, args)
    return build(args, sd), sd


def saved_state(hf, tmp_path) -> dict:
    """The tensors as a checkpoint on disk holds them (save_pretrained: per-expert names, lm_head dropped if tied)."""
    from safetensors.torch import load_file

    hf.save_pretrained(tmp_path)
    return load_file(os.path.join(tmp_path, "model.safetensors"))


def assert_logits_match(hf, ours, seq: int = 24) -> None:
    tokens = torch.randint(0, hf.config.vocab_size, (2, seq), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref, out = hf(tokens).logits, ours(tokens)
    assert (ref - out).abs().max().item() <= 1e-4, (ref - out).abs().max().item()


# ------------------------------------------------------------------------------------------------ HF parity


def test_registry():
    assert models.get_spec("qwen3") is SPEC
    assert {"debugmodel", "debugmodel_moe", "0.6B", "1.7B", "4B", "8B", "14B", "32B", "30B-A3B", "30B-A3B_4L",
            "235B-A22B"} == set(SPEC.flavors)


def test_tied_hf_checkpoint_imports_untied(tmp_path):
    """Qwen3-0.6B/1.7B/4B tie lm_head to the embedding; their checkpoints lack lm_head. Import copies the embedding
    into titanlike's (never tied) output; export writes it back, untied."""
    hf = hf_model(moe=False, tie_word_embeddings=True)
    assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()
    disk = saved_state(hf, tmp_path)
    assert "lm_head.weight" not in disk
    ours, sd = from_hf_model(hf, disk)
    assert torch.equal(sd["output.weight"], sd["tok_embeddings.weight"])
    assert sd["output.weight"].data_ptr() != sd["tok_embeddings.weight"].data_ptr()  # a copy: trained apart
    assert_logits_match(hf, ours)
    assert to_hf(ours.state_dict(), ours.args)["lm_head.weight"].equal(disk["model.embed_tokens.weight"])
    assert hf_config(ours.args, torch.float32)["tie_word_embeddings"] is False


@pytest.mark.parametrize("kw", [
    dict(norm_topk_prob=True),  # as the published Qwen3-MoE configs
    dict(norm_topk_prob=False, mlp_only_layers=[0]),  # transformers' default routing; a dense first layer
    dict(norm_topk_prob=True, decoder_sparse_step=2, num_hidden_layers=3),  # every second layer sparse
], ids=["norm_topk", "no_norm_mlp_only", "sparse_step_2"])
def test_moe_logits_match_hf_and_round_trip(tmp_path, kw):
    hf = hf_model(moe=True, **kw)
    disk = saved_state(hf, tmp_path)  # published per-expert names
    ours, sd = from_hf_model(hf, disk)
    args = ours.args
    assert args.moe.route_norm == kw["norm_topk_prob"]
    kinds = ["moe" if b.moe_enabled else "dense" for b in ours.layers.values()]
    assert kinds == ["moe" if hasattr(layer.mlp, "experts") else "dense" for layer in hf.model.layers]
    assert_logits_match(hf, ours)
    # from_hf then to_hf gives the checkpoint back, tensor for tensor.
    back = to_hf(ours.state_dict(), args)
    assert back.keys() == disk.keys()
    for k in disk:
        assert torch.equal(back[k], disk[k]), k
    # A transformers 5.x model's own state_dict (fused gate_up_proj / down_proj) imports to the same tensors.
    fused = from_hf(hf.state_dict(), args)
    assert fused.keys() == sd.keys() and all(torch.equal(fused[k], sd[k]) for k in sd)


def test_export_loads_in_transformers(tmp_path):
    """to_hf + hf_config written as a folder: AutoModelForCausalLM reads it and computes our logits."""
    from safetensors.torch import save_file

    hf = hf_model(moe=True, mlp_only_layers=[1])
    ours, _ = from_hf_model(hf)
    out = tmp_path / "export"
    out.mkdir()
    save_file({k: v.contiguous() for k, v in to_hf(ours.state_dict(), ours.args).items()},
              str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(hf_config(ours.args, torch.float32)))
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
    assert type(loaded).__name__ == "Qwen3MoeForCausalLM"
    assert_logits_match(loaded, ours)


@pytest.mark.parametrize("moe", [True, False], ids=["moe", "dense_tied"])
def test_convert_hf_import_then_export(tmp_path, moe):
    """scripts/convert_hf.py's path (titanlike/checkpoint/hf.py): an HF folder -> a titanlike step -> an HF folder
    that transformers loads with the original's logits (the MoE's expert_bias buffer made up on import, dropped on
    export; a tied checkpoint untied)."""
    from titanlike.checkpoint.hf import export_hf, import_hf

    hf = hf_model(moe=moe, **({} if moe else {"tie_word_embeddings": True}))
    hf.save_pretrained(tmp_path / "src")
    info = import_hf(str(tmp_path / "src"), str(tmp_path / "ckpt"), progress=False)
    assert info["model"] == "qwen3" and (info["model_args"].moe is not None) == moe
    out = export_hf(str(tmp_path / "ckpt"), str(tmp_path / "out"), dtype="float32", progress=False)
    back = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(back(tokens).logits, hf(tokens).logits)


def test_expert_bias_export_refuses_nonzero():
    hf = hf_model(moe=True)
    ours, _ = from_hf_model(hf)
    sd = ours.state_dict()
    assert torch.count_nonzero(sd["layers.0.moe.expert_bias"]) == 0 and "layers.0.moe.expert_bias" in sd
    sd["layers.0.moe.expert_bias"] = torch.ones(8)
    with pytest.raises(ValueError, match="expert_bias"):
        to_hf(sd, ours.args)


# The published config.json files (the fields titanlike reads), as on the Hub.
PUBLISHED = {
    "0.6B": dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=1024, intermediate_size=3072,
                 num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                 tie_word_embeddings=True),
    "8B": dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=4096, intermediate_size=12288,
               num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
               tie_word_embeddings=False),
    "30B-A3B": dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", hidden_size=2048,
                    intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48, num_attention_heads=32,
                    num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
                    decoder_sparse_step=1, mlp_only_layers=[], router_aux_loss_coef=0.001, tie_word_embeddings=False),
}


@pytest.mark.parametrize("flavor", sorted(PUBLISHED))
def test_published_configs_find_their_flavor(flavor):
    config = dict(PUBLISHED[flavor], vocab_size=151936, rms_norm_eps=1e-6, rope_theta=1000000.0, rope_scaling=None,
                  max_position_embeddings=40960, hidden_act="silu", attention_bias=False, use_sliding_window=False)
    args = args_from_hf_config(config)
    assert SPEC.find_flavor(args) == flavor
    again = args_from_hf_config(hf_config(args, torch.bfloat16))
    assert dataclasses.asdict(again) == dataclasses.asdict(args)


def test_args_survive_a_json_checkpoint_round_trip():
    """Checkpoints store dataclasses.asdict(args) in JSON and rebuild Qwen3Args(**d): the nested MoEArgs too."""
    args = dataclasses.replace(SPEC.flavors["30B-A3B"], mlp_only_layers=(0, 3))
    again = Qwen3Args(**json.loads(json.dumps(dataclasses.asdict(args))))
    assert again == args and again.mlp_only_layers == (0, 3)
    assert SPEC.find_flavor(dataclasses.replace(SPEC.flavors["30B-A3B"], vocab_size=1000)) == "30B-A3B"


def test_unsupported_hf_configs_are_refused():
    config = dict(PUBLISHED["8B"], vocab_size=151936)
    with pytest.raises(ValueError, match="sliding"):
        args_from_hf_config(dict(config, use_sliding_window=True))
    with pytest.raises(ValueError, match="rope_type"):
        args_from_hf_config(dict(config, rope_scaling={"rope_type": "yarn", "factor": 4.0}))
