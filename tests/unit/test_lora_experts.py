"""LoRA on the routed experts (docs/post_training.md#lora): a target naming the experts module ("experts", with
lora.include_experts) gives each expert's w1, w2, w3 its own A and B, stacked like the weights
(models/common/lora.py's add_expert_adapters) and applied as a low-rank term in every expert path
(models/common/moe.py's LowRank: the per-expert loop, its compiled masked form, torch._grouped_mm). Checked: a fresh
adapter changes nothing, every path equals the merged weights W + alpha/r * B @ A in value and gradient, the merged
state dict computes the adapted model, adapters_disabled gives the base, a block compiles whole, the config's one-line
errors, and a Trainer run's step merged by the inference loader and the HF export (transformers' Qwen3-MoE) while
export-peft refuses it. Layouts (EP 2, EP 2 x CP 2) are held to one process in tests/multiproc/test_dist_lora.py."""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch

import models
from models.common.lora import adapters_disabled, has_lora, merge_state_dict
from models.common.moe import GroupedExperts, LowRank, swiglu_expert_loop, swiglu_grouped_mm
from tests.unit.lora_helpers import lora_model, randomise_b
from titanlike.config.errors import ConfigError
from titanlike.config.load import config_from_dict
from titanlike.config.validate import validate

torch.set_num_threads(1)
SMALL = {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "head_dim": 16}
TARGETS = ["wq", "wo", "experts"]
TOKENS = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))


def _moe(lora: bool = True, seed: int = 0) -> torch.nn.Module:
    """Qwen3's MoE debug flavor at 2 blocks (8 experts, top 2, hidden 256), adapters on wq, wo and the experts."""
    spec = models.get_spec("qwen3")
    args = dataclasses.replace(spec.flavor_args("debugmodel_moe", SMALL), vocab_size=128, max_seq_len=16)
    return lora_model(spec, args, TARGETS, lora=lora, seed=seed, rank=4, alpha=8.0, include_experts=True)


def test_fresh_expert_adapters_change_nothing_and_init_as_peft():
    """Adapters [E, r, in] / [E, out, r] on w1, w2, w3 under `<experts>.lora_A.<w>`; B = 0: the logits are the plain
    model's bitwise; each expert's A within 1/sqrt(in), as kaiming-uniform(a=sqrt(5)) draws a Linear's."""
    lora, plain = _moe(), _moe(lora=False)
    sd, plain_sd = lora.state_dict(), plain.state_dict()
    assert set(plain_sd) < set(sd) and all(torch.equal(plain_sd[k], sd[k]) for k in plain_sd)
    experts = lora.layers["0"].moe.experts
    shapes = {k: tuple(v.shape) for k, v in sd.items() if k.startswith("layers.0.moe.experts.lora_")}
    assert shapes == {"layers.0.moe.experts.lora_A.w1": (8, 4, 64), "layers.0.moe.experts.lora_B.w1": (8, 256, 4),
                      "layers.0.moe.experts.lora_A.w3": (8, 4, 64), "layers.0.moe.experts.lora_B.w3": (8, 256, 4),
                      "layers.0.moe.experts.lora_A.w2": (8, 4, 256), "layers.0.moe.experts.lora_B.w2": (8, 64, 4)}
    trainable = {n for n, p in lora.named_parameters() if p.requires_grad}
    assert len(trainable) == 2 * (2 * 2 + 2 * 3) and all(".lora_" in n for n in trainable)
    with torch.no_grad():
        assert torch.equal(lora(TOKENS), plain(TOKENS))
    for name, a in experts.lora_A.items():
        bound = 1 / math.sqrt(a.shape[-1])
        assert bound * 0.9 < a.abs().max() <= bound, name
        assert all(a[e].std() > 0.5 * bound / math.sqrt(3) for e in range(8)), name  # every expert drawn
        assert torch.count_nonzero(experts.lora_B[name]) == 0


def _merged(w: LowRank) -> torch.Tensor:
    return w.w + w.scale * w.b @ w.a


@pytest.mark.parametrize("path", ["loop", "compiled_masked", "grouped_mm"])
def test_every_expert_path_equals_the_merged_weights(path, monkeypatch):
    """x through LowRank weights == x through W + s * B @ A (fp32, 1e-5), and so do the gradients of x, A and B
    (autograd through the merged weight is the reference)."""
    torch.manual_seed(0)
    e, dim, hidden, r = 4, 8, 16, 4  # (torch._grouped_mm wants 16-byte row strides: 4 fp32)
    counts = torch.tensor([3, 0, 5, 2])  # an expert with no tokens, and 2 padding rows
    shapes = {"w1": (hidden, dim), "w2": (dim, hidden), "w3": (hidden, dim)}
    # nn.Linear-like scales (values of order 1, so fp32 rounding stays far below the tolerance)
    leaves = {k: [torch.randn(e, o, i) / i ** 0.5, torch.randn(e, r, i) / i ** 0.5, torch.randn(e, o, r) / r ** 0.5]
              for k, (o, i) in shapes.items()}
    x = torch.randn(12, dim)
    if path == "compiled_masked":  # the branch torch.compile takes, without paying for a compile
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    fn = swiglu_grouped_mm if path == "grouped_mm" else swiglu_expert_loop

    def run(merge: bool):
        xs = x.clone().requires_grad_()
        ts = {k: [t.clone().requires_grad_() for t in v] for k, v in leaves.items()}
        ws = {k: LowRank(*v, scale=0.5) for k, v in ts.items()}
        out = fn(xs, *(_merged(ws[k]) if merge else ws[k] for k in ("w1", "w2", "w3")), counts)
        out[:10].backward(torch.ones(10, dim))
        return out[:10], xs.grad, {k: [t.grad for t in v[1:]] for k, v in ts.items()}

    out, gx, grads = run(merge=False)
    ref, ref_gx, ref_grads = run(merge=True)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(gx[:10], ref_gx[:10], atol=1e-5, rtol=1e-5)
    for k in grads:
        for g, rg in zip(grads[k], ref_grads[k]):
            torch.testing.assert_close(g, rg, atol=1e-4, rtol=1e-5)
            assert not g[1].any()  # the expert with no tokens: no gradient on its adapters


def test_merged_state_dict_computes_the_adapted_model_and_only_adapters_learn():
    """merge_state_dict (batched B @ A per expert) into a plain model gives the LoRA model's logits (1e-5); a backward
    reaches every adapter and nothing else; adapters_disabled gives the base's logits."""
    lora, plain = _moe(), _moe(lora=False)
    randomise_b(lora)
    assert has_lora(lora) and not has_lora(plain)
    merged = _moe(lora=False)
    merged.load_state_dict(merge_state_dict(lora.state_dict(), scaling=8.0 / 4))
    out = lora(TOKENS)
    with torch.no_grad():
        assert (out - merged(TOKENS)).abs().max().item() <= 1e-5
        assert (out - plain(TOKENS)).abs().max().item() > 1e-3  # the expert adapters act
        with adapters_disabled(lora):
            assert torch.equal(lora(TOKENS), plain(TOKENS))
        assert torch.equal(lora(TOKENS), out)  # enabled again after the block
    out.float().logsumexp(-1).mean().backward()
    with_grad = {n for n, p in lora.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
    assert with_grad == {n for n, p in lora.named_parameters() if p.requires_grad}


def test_moe_block_with_expert_adapters_compiles_whole():
    """A MoE block with adapters on attention and the routed experts compiles as one graph (fullgraph, as
    parallelize/compile.py asks; the experts' masked loop) and computes the eager forward and backward (1e-5)."""
    lora = _moe()
    randomise_b(lora)
    block = lora.layers["0"]
    args = (torch.randn(2, 16, 64, requires_grad=True), lora.rope_cache[:16])
    eager = block(*args)
    eager.sum().backward()
    grads = {n: p.grad.clone() for n, p in block.named_parameters() if p.grad is not None}
    assert len(grads) == 10  # wq, wo and the experts' w1, w2, w3: A and B each
    block.zero_grad()
    torch._dynamo.reset()
    out = torch.compile(block, fullgraph=True, backend="aot_eager")(*args)
    out.sum().backward()
    assert (out - eager).abs().max().item() <= 1e-5
    for n, g in grads.items():
        assert (block.get_parameter(n).grad - g).abs().max().item() <= 1e-5, n


def _cfg(tmp_path, name="run", **sections):
    base = {
        "job": {"dump_folder": str(tmp_path), "run_name": name},
        "model": {"name": "qwen3", "flavor": "debugmodel_moe", "vocab_size": 128, "args": dict(SMALL)},
        "training": {"steps": 3, "seq_len": 16, "local_batch_size": 2, "device": "cpu", "max_norm": 1.0},
        "optimizer": {"lr": 1e-2}, "data": {"dataset": "mock"}, "lr_scheduler": {"warmup_steps": 1},
        "metrics": {"log_freq": 1, "enable_tensorboard": False},
        "lora": {"enable": True, "rank": 4, "alpha": 8.0, "target_modules": TARGETS, "include_experts": True},
    }
    for section, values in sections.items():
        base.setdefault(section, {}).update(values)
    cfg = config_from_dict(base)
    validate(cfg, 1)
    return cfg


def _error(tmp_path, **sections) -> str:
    with pytest.raises(ConfigError) as e:
        _cfg(tmp_path, **sections)
    assert "\n" not in str(e.value)
    return str(e.value)


def test_expert_targets_need_include_experts_and_a_small_enough_rank(tmp_path):
    assert _error(tmp_path, lora={"include_experts": False}) == (
        "lora.target_modules entry 'experts' matches only routed experts; set lora.include_experts=true or remove "
        "'experts'")
    assert _error(tmp_path, lora={"rank": 80, "target_modules": ["experts"]}) == (
        "lora.rank=80 is larger than min(in, out) = 64 of layers.0.moe.experts (64 -> 256); choose lora.rank <= 64 "
        "or leave that layer out of lora.target_modules")
    # The default targets name the dense FFN's w1/w2/w3, which this model (every FFN routed) lacks: the line says how
    # experts are named
    assert _error(tmp_path, lora={"target_modules": ["wq", "w1"], "include_experts": False}) == (
        "lora.target_modules entry 'w1' matches no Linear layer of the model; its Linear names are ['output', 'wk', "
        "'wo', 'wq', 'wv'] (the routed experts take adapters by their module's name, ['experts'], with "
        "lora.include_experts=true): fix or remove 'w1'")


def test_trained_expert_adapters_merge_on_load_and_export_but_not_to_peft(tmp_path, capsys):
    """A Trainer LoRA run with expert adapters (steps holding base and adapters): the inference loader and the merged
    HF export (read by transformers' Qwen3-MoE) compute the trained model's logits; export-peft refuses in one
    line."""
    from tests.unit.test_lora_export import _convert
    from titanlike.infer import load_for_inference
    from titanlike.train.trainer import Trainer

    cfg = _cfg(tmp_path, checkpoint={"enable": True, "interval": 3}, lora={"save_adapter_only": False})
    trainer = Trainer(cfg)
    try:
        trainer.train()
        experts = trainer.model.layers["0"].moe.experts
        assert experts.lora_B["w2"].abs().max() > 1e-3  # the expert adapters trained
        trainer.model.eval()
        with torch.no_grad():
            logits = trainer.model(TOKENS).float()
    finally:
        trainer.close()
    run = tmp_path / "run"
    loaded = load_for_inference(str(run))
    assert not has_lora(loaded.model) and isinstance(loaded.model.layers["0"].moe.experts, GroupedExperts)
    with torch.no_grad():
        assert (loaded.model(TOKENS).float() - logits).abs().max().item() <= 1e-5
    convert = _convert()
    assert convert(["export-peft", str(run), str(tmp_path / "peft")]) == 2
    err = capsys.readouterr().err.strip()
    assert "adapters on routed experts (layers.0.moe.experts)" in err and "export merged weights" in err, err
    assert "\n" not in err
    transformers = pytest.importorskip("transformers")
    assert convert(["export", str(run), str(tmp_path / "hf"), "--dtype", "float32", "--no-tokenizer",
                    "--no-progress"]) == 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", torch_dtype=torch.float32).eval()
    with torch.no_grad():
        assert (hf(TOKENS).logits.float() - logits).abs().max().item() <= 1e-4
