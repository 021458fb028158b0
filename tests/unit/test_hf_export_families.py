"""The MoE families end to end through the checkpoint tools: a seed checkpoint written by scripts/train.py, exported
by scripts/convert_hf.py's export_hf, loaded by transformers' AutoModelForCausalLM, gives the logits of titanlike's
model loaded from the same checkpoint (fp32, CPU); the run's builtin tokenizer goes along with its ids. And the
context an export states: the model's, not the sequence length it was trained at."""
from __future__ import annotations

import dataclasses
import json
import logging
import subprocess
import sys

import pytest
import torch

import models
from tests.launch import REPO_ROOT
from titanlike.checkpoint import load_model_weights, model_from_meta
from titanlike.checkpoint.hf import export_hf, write_model_step
from titanlike.infer.load import build_model

transformers = pytest.importorskip("transformers")


@pytest.mark.slow
@pytest.mark.parametrize("config", ["configs/qwen3_debug_moe.toml", "configs/deepseek_v3_debug.toml"])
def test_seed_checkpoint_exports_to_transformers(tmp_path, config):
    seed = subprocess.run([sys.executable, str(REPO_ROOT / "scripts/train.py"), "--config", config,
                           "--training.device=cpu", f"--job.dump_folder={tmp_path}", "--job.run_name=seed",
                           "--checkpoint.create_seed_checkpoint"], cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=300)
    assert seed.returncode == 0, seed.stdout[-3000:] + seed.stderr[-3000:]
    ckpt = tmp_path / "seed" / "checkpoint"
    out = export_hf(str(ckpt), str(tmp_path / "hf"), dtype="float32", progress=False)

    ours, _ = model_from_meta(str(ckpt / "step-0"))
    ours.to_empty(device="cpu")
    ours.init_weights()  # buffers (RoPE); every parameter is then overwritten by the checkpoint
    load_model_weights(str(ckpt), ours)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out, torch_dtype=torch.float32).eval()
    tokens = torch.randint(0, ours.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got, want = ours.eval()(tokens), theirs(tokens).logits
    assert (got - want).abs().max().item() <= 1e-4, (got - want).abs().max().item()
    tok = transformers.AutoTokenizer.from_pretrained(out)  # the builtin BPE, named by the seed run's config.toml
    assert theirs.config.eos_token_id == theirs.generation_config.eos_token_id == tok.eos_token_id is not None
    assert tok.decode(tok.encode("def f(x):\n    return x")) == "def f(x):\n    return x"


def _trained_at_128(tmp_path, name: str, config_toml: str | None) -> str:
    """A step of `name`'s debugmodel as a run with training.seq_len=128 saves it (args.max_seq_len = 128)."""
    spec = models.get_spec(name)
    args = dataclasses.replace(spec.flavors["debugmodel"], max_seq_len=128, vocab_size=256)
    model = build_model(spec, args, torch.device("cpu"), torch.float32)
    folder = str(tmp_path / name)
    write_model_step(folder, name, args, model.state_dict(), {}, "test", "test", "test",
                     extra=(lambda tmp: open(f"{tmp}/config.toml", "w").write(config_toml)) if config_toml else None)
    return folder


def test_export_states_the_models_context_and_transformers_accepts_yarn(tmp_path, caplog):
    """max_position_embeddings is the flavor's max_seq_len (config.toml's model.flavor, or the flavor of the same
    shapes), not training.seq_len; YaRN's is original_max_position_embeddings x factor, which transformers checks
    (it warned "explicit factor 4.0 != implicit 0.5" when 128 was written); a learned table keeps its rows."""
    cases = {"llama3": '[model]\nflavor = "debugmodel"\n', "deepseek_v3": None, "gpt": None}
    cfg = {}
    for name, toml in cases.items():
        out = export_hf(_trained_at_128(tmp_path, name, toml), str(tmp_path / f"{name}_hf"), dtype="float32",
                        progress=False, with_tokenizer=False)
        cfg[name] = json.loads(open(f"{out}/config.json").read())
    assert cfg["llama3"]["max_position_embeddings"] == models.get_spec("llama3").flavors["debugmodel"].max_seq_len
    ds = models.get_spec("deepseek_v3").flavors["debugmodel"]
    assert cfg["deepseek_v3"]["max_position_embeddings"] == ds.rope_original_max_position * ds.rope_factor == 1024
    assert cfg["gpt"]["n_positions"] == 128  # the learned position table the run trained has 128 rows
    transformers.utils.logging.enable_propagation()
    try:
        with caplog.at_level(logging.WARNING):
            loaded = transformers.AutoConfig.from_pretrained(tmp_path / "deepseek_v3_hf")
    finally:
        transformers.utils.logging.disable_propagation()
    assert loaded.max_position_embeddings == 1024 and "implicit factor" not in caplog.text, caplog.text
