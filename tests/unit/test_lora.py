"""LoRA (models/common/lora.py, docs/post_training.md#lora): the layer (B = 0 is the base, merging is exact, only
adapters get gradients, PEFT's init, compiled blocks whole), the [lora] config's one-line errors, the trainer's LoRA
run (adapter-only checkpoints, the base from checkpoint.initial_load_path, an exact resume with dropout), and the
memory estimate (gradients and optimizer state of the adapters only)."""
from __future__ import annotations

import math

import pytest
import torch

import models
from models.common.lora import LoraLinear, merge_state_dict
from tests.unit.lora_helpers import lora_model, randomise_b
from titanlike.config.errors import ConfigError
from titanlike.config.load import config_from_dict
from titanlike.config.validate import validate

torch.set_num_threads(1)
TARGETS = ["wq", "wk", "wv", "wo", "w1", "w2", "w3"]
TINY = {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "multiple_of": 32}


def _tiny(seed: int = 0, rank: int = 4, alpha: float = 8.0, targets=TARGETS, lora: bool = True) -> torch.nn.Module:
    spec = models.get_spec("llama3")
    args = spec.args_cls(**TINY, vocab_size=128, rope_theta=10000.0, max_seq_len=16)
    return lora_model(spec, args, targets, lora=lora, seed=seed, rank=rank, alpha=alpha)


TOKENS = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))


def test_fresh_adapters_leave_the_base_unchanged_and_init_as_peft():
    """B = 0 after init: the LoRA model's logits are the plain model's bitwise; A is kaiming-uniform(a=sqrt(5)):
    within nn.Linear's bound 1/sqrt(in) and spread over it; every FQN of the plain model is kept."""
    lora, plain = _tiny(), _tiny(lora=False)
    plain_sd = plain.state_dict()
    lora_sd = lora.state_dict()
    assert set(plain_sd) < set(lora_sd) and all(torch.equal(plain_sd[k], lora_sd[k]) for k in plain_sd)
    with torch.no_grad():
        assert torch.equal(lora(TOKENS), plain(TOKENS))
    a = lora.layers["0"].attention.wq.lora_A.weight
    bound = 1 / math.sqrt(a.shape[1])
    assert a.abs().max() <= bound and a.abs().max() > 0.9 * bound and a.std() > 0.5 * bound / math.sqrt(3)
    assert all(torch.count_nonzero(m.lora_B.weight) == 0 for m in lora.modules() if isinstance(m, LoraLinear))


def test_merge_equals_unmerged_and_only_adapters_get_gradients():
    """W + alpha/rank * B @ A in a plain model gives the LoRA model's logits (fp32, 1e-5); a backward leaves
    gradients on the 28 adapters only, and the output with B = 0 moves with B (the adapters take effect)."""
    lora = _tiny()
    randomise_b(lora)
    plain = _tiny(lora=False)
    plain.load_state_dict(merge_state_dict(lora.state_dict(), scaling=8.0 / 4))
    out = lora(TOKENS)
    with torch.no_grad():
        merged = plain(TOKENS)
    assert (out - merged).abs().max().item() <= 1e-5
    out.float().logsumexp(-1).mean().backward()
    with_grad = {n for n, p in lora.named_parameters() if p.grad is not None}
    trainable = {n for n, p in lora.named_parameters() if p.requires_grad}
    assert with_grad == trainable and len(trainable) == 28
    assert all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert all(p.grad.abs().sum() > 0 for n, p in lora.named_parameters() if p.grad is not None)


def test_lora_block_compiles_whole():
    """A LoRA block compiles as one graph (fullgraph=True, as parallelize/compile.py asks) and computes the eager
    forward and backward (1e-5)."""
    lora = _tiny()
    randomise_b(lora)
    block = lora.layers["0"]
    x = torch.randn(2, 16, 64, requires_grad=True)
    args = (x, lora.rope_cache[:16])
    eager = block(*args)
    eager.sum().backward()
    grads = {n: p.grad.clone() for n, p in block.named_parameters() if p.grad is not None}
    block.zero_grad()
    torch._dynamo.reset()
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    out = compiled(*args)
    out.sum().backward()
    assert (out - eager).abs().max().item() <= 1e-5
    for n, g in grads.items():
        assert (block.get_parameter(n).grad - g).abs().max().item() <= 1e-5, n


def _cfg(tmp_path, name="run", **sections):
    base = {
        "job": {"dump_folder": str(tmp_path), "run_name": name},
        "model": {"flavor": "debugmodel", "vocab_size": 128, "args": dict(TINY)},
        "training": {"steps": 6, "seq_len": 16, "local_batch_size": 2, "device": "cpu", "max_norm": 1.0},
        "optimizer": {"lr": 1e-2},
        "data": {"dataset": "mock"},
        "lr_scheduler": {"warmup_steps": 1},
        "metrics": {"log_freq": 1, "enable_tensorboard": False},
        "lora": {"enable": True, "rank": 4, "alpha": 8.0},
    }
    for section, values in sections.items():
        base.setdefault(section, {}).update(values)
    cfg = config_from_dict(base)
    validate(cfg, 1)
    return cfg


def _error(tmp_path, **sections) -> str:
    with pytest.raises(ConfigError) as e:
        _cfg(tmp_path, **sections)
    return str(e.value)


def test_bad_lora_settings_give_one_line_naming_the_key(tmp_path):
    assert _error(tmp_path, lora={"target_modules": ["wq", "q_proj"]}) == (
        "lora.target_modules entry 'q_proj' matches no Linear layer of the model; its Linear names are ['output', "
        "'w1', 'w2', 'w3', 'wk', 'wo', 'wq', 'wv']: fix or remove 'q_proj'")
    assert _error(tmp_path, lora={"rank": 40}) == (
        "lora.rank=40 is larger than min(in, out) = 32 of layers.0.attention.wk (64 -> 32); choose lora.rank <= 32 "
        "or leave that layer out of lora.target_modules")
    assert _error(tmp_path, lora={"rank": 0}) == "lora.rank=0 must be >= 1 (typical: 8 to 64)"
    assert _error(tmp_path, lora={"dropout": 1.5}) == "lora.dropout=1.5 must be in [0, 1)"
    assert _error(tmp_path, float8={"enable": True}) == (
        "lora.enable with float8.enable: both swap the same Linear layers; set float8.enable=false for a LoRA run")
    assert _error(tmp_path, lora={"target_modules": ["output"]}, training={"loss_chunk_tokens": 16}).startswith(
        "lora.target_modules puts an adapter on the output projection 'output', which the chunked loss")
    moe = {"name": "deepseek_v3", "flavor": "debugmodel", "args": {}}
    assert _error(tmp_path, model=moe, lora={"target_modules": ["wo", "shared_experts.w1"]}) == (
        "lora.target_modules entry 'shared_experts.w1' matches only Linear layers inside MoE layers; set "
        "lora.include_experts=true or remove 'shared_experts.w1'")
    _cfg(tmp_path, model=moe, lora={"target_modules": ["wo", "shared_experts.w1"], "include_experts": True})
    assert _error(tmp_path, model=moe, lora={"target_modules": ["gate"], "include_experts": True}) == (
        "lora.target_modules entry 'gate' matches only MoE router gates, whose weight the router reads directly (fp32 "
        "logits): an adapter there would do nothing; remove 'gate'")
    assert "\n" not in _error(tmp_path, lora={"rank": 40})
    from titanlike.config.validate import advise

    assert [n for n in advise(_cfg(tmp_path)) if n.startswith("lora")] == [
        "lora.enable without checkpoint.initial_load_path: the frozen base is the seeded random init (training.seed), "
        "not a pretrained model; set checkpoint.initial_load_path to the base's checkpoint (scripts/convert_hf.py "
        "import makes one from an HF model)"]
    assert not [n for n in advise(_cfg(tmp_path, checkpoint={"initial_load_path": "x"})) if n.startswith("lora")]


def test_build_model_checks_the_runs_model(tmp_path):
    """build_model (the trainer's and the estimate's construction) refuses a target the run's model lacks with the
    same line, before any parameter exists."""
    from titanlike.train.construct import BuildSections, build_model

    cfg = _cfg(tmp_path)
    cfg.lora.target_modules = ["wqq"]
    dims = type("Dims", (), {"fsdp_enabled": False, "cp_enabled": False, "get_mesh": lambda self, n: None})()
    with pytest.raises(ConfigError, match=r"^lora.target_modules entry 'wqq' matches no Linear layer"):
        build_model(BuildSections.of(cfg), dims, torch.device("cpu"), 128, 0, compile_loss_chunk=False)


def _train(cfg):
    from titanlike.train.trainer import Trainer

    trainer = Trainer(cfg)
    try:
        history = trainer.train()
        sd = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
        n_opt = sum(len(g["params"]) for g in trainer.optimizer.param_groups)
    finally:
        trainer.close()
    return [h["loss"] for h in history], sd, n_opt


def test_lora_run_resumes_exactly_from_adapter_only_checkpoints(tmp_path):
    """A base trained 2 steps (full fine-tuning) -> a LoRA run from it (dropout 0.1: the RNG state matters) saving
    adapter-only steps 3 and 6; the same run resumed from step 3 (base from initial_load_path, adapters, optimizer,
    data and RNG from step 3) repeats steps 4-6 bit for bit. The steps hold the 28 adapters and their AdamW state
    only; the base stays the loaded one."""
    from titanlike.checkpoint.states import read_meta_json, read_metadata, tensor_shapes

    pre = _cfg(tmp_path, "base", training={"steps": 2}, checkpoint={"enable": True, "interval": 2})
    pre.lora.enable = False
    _, base_sd, n_full = _train(pre)
    base = str(tmp_path / "base" / "checkpoint")
    ck = {"enable": True, "interval": 3, "initial_load_path": base}
    cfg = _cfg(tmp_path, "lora", lora={"dropout": 0.1}, checkpoint=ck)
    full, sd_full, n_opt = _train(cfg)
    assert (n_opt, n_full) == (28, 21)  # AdamW holds the 28 adapters; full fine-tuning its 21 parameters
    assert all(sd_full[k].abs().max() > 1e-3 for k in sd_full if ".lora_B." in k)  # the adapters trained
    for k, v in base_sd.items():  # the frozen base is the loaded one
        assert torch.equal(sd_full[k], v), k
    step3 = tmp_path / "lora" / "checkpoint" / "step-3"
    md = read_metadata(str(step3))
    assert sorted(tensor_shapes(md, "model")) == sorted(k for k in sd_full if ".lora_" in k)
    assert not any(".lora_" not in k for k in tensor_shapes(md, "optimizer.state"))
    lora_meta = read_meta_json(str(step3))["lora"]
    assert lora_meta["adapter_only"] and lora_meta["base"] == base and len(lora_meta["modules"]) == 14

    cfg.checkpoint.load_step = 3
    resumed, sd_resumed, _ = _train(cfg)
    assert resumed == full[3:]
    for k in sd_full:
        assert torch.equal(sd_full[k], sd_resumed[k]), k


def test_memory_estimate_counts_gradients_and_optimizer_state_of_the_adapters_only(tmp_path):
    """The traced step of a LoRA debug run: gradients are the adapters' bytes exactly, optimizer state two moments of
    them (+ a step counter each): against full fine-tuning, both shrink by trainable / total parameters."""
    from titanlike.planner import estimate_memory

    lora = _tiny()
    trainable = sum(p.numel() for p in lora.parameters() if p.requires_grad)
    total = sum(p.numel() for p in lora.parameters() if not p.requires_grad)  # the base's parameters
    n_adapters = sum(1 for p in lora.parameters() if p.requires_grad)
    cfg = _cfg(tmp_path)
    (r,) = estimate_memory(cfg, 1, device_kind="cpu").ranks
    cfg.lora.enable = False
    (f,) = estimate_memory(cfg, 1, device_kind="cpu").ranks
    assert r.gradients == 4 * trainable and f.gradients == 4 * total
    assert r.parameters == 4 * (total + trainable) and f.parameters == 4 * total
    assert 0 <= r.optimizer_states - 2 * r.gradients <= 8 * n_adapters
    assert 0 <= f.optimizer_states - 2 * f.gradients <= 8 * len(list(lora.parameters()))
    assert r.gradients / f.gradients == pytest.approx(trainable / total, rel=1e-9)
    ratio = r.optimizer_states / f.optimizer_states
    assert ratio == pytest.approx(trainable / total, rel=0.02), (ratio, trainable / total)


def test_master_weights_keep_the_frozen_base_in_the_compute_dtype():
    """One device with bf16 weights and fp32 masters (titanlike/optim/master_weights.py): the frozen base becomes
    bf16 like the adapters (its matmuls meet bf16 activations) and has no master or optimizer state; a step moves
    the adapters only."""
    from titanlike.config.sections import Optimizer
    from titanlike.optim.master_weights import build_master_weight_adamw

    model = _tiny()
    base = {n: p.detach().to(torch.bfloat16).clone() for n, p in model.named_parameters() if not p.requires_grad}
    opt = build_master_weight_adamw(model, Optimizer(lr=1e-2), compile=False, accumulate_fp32=False)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert len(opt.low_bits) == 28 and all(p.requires_grad for p in opt.low_bits)
    model(TOKENS).float().logsumexp(-1).mean().backward()
    opt.clip_grad_norm_(1.0)
    opt.step()
    for n, p in model.named_parameters():
        if n in base:
            assert torch.equal(p, base[n]), n
    assert all(torch.count_nonzero(p) > 0 for n, p in model.named_parameters() if ".lora_B." in n)


def test_peft_names_for_every_family_with_an_hf_adapter():
    """The PEFT export's row/column probe through each family's to_hf (titanlike/checkpoint/lora_export.py): every
    Linear that may take an adapter in every debug flavor maps to one HF weight by whole rows and columns, except
    GPT's q/k/v (HF fuses them into c_attn) and the tied outputs (GPT's, BERT's MLM decoder, the original T5's head:
    not written), refused in one line each."""
    from titanlike.checkpoint.layout import CheckpointError
    from titanlike.checkpoint.lora_export import _gather
    from models.common.lora import candidates

    refused, transposed = {}, set()
    for name, spec in models.MODELS.items():
        for flavor in (f for f in spec.flavors if f.startswith("debug") and spec.hf is not None
                       and getattr(spec.hf, "supports", lambda args: True)(spec.flavors[f])):
            args = spec.flavors[flavor]
            with torch.device("meta"):
                model = spec.model_cls(args)
            for fqn, lin in candidates(model, include_experts=True)[0].items():
                if not fqn.startswith(("layers.1.", "output")):
                    continue
                try:
                    key, rows, cols, t = _gather(fqn, (lin.out_features, lin.in_features),
                                                 lambda sd: spec.hf.to_hf(sd, args))
                except CheckpointError as e:
                    assert "\n" not in str(e) and "PEFT cannot hold this adapter" in str(e)
                    refused[(name, flavor, fqn)] = str(e)
                    continue
                assert key.endswith(".weight") and sorted(rows.tolist()) == list(range(lin.out_features))
                assert sorted(cols.tolist()) == list(range(lin.in_features))
                if t:
                    transposed.add(name)
    assert sorted(k[2] for k in refused if k[:2] == ("gpt", "debugmodel")) == [
        "layers.1.attention.wk", "layers.1.attention.wq", "layers.1.attention.wv", "output"]
    # The tied outputs (BERT's MLM decoder, the original T5's head) are the embedding in HF: no weight of their own
    assert {k for k in refused if k[0] != "gpt"} == {("bert", f, "output") for f in (
        "debugmodel", "debugmodel_preln", "debugmodel_roberta")} | {("t5", "debugmodel_original", "output")}
    assert transposed == {"gpt"}  # HF GPT-2's Conv1D: fan_in_fan_out
