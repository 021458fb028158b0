"""scripts/convert_hf.py: a tiny random transformers Llama -> import -> titanlike logits == HF logits -> export ->
from_pretrained -> same logits again; and the bad-input errors (missing shard, unsupported architecture, existing
output); the run's tokenizer travels with an export, in each format, so AutoTokenizer loads it and generate()
stops at its end of text."""
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
    word_level_tokenizer().save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    assert (path / "model.safetensors.index.json").exists()  # several shards: the index path is exercised
    assert ref.abs().max() > 1.0
    return path, ref


def word_level_tokenizer():
    """A whitespace word-level tokenizer.json of 200 tokens (fits the 256-token model): bos <s> = 1, eos </s> = 3,
    so an export that left transformers' default eos (2) in place would show."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["<unk>", "<s>", "<pad>", "</s>"] + [f"w{i}" for i in range(196)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(["<unk>", "<s>", "<pad>", "</s>"])
    return tok


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
    out = capsys.readouterr().out
    assert "--checkpoint.initial_load_path=" in out
    assert f"--data.tokenizer={ckpt / 'tokenizer' / 'tokenizer.json'}" in out  # printed, and it exists
    assert (ckpt / "step-0" / "COMMITTED").is_file() and (ckpt / "tokenizer" / "tokenizer.json").is_file()
    torch.testing.assert_close(_titanlike_logits(ckpt), ref, atol=1e-5, rtol=1e-5)

    # No --tokenizer: the one the import wrote beside the step goes along, with its ids.
    assert convert(["export", str(ckpt), str(exported), "--dtype", "float32", "--max-shard-gb", "0.0001",
                    "--no-progress"]) == 0
    assert (exported / "model.safetensors.index.json").is_file() and (exported / "tokenizer_config.json").is_file()
    cfg = json.loads((exported / "config.json").read_text())
    gen = json.loads((exported / "generation_config.json").read_text())
    assert (cfg["bos_token_id"], cfg["eos_token_id"]) == (gen["bos_token_id"], gen["eos_token_id"]) == (1, 3)
    tok = transformers.AutoTokenizer.from_pretrained(exported)
    assert (tok.bos_token_id, tok.eos_token_id) == (1, 3) and tok.encode("w5 w7", add_special_tokens=False) == [9, 11]
    back = transformers.LlamaForCausalLM.from_pretrained(exported).float().eval()
    assert back.generation_config.eos_token_id == 3
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

    bare = tmp_path / "bare"  # only a tokenizer_config.json: no --data.tokenizer path that was never written
    shutil.copytree(path, bare)
    (bare / "tokenizer.json").unlink()
    assert convert(["import", str(bare), str(tmp_path / "o4"), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "--data.tokenizer=" not in out and "has no tokenizer.json or tokenizer.model" in out
    assert not (tmp_path / "o4" / "tokenizer" / "tokenizer.json").exists()

    out = tmp_path / "o3"
    assert convert(["import", str(path), str(out), "--no-progress"]) == 0
    before = sorted(p.name for p in (out / "step-0").iterdir())
    assert convert(["import", str(path), str(out), "--no-progress"]) == 2  # nothing is overwritten
    assert "already exists" in capsys.readouterr().err
    assert sorted(p.name for p in (out / "step-0").iterdir()) == before
    assert convert(["export", str(out), str(out), "--no-progress"]) == 2  # non-empty output folder
    assert "not empty" in capsys.readouterr().err


def test_trained_run_exports_its_tokenizer_and_generate_stops(tmp_path, capsys):
    """A run with an HF tokenizer.json writes its end-of-training export (export-step-N, config.toml inside); the
    HF export of it carries the tokenizer without being told: AutoTokenizer loads it, config.json and
    generation_config.json hold its bos/eos, and generate() stops at eos (forced by an lm_head bias)."""
    from titanlike.config.load import config_from_dict
    from titanlike.data.tokenizers.hf import train_bytelevel_bpe
    from titanlike.train.trainer import Trainer

    corpus = ["the cat sat on the mat", "the theory of everything", "then they went there"] * 20
    tok_file = tmp_path / "tok" / "tokenizer.json"
    tok_file.parent.mkdir()
    # Specials first: bos 0, eos 1 (transformers' Llama default eos is 2, a byte here).
    train_bytelevel_bpe(corpus, 300, special_tokens=["<|begin_of_text|>", "<|end_of_text|>"]).save(str(tok_file))
    cfg = config_from_dict({
        "job": {"dump_folder": str(tmp_path), "run_name": "run"},
        "model": {"flavor": "debugmodel", "vocab_size": 320},
        "training": {"steps": 2, "seq_len": 32, "local_batch_size": 2, "device": "cpu"},
        "data": {"dataset": "mock", "tokenizer": str(tok_file)},
        "metrics": {"log_freq": 1, "enable_tensorboard": False},
        "checkpoint": {"enable": True, "last_save_model_only": True},
    })
    trainer = Trainer(cfg)
    try:
        trainer.train()
    finally:
        trainer.close()
    step = tmp_path / "run" / "checkpoint" / "export-step-2"
    out = tmp_path / "hf"
    assert convert(["export", str(step), str(out), "--dtype", "float32", "--no-progress"]) == 0
    config = json.loads((out / "config.json").read_text())
    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert (config["bos_token_id"], config["eos_token_id"]) == (tok.bos_token_id, tok.eos_token_id) == (0, 1)
    assert tok.eos_token == "<|end_of_text|>" and tok.decode(tok.encode("the cat")) == "the cat"
    model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert model.generation_config.eos_token_id == 1
    head = torch.nn.Linear(config["hidden_size"], config["vocab_size"], bias=True)
    with torch.no_grad():
        head.weight.zero_()
        head.bias.zero_()
        head.bias[1] = 10.0  # every step's argmax is eos
    model.lm_head = head
    prompt = tok("the cat", return_tensors="pt")
    gen = model.generate(**prompt, max_new_tokens=8, do_sample=False)
    assert gen[0, prompt["input_ids"].shape[1]:].tolist() == [1]  # one token, eos, then it stopped


@pytest.fixture(scope="module")
def wide_ckpt(tmp_path_factory):
    """An imported one-layer Llama of 640 tokens (room for the tokenizers below), with no tokenizer of its own."""
    from titanlike.checkpoint.hf import import_hf

    config = transformers.LlamaConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                      num_key_value_heads=2, vocab_size=640, intermediate_size=64)
    root = tmp_path_factory.mktemp("wide")
    transformers.LlamaForCausalLM(config).save_pretrained(root / "hf")
    import_hf(str(root / "hf"), str(root / "ckpt"), progress=False)
    return root / "ckpt" / "step-0"


def _export_with(step, tmp_path, data: dict) -> tuple[dict, dict]:
    """Export `step` as if its run's [data] section were `data` (the config.toml a run writes in every step)."""
    from titanlike.checkpoint.hf import export_hf

    (step / "config.toml").write_text("[data]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in data.items()))
    out = tmp_path / "out"
    export_hf(str(step), str(out), dtype="float32", progress=False)
    return (json.loads((out / "config.json").read_text()), json.loads((out / "generation_config.json").read_text()))


def _sentencepiece(path, model_type: str):
    spm = pytest.importorskip("sentencepiece")
    import io

    corpus = ["the cat sat on the mat", "the theory of everything", "then they went there", "other 12 thoughts"] * 30
    buf = io.BytesIO()  # Llama-2-like settings for BPE (no normalisation); sentencepiece's defaults for unigram
    extra = dict(normalization_rule_name="identity", remove_extra_whitespaces=False) if model_type == "bpe" else {}
    spm.SentencePieceTrainer.train(sentence_iterator=iter(corpus), model_writer=buf, vocab_size=320, minloglevel=2,
                                   hard_vocab_limit=False, character_coverage=1.0, byte_fallback=True,
                                   model_type=model_type, **extra)
    path.write_bytes(buf.getvalue())
    return path


TEXT = "the theory of the thing: 12 Grüße 東京 🚀\n\tindented  twice"


def _same_encoding(out, data: dict) -> object:
    from titanlike.config.sections import Data
    from titanlike.data.tokenizers import build_tokenizer

    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert tok.encode(TEXT, add_special_tokens=False) == build_tokenizer(Data(**data)).encode(TEXT)
    return tok


def test_export_tokenizer_formats(wide_ckpt, tmp_path, caplog, monkeypatch):
    """Each tokenizer format of data.tokenizer: tiktoken and sentencepiece (BPE and unigram) become a tokenizer.json
    AutoTokenizer loads and that encodes as the run's tokenizer did; the NullTokenizer, and files transformers would
    read differently, get no tokenizer files but still their ids; a separate document separator is a stop id too."""
    import base64

    from titanlike.data.tokenizers.sentencepiece_model import SentencePieceTokenizer

    pytest.importorskip("tiktoken")
    ranks = [bytes([b]) for b in range(256)] + [b"th", b"the", b" the"]  # 259 ranks: bos 259, eos 260
    (tmp_path / "tokenizer.model").write_text("".join(f"{base64.b64encode(t).decode()} {i}\n"
                                                      for i, t in enumerate(ranks)))
    data = {"tokenizer": str(tmp_path / "tokenizer.model")}
    cfg, gen = _export_with(wide_ckpt, tmp_path / "a", data)
    tok = _same_encoding(tmp_path / "a" / "out", data)
    assert (cfg["bos_token_id"], cfg["eos_token_id"], gen["eos_token_id"]) == (259, 260, 260) == \
        (tok.bos_token_id, tok.eos_token_id, tok.eos_token_id)
    assert tok.encode("<|end_of_text|>", add_special_tokens=False) == [260]  # a special token again, for chat use
    _, gen = _export_with(wide_ckpt, tmp_path / "b", {**data, "eod_token": "<|eot_id|>"})
    assert gen["eos_token_id"] == [260, 268]  # documents ended with <|eot_id|> in training: generation stops there

    for kind in ("bpe", "unigram"):
        data = {"tokenizer": str(_sentencepiece(tmp_path / f"{kind}.model", kind))}
        cfg, gen = _export_with(wide_ckpt, tmp_path / kind, data)
        tok = _same_encoding(tmp_path / kind / "out", data)
        assert (cfg["bos_token_id"], cfg["eos_token_id"], gen["eos_token_id"], tok.eos_token_id) == (1, 2, 2, 2)

    # A tokenizer whose files would encode differently is left out, with a warning, and its ids still written.
    monkeypatch.setattr(SentencePieceTokenizer, "encode", lambda self, text, **kw: [5])
    with caplog.at_level("WARNING", logger="titanlike"):
        cfg, gen = _export_with(wide_ckpt, tmp_path / "d", data)
    assert "encodes text differently" in caplog.text and "SentencePieceTokenizer files are left out" in caplog.text
    assert {p.name for p in (tmp_path / "d" / "out").iterdir()} == {"config.json", "generation_config.json",
                                                                    "model.safetensors"}
    assert (cfg["eos_token_id"], gen["eos_token_id"]) == (2, 2)

    caplog.clear()
    with caplog.at_level("INFO", logger="titanlike"):
        cfg, gen = _export_with(wide_ckpt, tmp_path / "e", {"tokenizer_type": "NullTokenizer",
                                                            "builtin_vocab_size": 100})
    assert "NullTokenizer has no Hugging Face equivalent" in caplog.text
    assert (cfg["bos_token_id"], cfg["eos_token_id"], gen["eos_token_id"]) == (100, 100, 100)
    assert not (tmp_path / "e" / "out" / "tokenizer_config.json").exists()


@pytest.mark.parametrize("add_bos", [False, True])
def test_export_tokenizer_adds_bos_as_the_run_did(wide_ckpt, tmp_path, add_bos):
    """An HF tokenizer.json run: the export's AutoTokenizer(prompt) prepends BOS exactly when the run's documents
    started with it (data.add_bos), whatever the file's own post-processor did, and equals generation's prompt ids."""
    from titanlike.data.tokenizers.hf import train_bytelevel_bpe
    from titanlike.infer import load_for_inference

    tok_file = tmp_path / "tok" / "tokenizer.json"
    tok_file.parent.mkdir()
    corpus = ["the cat sat on the mat", "the theory of everything", "then they went there"] * 20
    train_bytelevel_bpe(corpus, 300, special_tokens=["<|begin_of_text|>", "<|end_of_text|>"]).save(str(tok_file))
    _export_with(wide_ckpt, tmp_path, {"tokenizer": str(tok_file), "add_bos": add_bos})
    ids = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")("the cat")["input_ids"]
    assert (ids[0] == 0) == add_bos  # <|begin_of_text|> is id 0
    loaded = load_for_inference(str(wide_ckpt))
    assert loaded.add_bos == add_bos and loaded.encode("the cat") == ids
    assert load_for_inference(str(tmp_path / "out")).encode("the cat") == ids  # the export itself, as an HF folder
