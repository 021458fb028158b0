"""The MoE families end to end through the checkpoint tools: a seed checkpoint written by scripts/train.py, exported
by scripts/convert_hf.py's export_hf, loaded by transformers' AutoModelForCausalLM, gives the logits of titanlike's
model loaded from the same checkpoint (fp32, CPU); the run's builtin tokenizer goes along with its ids."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from tests.launch import REPO_ROOT
from titanlike.checkpoint import load_model_weights, model_from_meta
from titanlike.checkpoint.hf import export_hf

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
