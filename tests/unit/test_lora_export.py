"""A LoRA run out of titanlike (titanlike/checkpoint/lora_export.py, scripts/convert_hf.py): an HF Llama imported,
fine-tuned with LoRA (adapter-only checkpoints), then (1) `export-peft`: transformers + peft.PeftModel.from_pretrained
on the original HF model computes titanlike's logits (fp32, 1e-4), with PEFT's own names and config; (2) `export`:
the merged HF model computes them too; and the bad-input lines."""
from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from tests.launch import REPO_ROOT

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
torch.set_num_threads(1)
TOKENS = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))


def _convert():
    spec = importlib.util.spec_from_file_location("_convert_hf", REPO_ROOT / "scripts" / "convert_hf.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


def _lora_run(root, name: str, args: dict, base: str | None):
    """4 LoRA steps on q/k/v/o/gate/up/down of every layer but wq in layer 0 only (adapter-only checkpoint at step 4),
    from the titanlike checkpoint `base` (None: the seeded init); returns its logits on TOKENS."""
    from titanlike.config.load import config_from_dict
    from titanlike.config.validate import validate
    from titanlike.train.trainer import Trainer

    cfg = config_from_dict({
        "job": {"dump_folder": str(root), "run_name": name},
        "model": {"flavor": "debugmodel", "vocab_size": 256, "args": args},
        "training": {"steps": 4, "seq_len": 32, "local_batch_size": 2, "device": "cpu"},
        "optimizer": {"lr": 2e-2}, "lr_scheduler": {"warmup_steps": 1}, "data": {"dataset": "mock"},
        "metrics": {"log_freq": 1, "enable_tensorboard": False},
        "checkpoint": {"enable": True, "interval": 4, **({"initial_load_path": base} if base else {})},
        "lora": {"enable": True, "rank": 4, "alpha": 8.0,
                 "target_modules": ["layers.0.attention.wq", "wk", "wv", "wo", "w1", "w2", "w3"]},
    })
    validate(cfg, 1)
    trainer = Trainer(cfg)
    try:
        trainer.train()
        trainer.model.eval()
        with torch.no_grad():
            return trainer.model(TOKENS).float()
    finally:
        trainer.close()


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """(root, model args, titanlike logits of the trained LoRA model on TOKENS): a random HF Llama (GQA; the adapter
    permutes wq/wk's RoPE rows) imported to root/base, then the LoRA run root/lora from it."""
    from titanlike.checkpoint.hf import import_hf

    root = tmp_path_factory.mktemp("lora_export")
    config = transformers.LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      vocab_size=256, intermediate_size=96, max_position_embeddings=64,
                                      tie_word_embeddings=False)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(root / "hf")
    a = import_hf(str(root / "hf"), str(root / "base"), progress=False)["model_args"]
    args = {k: getattr(a, k) for k in ("dim", "n_layers", "n_heads", "n_kv_heads", "multiple_of", "ffn_dim_multiplier",
                                       "rope_theta", "norm_eps")}
    return root, args, _lora_run(root, "lora", args, str(root / "base"))


def test_peft_adapter_loads_in_transformers_with_titanlikes_logits(run):
    root, _, logits = run
    assert _convert()(["export-peft", str(root / "lora"), str(root / "peft"), "--base-model", str(root / "hf")]) == 0
    config = json.loads((root / "peft" / "adapter_config.json").read_text())
    assert {k: config[k] for k in ("peft_type", "task_type", "r", "lora_alpha", "lora_dropout")} == {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": 4, "lora_alpha": 8.0, "lora_dropout": 0.0}
    # wq took an adapter in layer 0 only: full names there; k/v/o/gate/up/down everywhere would be short names, but
    # one list holds both kinds only as full names
    assert "model.layers.0.self_attn.q_proj" in config["target_modules"]
    assert "model.layers.1.self_attn.q_proj" not in config["target_modules"]
    assert config["base_model_name_or_path"] == str(root / "hf")
    from safetensors.torch import load_file

    keys = set(load_file(root / "peft" / "adapter_model.safetensors"))
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in keys and len(keys) == 26
    base = transformers.AutoModelForCausalLM.from_pretrained(root / "hf", torch_dtype=torch.float32)
    model = peft.PeftModel.from_pretrained(base, root / "peft").eval()
    b = model.base_model.model.model.layers[0].self_attn.q_proj.lora_B["default"].weight
    assert b.abs().max() > 1e-3  # the adapters trained: the comparison below is not base against base
    with torch.no_grad():
        theirs = model(TOKENS).logits.float()
    assert (theirs - logits).abs().max().item() <= 1e-4
    plain = transformers.AutoModelForCausalLM.from_pretrained(root / "hf", torch_dtype=torch.float32).eval()
    with torch.no_grad():
        assert (plain(TOKENS).logits - logits).abs().max().item() > 1e-3  # (the adapters change the output)


def test_merged_export_computes_the_lora_model(run):
    root, _, logits = run
    assert _convert()(["export", str(root / "lora"), str(root / "merged"), "--dtype", "float32", "--no-tokenizer",
                       "--no-progress"]) == 0
    merged = transformers.AutoModelForCausalLM.from_pretrained(root / "merged", torch_dtype=torch.float32).eval()
    with torch.no_grad():
        assert (merged(TOKENS).logits.float() - logits).abs().max().item() <= 1e-4


def test_generation_loader_merges_a_lora_step(run):
    """titanlike.infer.load_for_inference (scripts/generate.py, evaluate.py) on the LoRA run: the adapters merged into
    the base from initial_load_path, titanlike's logits (fp32, 1e-5)."""
    from titanlike.infer import load_for_inference

    root, _, logits = run
    loaded = load_for_inference(str(root / "lora"))
    with torch.no_grad():
        assert (loaded.model(TOKENS).float() - logits).abs().max().item() <= 1e-5
    assert loaded.step == 4


def test_export_errors_name_the_fix(run, tmp_path, capsys):
    """A step that is not a LoRA run's refuses export-peft; a LoRA run without checkpoint.initial_load_path (its base
    the seeded init) exports merged only with --base."""
    root, args, _ = run
    convert = _convert()
    assert convert(["export-peft", str(root / "base"), str(tmp_path / "p")]) == 2
    assert "is not a LoRA run's step (its meta.json has no \"lora\" entry)" in capsys.readouterr().err
    _lora_run(tmp_path, "seeded", args, None)
    assert convert(["export", str(tmp_path / "seeded"), str(tmp_path / "m"), "--no-tokenizer", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith("holds LoRA adapters only and its run had no checkpoint.initial_load_path to take the base "
                        "from: give the base checkpoint (--base PATH)") and "\n" not in err, err
    assert convert(["export", str(tmp_path / "seeded"), str(tmp_path / "m2"), "--no-tokenizer", "--no-progress",
                    "--base", str(root / "base")]) == 0


def test_peft_export_of_a_transposed_hf_layout(tmp_path):
    """GPT (HF GPT2LMHeadModel: Conv1D weights stored [in, out]): a seed checkpoint exported as the HF base, a LoRA
    run from it on the projections HF keeps apart (attention output, both MLP layers); the PEFT adapter says
    fan_in_fan_out and `PeftModel.from_pretrained` gives titanlike's logits (fp32, 1e-4)."""
    from titanlike.checkpoint.hf import export_hf
    from titanlike.config.load import config_from_dict
    from titanlike.train.trainer import Trainer

    def cfg(name, **extra):
        return config_from_dict({
            "job": {"dump_folder": str(tmp_path), "run_name": name},
            "model": {"name": "gpt", "flavor": "debugmodel", "vocab_size": 256},
            "training": {"steps": 3, "seq_len": 32, "local_batch_size": 2, "device": "cpu"},
            "optimizer": {"lr": 2e-2}, "lr_scheduler": {"warmup_steps": 1}, "data": {"dataset": "mock"},
            "metrics": {"log_freq": 1, "enable_tensorboard": False}, **extra})

    seed = Trainer(cfg("seed", checkpoint={"create_seed_checkpoint": True}))
    try:
        seed.checkpointer.save_seed()
    finally:
        seed.close()
    base = str(tmp_path / "seed" / "checkpoint")
    export_hf(base, str(tmp_path / "hf"), dtype="float32", progress=False, with_tokenizer=False)
    trainer = Trainer(cfg("lora", checkpoint={"enable": True, "interval": 3, "initial_load_path": base},
                          lora={"enable": True, "rank": 4, "alpha": 8.0, "target_modules": ["wo", "w1", "w2"]}))
    try:
        trainer.train()
        trainer.model.eval()
        with torch.no_grad():
            logits = trainer.model(TOKENS).float()
    finally:
        trainer.close()
    assert _convert()(["export-peft", str(tmp_path / "lora"), str(tmp_path / "peft")]) == 0
    config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert config["fan_in_fan_out"] is True and config["target_modules"] == ["c_fc", "c_proj"]
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", torch_dtype=torch.float32)
    model = peft.PeftModel.from_pretrained(hf, tmp_path / "peft").eval()
    with torch.no_grad():
        diff = (model(TOKENS).logits.float() - logits).abs().max().item()
    assert diff <= 1e-4, diff
