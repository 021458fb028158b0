"""Megatron hybrid (pretrain_mamba.py / MambaModel) models: their flags translate to nemotron_h or mamba2, and their
checkpoints convert (models/nemotron_h/megatron.py, models/mamba2/megatron.py).

megatron-core 0.16.1 cannot build a MambaModel on this CPU: megatron/core/ssm/mamba_mixer.py imports triton at module
level and MambaMixer raises ImportError without mamba_ssm (its layer spec also needs Transformer Engine). So the
checkpoint side is tested on hand-made Megatron state dicts whose key names and shapes are the ones megatron-core's
source creates (MambaMixer.__init__ and sharded_state_dict, MambaStack, MambaModel; listed in EXPECTED below), written
to disk in both formats: torch_dist as Megatron's sharded_state_dict lays it out (unstacked layers, in_proj/conv1d
split into parts) and legacy TP=2 shards as a rank's module holds them (in_proj rows [z_r, x_r, B_r, C_r, dt_r]).
"""
from __future__ import annotations

import argparse
import dataclasses
import os

import pytest
import torch

from titanlike.config.megatron import MegatronError, translate_text

from tests.unit.test_megatron_checkpoint import convert, titanlike_logits

NEMOTRON_H_8B = r"""torchrun --nproc-per-node 8 pretrain_mamba.py \
    --num-layers 52 --hidden-size 4096 --ffn-hidden-size 21504 --num-attention-heads 32 \
    --group-query-attention --num-query-groups 8 --kv-channels 128 --squared-relu --normalization RMSNorm \
    --position-embedding-type none --untie-embeddings-and-output-weights --disable-bias-linear --is-hybrid-model \
    --hybrid-override-pattern M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M- \
    --spec megatron.core.models.mamba.mamba_layer_specs mamba_stack_spec --mamba-head-dim 64 --mamba-num-heads 128 \
    --mamba-num-groups 8 --mamba-state-dim 128 --seq-length 4096 --attention-dropout 0 --hidden-dropout 0 --bf16
"""
TINY = ("--num-layers 4 --hidden-size 128 --num-attention-heads 4 --group-query-attention --num-query-groups 2 "
        "--kv-channels 32 --ffn-hidden-size 256 --squared-relu --normalization RMSNorm --position-embedding-type none "
        "--untie-embeddings-and-output-weights --disable-bias-linear --mamba-head-dim 16 --mamba-num-heads 8 "
        "--mamba-num-groups 2 --mamba-state-dim 16 --attention-dropout 0 --hidden-dropout 0 "
        "--spec megatron.core.models.mamba.mamba_layer_specs mamba_stack_spec ")


def _model(t) -> dict:
    return t.values["model"]


def test_nemotron_h_8b_launch_is_the_8b_flavor() -> None:
    t = translate_text(NEMOTRON_H_8B)
    assert (_model(t)["name"], _model(t)["flavor"]) == ("nemotron_h", "8B") and "args" not in _model(t)
    assert not t.required(), t.required()
    notes = dict(t.notes)
    assert "mamba_stack_spec" not in dict(t.unmapped) and "Mamba layer spec" in notes["--spec"]
    assert "never clamps the step size" in notes["(model)"]  # nemotron_h clamps dt at dt_min: said
    assert "family nemotron_h: --hybrid-override-pattern M-M-M-M*" in t.said[0]


def test_tiny_pattern_gives_flavor_and_args() -> None:
    t = translate_text(TINY + "--hybrid-override-pattern M*M-")
    assert (_model(t)["name"], _model(t)["flavor"]) == ("nemotron_h", "debugmodel")
    assert _model(t).get("args", {}) in ({}, {"chunk_size": 128})  # the shape is debugmodel's; only the kernel chunk
    t = translate_text(TINY + "--hybrid-override-pattern M-*M")
    assert _model(t)["args"]["hybrid_override_pattern"] == "M-*M"


def test_all_mamba_is_mamba2() -> None:
    # A pure Mamba-2 stack is HF's Mamba2 model: models/mamba2 computes what Megatron does (no dt clamp).
    for pattern in ("--hybrid-override-pattern MMMM", ""):
        t = translate_text(TINY + pattern)
        assert _model(t)["name"] == "mamba2", pattern
        assert not any("clamp" in text for _, text in t.notes)


def test_ratios_place_layers_as_megatron_does() -> None:
    alloc = pytest.importorskip("megatron.core.ssm.mamba_hybrid_layer_allocation")
    from models.nemotron_h.megatron import hybrid_pattern

    for n in (4, 10, 24, 48, 52):
        for att, mlp in ((0.1, 0.0), (0.25, 0.25), (0.125, 0.5), (0.0, 0.3), (0.5, 0.5)):
            ours = hybrid_pattern({"num_layers": n, "hybrid_attention_ratio": att, "hybrid_mlp_ratio": mlp})
            assert ours == "".join(alloc.allocate_layers(n, att, mlp)), (n, att, mlp)
    t = translate_text(TINY + "--hybrid-attention-ratio 0.25 --hybrid-mlp-ratio 0.25")
    assert _model(t)["name"] == "nemotron_h"
    want = "".join(alloc.allocate_layers(4, 0.25, 0.25))
    assert _model(t).get("args", {}).get("hybrid_override_pattern", "M*M-") == want


@pytest.mark.parametrize("change,words", [
    (("--position-embedding-type none", ""), ["--position-embedding-type learned_absolute", "none"]),
    (("--position-embedding-type none", "--position-embedding-type rope"), ["--position-embedding-type rope"]),
    (("--squared-relu", ""), ["--squared-relu"]),
    (("--squared-relu", "--squared-relu --swiglu"), ["--swiglu"]),
    (("--disable-bias-linear", ""), ["--disable-bias-linear"]),
    (("--normalization RMSNorm", ""), ["--normalization LayerNorm"]),
    (("", "--hybrid-override-pattern M*E-"), ["'E' (MoE)"]),
    (("", "--hybrid-override-pattern M*M"), ["--hybrid-override-pattern has 3 letters", "--num-layers is 4"]),
    (("", "--hybrid-override-pattern M*M- --hybrid-attention-ratio 0.5"), ["other layer counts"]),
    (("--mamba-num-groups 2", "--mamba-num-groups 3"), ["--mamba-num-groups 3"]),
])
def test_refusals_name_the_flag(change, words) -> None:
    old, new = change
    block = TINY.replace(old, new) if old else TINY + new
    block += "" if "pattern" in new else " --hybrid-override-pattern M*M-"
    with pytest.raises(MegatronError) as e:
        translate_text(block)
    msg = str(e.value)
    assert "\n" not in msg and all(w in msg for w in words), msg


def test_unfollowable_flags_are_unmapped() -> None:
    t = translate_text(TINY.replace("mamba_stack_spec", "my_spec") + "--hybrid-override-pattern M*M- --is-hybrid-model")
    assert "custom layer spec" in dict(t.unmapped)["--spec"] and t.required()
    t = translate_text(TINY + "--hybrid-override-pattern M*M- --disable-mamba-mem-eff-path --no-position-embedding")
    assert "kernel choice" in dict(t.notes)["--disable-mamba-mem-eff-path"]
    assert "--position-embedding-type none" in dict(t.unmapped)["--no-position-embedding"]


# ----------------------------------------------------------------------------------------------- checkpoints
def _args(pattern: str):
    from models import get_spec

    name = "mamba2" if set(pattern) == {"M"} else "nemotron_h"
    base = get_spec(name).flavors["debugmodel"]
    extra = {} if name == "mamba2" else {"hybrid_override_pattern": pattern}
    return name, dataclasses.replace(base, n_layers=len(pattern), vocab_size=256, **extra)


def _state(name: str, args) -> dict[str, torch.Tensor]:
    from models import get_spec

    torch.manual_seed(0)
    model = get_spec(name).model_cls(args)
    model.init_weights()
    with torch.no_grad():  # no parameter left at a constant (D = 1, norms = 1): a swap would show
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def expected_shapes(args, pattern: str) -> dict[str, tuple]:
    """The tensors megatron-core 0.16.1 creates, by its source (TP = 1): MambaMixer (in_proj out = 2 d_inner +
    2 ngroups d_state + nheads, split in sharded_state_dict into z, x, B, C, dt; conv1d [conv_dim, 1, d_conv] split
    into x, B, C; A_log, D, dt_bias [nheads]; ExtendedRMSNorm [d_inner]; out_proj [hidden, d_inner]), TE's fused
    layer-norm linears, MambaStack.final_norm, MambaModel's embedding and untied output_layer."""
    h, inner, bc, heads = args.dim, args.mamba_n_heads * args.mamba_head_dim, args.n_groups * args.ssm_state_size, \
        args.mamba_n_heads
    out = {"embedding.word_embeddings.weight": (args.vocab_size, h), "decoder.final_norm.weight": (h,),
           "output_layer.weight": (args.vocab_size, h)}
    for i, kind in enumerate(pattern):
        p = f"decoder.layers.{i}."
        if kind == "M":
            out.update({p + "mixer.in_proj.layer_norm_weight": (h,), p + "mixer.in_proj.weight.z": (inner, h),
                        p + "mixer.in_proj.weight.x": (inner, h), p + "mixer.in_proj.weight.B": (bc, h),
                        p + "mixer.in_proj.weight.C": (bc, h), p + "mixer.in_proj.weight.dt": (heads, h),
                        p + "mixer.A_log": (heads,), p + "mixer.D": (heads,), p + "mixer.dt_bias": (heads,),
                        p + "mixer.norm.weight": (inner,), p + "mixer.out_proj.weight": (h, inner)})
            for part, rows in (("x", inner), ("B", bc), ("C", bc)):
                out[p + f"mixer.conv1d.weight.{part}"] = (rows, 1, args.conv_kernel)
                out[p + f"mixer.conv1d.bias.{part}"] = (rows,)
        elif kind == "*":
            qkv = (args.n_heads + 2 * args.n_kv_heads) * args.head_dim
            out.update({p + "self_attention.linear_qkv.layer_norm_weight": (h,),
                        p + "self_attention.linear_qkv.weight": (qkv, h),
                        p + "self_attention.linear_proj.weight": (h, args.n_heads * args.head_dim)})
        else:
            out.update({p + "mlp.linear_fc1.layer_norm_weight": (h,), p + "mlp.linear_fc1.weight": (args.hidden_dim, h),
                        p + "mlp.linear_fc2.weight": (h, args.hidden_dim)})
    return out


@pytest.mark.parametrize("pattern", ["M*M-", "MM"])
def test_round_trip_and_megatron_shapes(pattern) -> None:
    from models import get_spec

    name, args = _args(pattern)
    adapter, sd = get_spec(name).megatron, _state(name, _args(pattern)[1])
    msd = adapter.to_megatron(sd, args)
    assert {k: tuple(v.shape) for k, v in msd.items()} == expected_shapes(args, pattern)
    back = adapter.from_megatron(msd, args, adapter.megatron_args(args))
    assert back.keys() == sd.keys() and all(torch.equal(back[k], sd[k]) for k in sd)
    # Megatron's parts concatenate to transformers' packed rows ([z; x; B; C; dt], conv [x; B; C]), whatever order
    # titanlike keeps them in (the HF export is checked against transformers' logits in the model contract test).
    hf = get_spec(name).hf.to_hf(sd, args)
    for i in (i for i, kind in enumerate(pattern) if kind == "M"):
        for ours, parts in (("in_proj.weight", ("z", "x", "B", "C", "dt")), ("conv1d.weight", "xBC"),
                            ("conv1d.bias", "xBC")):
            fused = torch.cat([msd[f"decoder.layers.{i}.mixer.{ours}.{p}"] for p in parts])
            hf_key = next(k for k in hf if k.endswith(f"layers.{i}.mixer.{ours}"))
            assert torch.equal(fused, hf[hf_key]), (i, ours)
    margs = {"num_attention_heads": 4, **adapter.megatron_args(args), "padded_vocab_size": 256}
    assert adapter.claims(margs)
    again = adapter.args_from_megatron(margs)  # the chunk is a kernel choice Megatron does not save: 128 there
    assert dataclasses.replace(again, chunk_size=args.chunk_size) == args


def _margs(adapter, args, tp: int) -> dict:
    return {"num_attention_heads": 4, **adapter.megatron_args(args), "padded_vocab_size": args.vocab_size,
            "tensor_model_parallel_size": tp, "pipeline_model_parallel_size": 1}


def _rank_shard(key: str, value: torch.Tensor, parts: dict, adapter, r: int, tp: int) -> torch.Tensor:
    """Rank r's tensor as Megatron's module holds it: fused Mamba tensors [part_1 of r, part_2 of r, ...]."""
    suffix = key.split(".", 3)[3] if key.startswith("decoder.layers.") else key
    if suffix in ("mixer.in_proj.weight", "mixer.conv1d.weight", "mixer.conv1d.bias"):
        return torch.cat([t.chunk(tp)[r] for t in parts[key]])
    rule = adapter.TP_SPLIT[suffix]
    return value if rule == "rep" else value.chunk(tp, dim=0 if rule == "col" else 1)[r].clone()


@pytest.mark.parametrize("pattern", ["M*M-", "MM"])
def test_checkpoint_files_import_with_the_same_logits(tmp_path, pattern) -> None:
    from models import get_spec
    from titanlike.checkpoint.megatron_format import write_torch_dist

    name, args = _args(pattern)
    spec = get_spec(name)
    sd = _state(name, args)
    msd = spec.megatron.to_megatron(sd, args)
    model = spec.model_cls(args)
    model.load_state_dict(sd)
    tokens = torch.arange(32).reshape(2, 16).mul(37).remainder(args.vocab_size)
    with torch.no_grad():
        ref = model.eval()(tokens).float()
    # torch_dist, as Megatron saves a MambaModel (TP-independent parts, one key per layer)
    td = tmp_path / "td"
    write_torch_dist(str(td), 7, msd, _margs(spec.megatron, args, 1), ("mixer.in_proj", "mixer.out_proj"))
    assert convert(["import", str(td), str(tmp_path / "ck_td")]) == 0
    torch.testing.assert_close(titanlike_logits(str(tmp_path / "ck_td"), tokens), ref, atol=0, rtol=0)
    # legacy --ckpt-format torch, TP=2: each rank's fused in_proj/conv1d
    legacy, parts = tmp_path / "legacy", {}
    for key, value in msd.items():
        base, _, part = key.rpartition(".")
        if part in ("z", "x", "B", "C", "dt"):
            parts.setdefault(base, []).append(value)
    whole = {k: v for k, v in msd.items() if k.rpartition(".")[2] not in ("z", "x", "B", "C", "dt")}
    whole.update({k: torch.cat(v) for k, v in parts.items()})
    for r in range(2):
        os.makedirs(legacy / "iter_0000007" / f"mp_rank_0{r}")
        shard = {k: _rank_shard(k, v, parts, spec.megatron, r, 2) for k, v in whole.items()}
        torch.save({"args": argparse.Namespace(**_margs(spec.megatron, args, 2)), "model": shard, "iteration": 7,
                    "checkpoint_version": 3.0}, legacy / "iter_0000007" / f"mp_rank_0{r}" / "model_optim_rng.pt")
    (legacy / "latest_checkpointed_iteration.txt").write_text("7")
    assert convert(["import", str(legacy), str(tmp_path / "ck_tp2")]) == 0
    torch.testing.assert_close(titanlike_logits(str(tmp_path / "ck_tp2"), tokens), ref, atol=0, rtol=0)
    # export writes what it read
    assert convert(["export", str(tmp_path / "ck_td"), str(tmp_path / "exp"), "--dtype", "float32"]) == 0
    assert convert(["import", str(tmp_path / "exp"), str(tmp_path / "ck_back")]) == 0
    torch.testing.assert_close(titanlike_logits(str(tmp_path / "ck_back"), tokens), ref, atol=0, rtol=0)
