"""The training loop end to end, single process: the debug run learns, and accumulation is exact."""
import pytest
import torch

from titanlike.config.load import config_from_dict, load_config
from titanlike.train.trainer import Trainer


def _cfg(tmp_path, **sections):
    base = {
        "job": {"dump_folder": str(tmp_path)},
        "model": {"flavor": "debugmodel", "vocab_size": 256},
        "training": {"steps": 3, "seq_len": 32, "local_batch_size": 4, "device": "cpu", "max_norm": 1.0},
        "data": {"dataset": "mock"},
        "lr_scheduler": {"warmup_steps": 1},
        "metrics": {"log_freq": 1, "enable_tensorboard": False},
    }
    for name, values in sections.items():
        base.setdefault(name, {}).update(values)
    return config_from_dict(base)


def _train(cfg):
    trainer = Trainer(cfg)
    try:
        history = trainer.train()
        params = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    finally:
        trainer.close()
    return history, params


def test_accumulation_equals_large_batch(tmp_path):
    """4 micro-batches of 1 == one batch of 4: the loss is normalised by the step's total token count."""
    big, p_big = _train(_cfg(tmp_path, training={"local_batch_size": 4}))
    acc, p_acc = _train(_cfg(tmp_path, training={"local_batch_size": 1, "global_batch_size": 4}))
    for a, b in zip(big, acc):
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-5)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
    for k in p_big:
        torch.testing.assert_close(p_big[k], p_acc[k], atol=1e-5, rtol=1e-4)


def test_debug_run_learns(tmp_path):
    """The README's first command, shortened: the embedded default's loss falls clearly within 50 steps."""
    cfg = load_config(["--config", "configs/debug_model.toml", f"--job.dump_folder={tmp_path}",
                       "--training.steps=50", "--metrics.log_freq=10", "--training.device=cpu",
                       "--validation.enable", "--validation.interval=50", "--validation.steps=2"])
    trainer = Trainer(cfg)
    try:
        history = trainer.train()
        assert (tmp_path / "debug_model" / "tb").is_dir()  # TensorBoard event files land in the run folder
    finally:
        trainer.close()
    first, last = history[0], history[-1]
    assert first["step"] == 1 and last["step"] == 50
    assert last["loss"] < first["loss"] - 1.5, (first["loss"], last["loss"])
    assert all(h["lr"] > 0 and h["grad_norm"] > 0 for h in history)
    assert "throughput/tokens_per_sec_per_device" in last


def test_attention_backend_choice():
    """auto puts cuDNN first only on a Hopper+ GPU; named backends pin one kernel; sdpa leaves torch's order."""
    from torch.nn.attention import SDPBackend

    from models.common.backends import sdpa_backends

    cpu = torch.device("cpu")
    assert sdpa_backends("auto", cpu) == (None, False)
    assert sdpa_backends("sdpa", cpu) == (None, False)
    assert sdpa_backends("cudnn", cpu) == ([SDPBackend.CUDNN_ATTENTION], False)
    if torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9:
        backends, priority = sdpa_backends("auto", torch.device("cuda"))
        assert backends[:2] == [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION] and priority


def test_fa4_choice_off_cuda():
    """FlashAttention-4 is taken only on a CUDA device: "auto" quietly keeps SDPA elsewhere, "fa4" says why not."""
    from models.common.backends import wants_fa4

    cpu = torch.device("cpu")
    assert not any(wants_fa4(name, cpu) for name in ("auto", "sdpa", "cudnn", "flash", "math"))
    with pytest.raises(ValueError, match="model.attn_backend='fa4'.*CUDA"):
        wants_fa4("fa4", cpu)


def test_fa4_takes_each_attention_kind_by_its_own_kernel():
    """use_fa4 points causal modules (`attention_fn`) at the causal kernel and, for model.attn_backend = "fa4" only,
    the encoders' (`bidirectional_fn`) at the bidirectional one; off CUDA (and with a padding mask) SDPA's numbers."""
    import models
    from models.common.encoder import bidirectional_attention
    from models.common.fa4 import fa4_bidirectional_attention, fa4_causal_attention, use_fa4

    for name, flavor, attr, fn in (("bert", "debugmodel", "bidirectional_fn", fa4_bidirectional_attention),
                                   ("vit", "debugmodel", "bidirectional_fn", fa4_bidirectional_attention),
                                   ("llama3", "debugmodel", "attention_fn", fa4_causal_attention)):
        spec = models.get_spec(name)
        with torch.device("meta"):
            model = spec.model_cls(spec.flavors[flavor])
        assert use_fa4(model, encoders=False) == (len(model.layers) if name == "llama3" else 0)  # "auto"
        assert use_fa4(model) == len(model.layers)  # "fa4"
        assert all(getattr(layer.attention, attr) is fn for layer in model.layers.values()), name
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 5, 3, 8, generator=g) for _ in range(3))
    mask = torch.rand(2, 1, 1, 5, generator=g) > 0.3
    mask[..., 0] = True
    for m in (None, mask):  # fp32 on CPU: not FA4's, so SDPA's result
        torch.testing.assert_close(fa4_bidirectional_attention(q, k, v, m), bidirectional_attention(q, k, v, m))


def test_kv_heads_repeated_only_for_kernels_without_gqa():
    """The memory-efficient kernel takes no grouped KV heads: the model repeats them for it, and only for it."""
    from models.common.backends import repeats_kv_heads

    cpu = torch.device("cpu")
    assert repeats_kv_heads("efficient", cpu)
    assert not any(repeats_kv_heads(name, cpu) for name in ("auto", "sdpa", "flash", "cudnn", "math"))


def test_n_layers_override(tmp_path):
    """model.n_layers trains the flavor's block shape with another depth; 0 is refused naming the key."""
    trainer = Trainer(_cfg(tmp_path, model={"n_layers": 2}, training={"steps": 1}))
    try:
        assert list(trainer.model.layers.keys()) == ["0", "1"] and trainer.model_args.n_layers == 2
    finally:
        trainer.close()
    from titanlike.config.load import ConfigError
    from titanlike.config.validate import validate

    with pytest.raises(ConfigError, match="model.n_layers"):
        validate(_cfg(tmp_path, model={"n_layers": 0}))
