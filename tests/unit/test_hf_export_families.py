"""What an export (titanlike/checkpoint/hf.py, scripts/convert_hf.py) states besides the weights: the run's builtin
tokenizer (named by the step's config.toml) goes along with its ids, and the context is the model's, not the sequence
length it was trained at. (Every family's export loaded by transformers with titanlike's logits, and imported back:
tests/unit/test_model_contract.py.)"""
from __future__ import annotations

import dataclasses
import json
import logging

import pytest
import torch

import models
from titanlike.checkpoint.hf import export_hf, write_model_step
from titanlike.infer.load import build_model

transformers = pytest.importorskip("transformers")


def _trained_at_128(tmp_path, name: str, config_toml: str | None, vocab: int = 256) -> str:
    """A step of `name`'s debugmodel as a run with training.seq_len=128 saves it (args.max_seq_len = 128)."""
    spec = models.get_spec(name)
    args = dataclasses.replace(spec.flavors["debugmodel"], max_seq_len=128, vocab_size=vocab)
    model = build_model(spec, args, torch.device("cpu"), torch.float32)
    folder = str(tmp_path / name)
    write_model_step(folder, name, args, model.state_dict(), {}, "test", "test", "test",
                     extra=(lambda tmp: open(f"{tmp}/config.toml", "w").write(config_toml)) if config_toml else None)
    return folder


def test_export_carries_the_runs_builtin_tokenizer(tmp_path):
    """A step whose config.toml names no tokenizer (the builtin BPE, data's default): the export writes it as files
    AutoTokenizer loads, encoding and decoding as the run did, and config.json / generation_config.json carry its
    eos id."""
    from titanlike.config.sections import Data
    from titanlike.data.tokenizers import build_tokenizer

    builtin = build_tokenizer(Data())
    step = _trained_at_128(tmp_path, "llama3", '[model]\nflavor = "debugmodel"\n', vocab=builtin.vocab_size)
    out = export_hf(step, str(tmp_path / "hf"), dtype="float32", progress=False)
    tok = transformers.AutoTokenizer.from_pretrained(out)
    config = json.loads(open(f"{out}/config.json").read())
    generation = json.loads(open(f"{out}/generation_config.json").read())
    assert config["eos_token_id"] == generation["eos_token_id"] == tok.eos_token_id is not None
    text = "def f(x):\n    return x"
    assert tok.decode(tok.encode(text)) == text
    assert tok.encode(text, add_special_tokens=False) == builtin.encode(text)


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
