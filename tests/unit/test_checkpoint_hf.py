"""scripts/convert_hf.py: a tiny random transformers Llama -> import -> titanlike logits == HF logits -> export ->
from_pretrained -> same logits again; and the bad-input errors (missing shard, unsupported architecture, existing
output)."""
from __future__ import annotations

import importlib.util
import json
import shutil

import pytest
import torch

from tests.launch import REPO_ROOT

transformers = pytest.importorskip("transformers")
torch.set_num_threads(1)


def _script(name: str):
    spec = importlib.util.spec_from_file_location(f"_{name}", REPO_ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


convert = _script("convert_hf").main
TOKENS = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """A random Llama 3.1-style model (GQA, llama3 RoPE scaling, odd FFN width) saved as sharded safetensors."""
    kw = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
              intermediate_size=172, max_position_embeddings=64, rms_norm_eps=1e-5, tie_word_embeddings=False)
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16}
    try:  # transformers >= 5 folds rope_theta into rope_parameters
        config = transformers.LlamaConfig(**kw, rope_parameters={**rope, "rope_theta": 10000.0})
    except TypeError:
        config = transformers.LlamaConfig(**kw, rope_theta=10000.0, rope_scaling=rope)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).float().eval()
    with torch.no_grad():  # larger-than-default weights (norms too) so that a mapping or RoPE bug shows
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn_like(p) if "norm" in name else 0.15 * torch.randn_like(p))
        ref = model(TOKENS).logits
    path = tmp_path_factory.mktemp("hf") / "tiny-llama"
    model.save_pretrained(path, safe_serialization=True, max_shard_size="100KB")
    (path / "tokenizer_config.json").write_text("{}")
    assert (path / "model.safetensors.index.json").exists()  # several shards: the index path is exercised
    assert ref.abs().max() > 1.0
    return path, ref


def _titanlike_logits(ckpt) -> torch.Tensor:
    from titanlike.checkpoint import load_model_weights, model_from_meta, step_path

    model, _ = model_from_meta(step_path(str(ckpt), 0))
    model.to_empty(device="cpu")
    model.init_weights()
    assert load_model_weights(str(ckpt), model) == 0
    with torch.no_grad():
        return model.eval()(TOKENS)


def test_import_export_roundtrip_logits(hf, tmp_path, capsys):
    path, ref = hf
    ckpt, exported = tmp_path / "imported", tmp_path / "exported"
    assert convert(["import", str(path), str(ckpt), "--no-progress"]) == 0
    assert "--checkpoint.initial_load_path=" in capsys.readouterr().out
    assert (ckpt / "step-0" / "COMMITTED").is_file() and (ckpt / "tokenizer" / "tokenizer_config.json").is_file()
    torch.testing.assert_close(_titanlike_logits(ckpt), ref, atol=1e-5, rtol=1e-5)

    assert convert(["export", str(ckpt), str(exported), "--dtype", "float32", "--max-shard-gb", "0.0001",
                    "--tokenizer", str(ckpt / "tokenizer"), "--no-progress"]) == 0
    assert (exported / "model.safetensors.index.json").is_file() and (exported / "tokenizer_config.json").is_file()
    back = transformers.LlamaForCausalLM.from_pretrained(exported).float().eval()
    with torch.no_grad():
        torch.testing.assert_close(back(TOKENS).logits, ref, atol=1e-5, rtol=1e-5)
    # bfloat16 export (the release default): loads, and is close
    assert convert(["export", str(ckpt), str(tmp_path / "bf16"), "--no-progress"]) == 0
    cfg = json.loads((tmp_path / "bf16" / "config.json").read_text())
    assert cfg["torch_dtype"] == "bfloat16" and cfg["rope_scaling"]["rope_type"] == "llama3"


def test_import_bad_input(hf, tmp_path, capsys):
    path, _ = hf
    broken = tmp_path / "broken"
    shutil.copytree(path, broken)
    index = json.loads((broken / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[-1]
    (broken / shard).unlink()
    assert convert(["import", str(broken), str(tmp_path / "o1"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert f"shard {broken / shard} is missing" in err and "Traceback" not in err

    mistral = tmp_path / "mistral"
    shutil.copytree(path, mistral)
    cfg = json.loads((mistral / "config.json").read_text())
    cfg["architectures"], cfg["model_type"] = ["MistralForCausalLM"], "mistral"
    (mistral / "config.json").write_text(json.dumps(cfg))
    assert convert(["import", str(mistral), str(tmp_path / "o2"), "--no-progress"]) == 2
    assert "unsupported architecture ['MistralForCausalLM']" in capsys.readouterr().err

    out = tmp_path / "o3"
    assert convert(["import", str(path), str(out), "--no-progress"]) == 0
    before = sorted(p.name for p in (out / "step-0").iterdir())
    assert convert(["import", str(path), str(out), "--no-progress"]) == 2  # nothing is overwritten
    assert "already exists" in capsys.readouterr().err
    assert sorted(p.name for p in (out / "step-0").iterdir()) == before
    assert convert(["export", str(out), str(out), "--no-progress"]) == 2  # non-empty output folder
    assert "not empty" in capsys.readouterr().err
