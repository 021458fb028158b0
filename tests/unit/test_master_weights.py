"""bf16 weights + fp32 master weights (titanlike/optim/master_weights.py): the update equals torch's AdamW on fp32
weights fed the same gradients, skipped steps change nothing, accumulation sums in fp32, checkpoints hold the
fp32 masters and move to and from the fp32 layouts, and the trainer's runs learn and resume exactly."""
import math
import types

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)

import models
from titanlike.config.load import config_from_dict, load_config
from titanlike.config.sections import Optimizer
from titanlike.optim.master_weights import (
    MasterWeightAdamW, build_master_weight_adamw, join_master, mixed_precision_mode, split_master,
)
from titanlike.optim.adamw import build_optimizer, clip_grad_norm_
from titanlike.optim.master_muon import MasterWeightMuon
from titanlike.optim.muon import MuonWithAdamW
from titanlike.checkpoint.states import FLAT_OPTIM
from titanlike.train.trainer import Trainer

VOCAB = 64


def _model(seed=0):
    spec = models.get_spec("llama3")
    args = spec.flavors["debugmodel"].__class__(**{**vars(spec.flavors["debugmodel"]), "vocab_size": VOCAB,
                                                    "max_seq_len": 16, "n_layers": 2})
    with torch.device("meta"):
        m = spec.model_cls(args)
    m.to_empty(device="cpu")
    torch.manual_seed(seed)
    with torch.no_grad():
        m.init_weights(buffer_device=torch.device("cpu"))
    return m


def _backward(model, seed):
    torch.manual_seed(seed)
    x = torch.randint(0, VOCAB, (2, 16))
    logits = model(x)
    torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), x.flatten()).backward()


def _train(model, opt, steps: int) -> None:
    """`steps` clipped optimizer steps on _backward's batches."""
    for step in range(steps):
        _backward(model, step)
        opt.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()


def _pair(cfg=Optimizer(lr=1e-2, weight_decay=0.1)):
    ref = _model()
    ref_opt = build_optimizer(ref, cfg, torch.device("cpu"))  # foreach AdamW over fp32
    m = _model()
    opt = build_master_weight_adamw(m, cfg, compile=False, accumulate_fp32=False)
    return ref, ref_opt, m, opt


def test_update_matches_torch_adamw_on_fp32_weights():
    """Same gradients in (the bf16 model's, upcast for the reference), same clipping: the fp32 masters follow torch's
    AdamW to rounding, and the model's bf16 weights are exactly the masters rounded (ties away from zero)."""
    ref, ref_opt, m, opt = _pair()
    assert all(p.dtype == torch.bfloat16 for p in m.parameters())
    ref_params = dict(ref.named_parameters())
    for step in range(3):
        _backward(m, step)
        for n, p in m.named_parameters():
            ref_params[n].grad = p.grad.float()
        total = opt.clip_grad_norm_(0.5)  # small max_norm: every step clips
        ref_total = clip_grad_norm_(ref.parameters(), 0.5)
        torch.testing.assert_close(total, ref_total, rtol=1e-5, atol=0)
        ref_opt.step()
        opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    for n, p in m.named_parameters():
        w = opt.master(p)
        torch.testing.assert_close(w, ref_params[n].detach(), rtol=1e-5, atol=1e-6)
        assert torch.equal(p.detach(), split_master(w)[0]), n
    for p in m.parameters():  # AdamW's state keys, fp32 moments
        s, r = opt.state[p], ref_opt.state[dict(zip(m.parameters(), ref.parameters()))[p]]
        assert set(s) == set(r) and s["exp_avg"].dtype == torch.float32 and float(s["step"]) == 3


def test_master_split_is_exact():
    """The bf16 parameter and the int16 low bits hold the fp32 master bit for bit, over every binade and both signs;
    the bf16 half is the nearest bf16 (a tie goes away from zero, where bf16 rounding goes to even)."""
    torch.manual_seed(0)
    x = torch.randn(200_000) * torch.logspace(-38, 38, 200_000)
    x = x[x.isfinite()]
    x = torch.cat([x, -x, torch.tensor([0.0, -0.0, 1e-45, -1e-45, 3.4e38, -3.4e38, 1.0 + 2**-8, -(1.0 + 2**-8)])])
    hi, lo = split_master(x)
    assert hi.dtype == torch.bfloat16 and lo.dtype == torch.int16
    assert torch.equal(join_master(hi, lo).view(torch.int32), x.view(torch.int32))
    assert torch.equal((hi.float() - x).abs(), (x.to(torch.bfloat16).float() - x).abs())  # as near as bf16 rounding
    assert hi[-2].item() == 1.0 + 2**-7 and hi[-1].item() == -(1.0 + 2**-7)  # the ties: away from zero


def _muon_pair():
    from tests.unit.test_master_muon import _pair as muon_pair
    return muon_pair()


@pytest.mark.parametrize("pair", [_pair, _muon_pair], ids=["adamw", "muon"])
def test_found_inf_skips_and_grad_scale_divides(pair):
    """found_inf = 1: no weight, master or optimizer state moves; grad_scale = 2 gives the step of halved gradients.
    For master-weight AdamW and Muon (its matrices' momentum and Newton-Schulz, AdamW for the rest)."""
    _, _, m, opt = pair()
    _backward(m, 0)
    before = {p: (opt.master(p), p.detach().clone()) for p in m.parameters()}
    opt.found_inf = torch.ones(())
    opt.step()
    assert all(torch.equal(opt.master(p), w) and torch.equal(p.detach(), b) for p, (w, b) in before.items())
    for p in m.parameters():
        assert all(not v.any() for v in opt.state[p].values()), [k for k, v in opt.state[p].items() if v.any()]
    _, _, m2, opt2 = pair()
    _backward(m2, 0)
    for p in m2.parameters():
        p.grad = p.grad * 0.5
    opt.found_inf = torch.zeros(())
    opt.grad_scale = torch.full((), 2.0)
    opt.step()
    opt2.step()
    for p, p2 in zip(m.parameters(), m2.parameters()):
        torch.testing.assert_close(opt.master(p), opt2.master(p2), rtol=1e-6, atol=0)
        for key, value in opt.state[p].items():
            torch.testing.assert_close(value, opt2.state[p2][key], rtol=1e-6, atol=0)


def test_accumulation_sums_in_fp32():
    m = _model()
    opt = build_master_weight_adamw(m, Optimizer(), compile=False, accumulate_fp32=True)
    expect = {}
    for seed in (0, 1):
        _backward(m, seed)
        for p in m.parameters():
            assert p.grad is None  # moved into the fp32 buffer by the hook
    m2 = _model()
    build_master_weight_adamw(m2, Optimizer(), compile=False, accumulate_fp32=False)
    for seed in (0, 1):
        m2.zero_grad()
        _backward(m2, seed)
        for n, p in m2.named_parameters():
            expect[n] = expect.get(n, 0) + p.grad.float()
    for n, p in m.named_parameters():
        g = opt.grad(p)
        assert g.dtype == torch.float32
        torch.testing.assert_close(g, expect[n], rtol=1e-6, atol=1e-7)
    opt.step()
    opt.zero_grad()
    assert all(opt.grad(p) is None for p in m.parameters())


def test_checkpoint_holds_masters_and_moves_between_layouts(tmp_path):
    """DCP save from master weights; load into a fresh master-weight model and into an fp32 AdamW model."""
    _, _, m, opt = _pair()
    _train(m, opt, steps=2)
    sd = get_model_state_dict(m)
    assert all(v.dtype == torch.float32 for v in sd.values())
    assert all(torch.equal(sd[n], opt.master(p)) for n, p in m.named_parameters())
    dcp.save({"model": sd, "optimizer": get_optimizer_state_dict(m, opt, options=FLAT_OPTIM)},
             checkpoint_id=str(tmp_path), no_dist=True)

    for target_kind in ("master", "fp32"):
        t = _model(seed=1)
        t_opt = (build_master_weight_adamw(t, Optimizer(lr=1e-2, weight_decay=0.1), compile=False,
                                           accumulate_fp32=False) if target_kind == "master"
                 else build_optimizer(t, Optimizer(lr=1e-2, weight_decay=0.1), torch.device("cpu")))
        target = {"model": get_model_state_dict(t), "optimizer": get_optimizer_state_dict(t, t_opt, options=FLAT_OPTIM)}
        dcp.load(target, checkpoint_id=str(tmp_path), no_dist=True)
        set_model_state_dict(t, target["model"])
        set_optimizer_state_dict(t, t_opt, target["optimizer"], options=FLAT_OPTIM)
        for (n, p), q in zip(m.named_parameters(), t.parameters()):
            if target_kind == "master":
                assert torch.equal(t_opt.master(q), opt.master(p)) and torch.equal(q.detach(), p.detach()), n
                assert t_opt.state[q]["exp_avg"].dtype == torch.float32
            else:
                assert torch.equal(q.detach(), opt.master(p)), n
            assert torch.equal(t_opt.state[q]["exp_avg_sq"], opt.state[p]["exp_avg_sq"]), n


def test_stable_state_dict_tensors_for_the_pinned_stager():
    """With stable_state_dict (pinned async checkpoints) every state_dict call hands out the same fp32 tensors, holding
    the current masters; without it each call makes new ones."""
    for stable in (False, True):
        m = _model()
        opt = build_master_weight_adamw(m, Optimizer(lr=1e-2), compile=False, accumulate_fp32=False,
                                        stable_state_dict=stable)
        first = m.state_dict()
        _backward(m, 0)
        opt.step()
        second = m.state_dict()
        for n, p in m.named_parameters():
            assert (second[n] is first[n]) == stable, n
            assert torch.equal(second[n], opt.master(p)), n


def test_mode_choice_and_errors():
    def cfg(**training):
        return config_from_dict({"training": training, "compile": {"enable": True}})

    one = types.SimpleNamespace(world_size=1, fsdp_enabled=False)
    two = types.SimpleNamespace(world_size=2, fsdp_enabled=True)
    cuda, cpu = torch.device("cuda"), torch.device("cpu")

    def mode(c, dims, device):  # the sections it reads, from a whole config
        return mixed_precision_mode(c.training, c.compile, dims, device, fault_tolerant=c.fault_tolerance.enable)

    assert mode(cfg(), one, cuda) == "master_weights"
    assert mode(cfg(mixed_precision_impl="autocast"), one, cuda) == "autocast"
    assert mode(cfg(), one, cpu) == "none"
    assert mode(cfg(mixed_precision_impl="master_weights"), one, cpu) == "master_weights"
    assert mode(cfg(), two, cuda) == "fsdp"
    no_opt_compile = config_from_dict({"compile": {"enable": True, "components": ["model", "loss"]}})
    assert mode(no_opt_compile, one, cuda) == "autocast"
    with pytest.raises(ValueError, match="mixed_precision_impl='master_weights' is for runs on one device"):
        mode(cfg(mixed_precision_impl="master_weights"), two, cuda)
    with pytest.raises(ValueError, match="mixed_precision_param='float32'; set it to 'bfloat16'"):
        mode(cfg(mixed_precision_impl="master_weights", mixed_precision_param="float32"), one, cuda)


def _trainer_cfg(tmp_path, name, optimizer=None, **training):
    return config_from_dict({
        "job": {"dump_folder": str(tmp_path), "run_name": name},
        "model": {"flavor": "debugmodel"},
        "training": {"steps": 8, "seq_len": 32, "local_batch_size": 4, "device": "cpu", "max_norm": 1.0,
                     **training},
        "data": {"dataset": "stdlib"},  # real text (the builtin tokenizer): the loss falls within 8 steps
        "optimizer": optimizer or {"lr": 3e-3},
        "lr_scheduler": {"warmup_steps": 2},
        "metrics": {"log_freq": 1, "enable_tensorboard": False},
        "checkpoint": {"interval": 4},
    })


def _run(cfg):
    trainer = Trainer(cfg)
    try:
        history = trainer.train()
        sd = {k: v.detach().clone() for k, v in get_model_state_dict(trainer.model).items()}
        kind = type(trainer.optimizer)
    finally:
        trainer.close()
    return [h["loss"] for h in history], sd, kind


# (optimizer section, the master-weight optimizer, the fp32 run's optimizer, how far the loss falls in 8 steps). Muon's
# lr 4e-3: match_rms_adamw sizes its steps like a settled AdamW's, smaller than AdamW's first sign-like ones.
OPTIMIZERS = {"AdamW": ({"lr": 3e-3}, MasterWeightAdamW, torch.optim.AdamW, 0.5),
              "Muon": ({"name": "Muon", "lr": 4e-3}, MasterWeightMuon, MuonWithAdamW, 0.3)}


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_trainer_master_weights_tracks_fp32_and_resumes_exactly(tmp_path, name):
    """The debug model with bf16 weights (on CPU) follows the fp32 run's loss within 1%; resumed from its step-4
    checkpoint it ends with the uninterrupted run's weights, bit for bit; that checkpoint also resumes an fp32 run.
    For AdamW and for Muon (titanlike/optim/master_muon.py)."""
    opt, master_kind, fp32_kind, fall = OPTIMIZERS[name]
    fp32, _, kind32 = _run(_trainer_cfg(tmp_path, "fp32", opt))
    full, sd_full, kind = _run(_trainer_cfg(tmp_path, "mw", opt, mixed_precision_impl="master_weights"))
    assert kind is master_kind and issubclass(kind32, fp32_kind) and not issubclass(kind32, MasterWeightAdamW)
    assert full[-1] < full[0] - fall and all(math.isfinite(x) for x in full)
    assert max(abs(a - b) / b for a, b in zip(full, fp32)) < 0.01, (full, fp32)
    # the same run with checkpoints (every 4 steps), then again from step 4's: steps 5-8 repeat exactly
    ck = _trainer_cfg(tmp_path, "resume", opt, mixed_precision_impl="master_weights")
    ck.checkpoint.enable = True
    assert _run(ck)[0] == full
    ck.checkpoint.load_step = 4
    resumed, sd_resumed, _ = _run(ck)
    assert resumed == full[4:]
    for k in sd_full:
        assert torch.equal(sd_full[k], sd_resumed[k]), k
    # the master-weight checkpoint (fp32 masters, fp32 moments) also resumes an fp32 run (autocast's, FSDP's)
    cross = _trainer_cfg(tmp_path, "resume", opt)
    cross.checkpoint.enable, cross.checkpoint.load_step = True, 4
    cross_loss, _, _ = _run(cross)
    assert max(abs(a - b) / b for a, b in zip(cross_loss, full[4:])) < 0.01, (cross_loss, full[4:])


# One debug config per family: bf16 weights are the one-GPU default (configs/base_gpu.toml), so every family's inputs
# must meet bf16 parameters (ViT's fp32 pixels once met a bf16 conv only on the GPU).
FAMILY_DEBUG_CONFIGS = ["debug_model", "debug_model:mixtral", "gpt2_debug", "qwen3_debug_moe", "deepseek_v3_debug",
                        "bert_debug", "t5_debug",
                        "vit_debug", "llava_debug", "mamba2_debug", "nemotron_h_debug", "qwen3_next_debug"]


def test_family_debug_configs_cover_every_family():
    names = {load_config(_family_args(c)).model.name for c in FAMILY_DEBUG_CONFIGS}
    assert names == set(models.MODELS), sorted(set(models.MODELS) - names)


def _family_args(entry: str) -> list[str]:
    """"config" or "config:family" (the config's shapes under another family's debug flavor)."""
    config, _, family = entry.partition(":")
    return ["--config", f"configs/{config}.toml"] + ([f"--model.name={family}"] if family else [])


@pytest.mark.parametrize("config", FAMILY_DEBUG_CONFIGS)
def test_every_family_takes_a_master_weight_step(config, tmp_path):
    """One optimizer step of each family's debug config with bf16 weights and fp32 masters, on CPU: finite loss."""
    cfg = load_config([*_family_args(config), f"--job.dump_folder={tmp_path}", "--training.steps=1",
                       "--training.mixed_precision_impl=master_weights", "--training.mixed_precision_param=bfloat16",
                       "--compile.enable=false", "--checkpoint.enable=false", "--validation.enable=false",
                       "--metrics.enable_tensorboard=false"])
    losses, _, kind = _run(cfg)
    assert kind is MasterWeightAdamW and all(math.isfinite(x) for x in losses), losses


def test_update_buckets_are_blocks_of_every_stack():
    """One bucket (one compiled update, reused) per block, nested stacks included (a VLM's vision tower): a
    tower in one bucket compiled a graph over all its parameters for minutes on the GPU's first step."""
    from titanlike.optim.master_weights import _bucket_key

    assert _bucket_key("layers.3.attention.wq.weight") == "layers.3"
    assert _bucket_key("vision.layers.12.feed_forward.w1.bias") == "vision.layers.12"
    assert _bucket_key("encoder_layers.0.attention.wq.weight") == "encoder_layers.0"
    assert _bucket_key("vision.patch_embed.proj.weight") == "vision"
    assert _bucket_key("tok_embeddings.weight") == "tok_embeddings"
    spec = models.MODELS["llava"]
    with torch.device("meta"):
        model = spec.model_cls(spec.flavors["debug-siglip"])
    keys = {_bucket_key(n) for n, _ in model.named_parameters()}
    for name, module in model.named_modules():  # every key names a module (the overlap hooks its forward)
        keys.discard(name)
    assert not keys, keys
