"""Megatron-Core BERT and T5 checkpoints -> titanlike (scripts/convert_megatron.py import), against megatron-core on
CPU, as tests/unit/test_megatron_checkpoint.py does for GPT and Llama (same shims, same gloo group of one process).

The Megatron side runs in a subprocess (this file as a script): it builds megatron-core's own BertModel and T5Model at
tiny shapes with the local (Transformer-Engine-free) layer specs, random weights (norms and biases too), saves their
torch_dist checkpoints with `dist_checkpointing.save(model.sharded_state_dict())` and the legacy TP1 format with
`state_dict_for_save_checkpoint()`, and records their fp32 outputs: BERT's MLM logits and binary-head logits (with
token types, as pretrain_bert.py passes them when the binary head is on), T5's decoder logits (no padding: the
encoder and cross masks attend everywhere, the decoder's is causal).
The T5 model is built from the layer specs (TransformerBlock then uses torch's LayerNorm for the final norms); the
block specs Megatron-LM's pretrain_t5.py uses name TENorm for them, which needs Transformer Engine; the tensors and
their names are the same. The T5 import is flavor debugmodel_megatron's switches (models/t5/megatron.py).
Megatron's settings are pretrain_bert.py's / pretrain_t5.py's defaults: tied output with its own bias, learned
absolute positions, LayerNorm, GELU through the fused bias-GELU (tanh approximation), pre-LN.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys

import pytest
import torch

VOCAB, SEQ, DSEQ, ITER = 128, 16, 8, 5
TOKENS = torch.arange(2 * SEQ).reshape(2, SEQ).mul(37).remainder(VOCAB)
TYPES = (torch.arange(SEQ) >= SEQ // 2).long().expand(2, SEQ)  # two segments, as a sentence pair
DTOKENS = torch.arange(2 * DSEQ).reshape(2, DSEQ).mul(29).add(3).remainder(VOCAB)
ATOL = 1e-4
CONFIGS = ("bert_binary", "bert_plain", "t5")


# ------------------------------------------------------------------------------ Megatron side (worker process)
def _setup(store: str) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *a, **k: None
    # a file rendezvous, not a fixed TCP port: tests running in parallel never collide
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    ps.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()


def _config():
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=256,
                             bias_activation_fusion=True, use_cpu_initialization=True, hidden_dropout=0.0,
                             attention_dropout=0.0, params_dtype=torch.float32, layernorm_epsilon=1e-5)


def _megatron_model(name: str):
    if name.startswith("bert"):
        from megatron.core.models.bert.bert_layer_specs import bert_layer_local_spec
        from megatron.core.models.bert.bert_model import BertModel

        binary = name == "bert_binary"
        return BertModel(_config(), num_tokentypes=2 if binary else 0, transformer_layer_spec=bert_layer_local_spec,
                         vocab_size=VOCAB, max_sequence_length=32, add_binary_head=binary,
                         share_embeddings_and_output_weights=True).eval()
    from megatron.core.models.T5.t5_model import T5Model
    from megatron.core.models.T5.t5_spec import decoder_model_with_local_spec, encoder_model_with_local_spec

    return T5Model(_config(), _config(), encoder_model_with_local_spec(), decoder_model_with_local_spec(),
                   vocab_size=VOCAB, max_sequence_length=32, share_embeddings_and_output_weights=True).eval()


def _margs(name: str) -> argparse.Namespace:
    common = dict(num_layers=2, hidden_size=64, ffn_hidden_size=256, num_attention_heads=4, kv_channels=16,
                  max_position_embeddings=32, padded_vocab_size=VOCAB, make_vocab_size_divisible_by=128,
                  position_embedding_type="learned_absolute", normalization="LayerNorm", swiglu=False,
                  add_bias_linear=True, bias_gelu_fusion=True, untie_embeddings_and_output_weights=False,
                  norm_epsilon=1e-5, hidden_dropout=0.0, attention_dropout=0.0, num_experts=None,
                  tensor_model_parallel_size=1, pipeline_model_parallel_size=1, ckpt_format="torch")
    if name.startswith("bert"):
        return argparse.Namespace(**common, seq_length=SEQ, bert_binary_head=name == "bert_binary")
    return argparse.Namespace(**common, encoder_num_layers=2, decoder_num_layers=2, encoder_seq_length=SEQ,
                              decoder_seq_length=DSEQ, seq_length=SEQ, vocab_extra_ids=0)


def megatron_outputs(name: str, model) -> dict:
    with torch.no_grad():
        if name.startswith("bert"):
            types = TYPES if name == "bert_binary" else None
            logits, binary = model(TOKENS, torch.ones(2, SEQ), tokentype_ids=types)
            return {"logits": logits.float(), "binary": None if binary is None else binary.float()}
        # Megatron's T5 masks: True = masked. Encoder: none; decoder: causal; cross: none.
        causal = torch.triu(torch.ones(DSEQ, DSEQ), 1).bool()[None, None]
        logits = model(TOKENS, DTOKENS, torch.zeros(2, 1, SEQ, SEQ, dtype=torch.bool), causal,
                       torch.zeros(2, 1, DSEQ, SEQ, dtype=torch.bool))
        return {"logits": logits.float()}


def worker_build(out: str) -> None:
    from megatron.core import dist_checkpointing

    _setup(os.path.join(out, ".store_build"))
    for i, name in enumerate(CONFIGS):
        torch.manual_seed(i)
        model = _megatron_model(name)
        with torch.no_grad():
            for pname, p in model.named_parameters():
                p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in pname and pname.endswith("weight")
                        else 0.05 * torch.randn_like(p))
        torch.save(megatron_outputs(name, model), os.path.join(out, f"{name}.out.pt"))
        td = os.path.join(out, name, "td", f"iter_{ITER:07d}")
        os.makedirs(td)
        dist_checkpointing.save({"model": model.sharded_state_dict(), "args": _margs(name), "iteration": ITER,
                                 "checkpoint_version": 3.0}, td)
        legacy = os.path.join(out, name, "tp1", f"iter_{ITER:07d}", "mp_rank_00")
        os.makedirs(legacy)
        torch.save({"model": model.state_dict_for_save_checkpoint(), "args": _margs(name), "iteration": ITER,
                    "checkpoint_version": 3.0}, os.path.join(legacy, "model_optim_rng.pt"))
        for sub in ("td", "tp1"):
            with open(os.path.join(out, name, sub, "latest_checkpointed_iteration.txt"), "w") as f:
                f.write(str(ITER))


# ------------------------------------------------------------------------------ titanlike side (pytest)
@pytest.fixture(scope="module")
def mcore(tmp_path_factory):
    pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install --no-deps "
                                                "megatron-core psutil)")
    pytest.importorskip("psutil", reason="megatron-core's checkpoint writer needs psutil")
    out = str(tmp_path_factory.mktemp("mcore_enc"))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    r = subprocess.run([sys.executable, __file__, "build", out], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, f"megatron worker failed:\n{r.stdout[-3000:]}\n{r.stderr[-6000:]}"
    return out


def convert(argv: list[str]) -> int:
    from tests.unit.test_megatron_checkpoint import convert as run

    return run(argv)


def _model(ckpt: str):
    from titanlike.checkpoint import layout
    from titanlike.checkpoint.states import full_model_state, model_from_meta

    path = layout.choose_step(ckpt, -1).path
    model, _ = model_from_meta(path)
    model.to_empty(device="cpu")
    model.init_weights()
    model.load_state_dict(full_model_state(path))
    model.tie_weights()
    return model.eval()


@pytest.mark.parametrize("name", ["bert_binary", "bert_plain", "t5"])
@pytest.mark.parametrize("layout_", ["td", "tp1"])
def test_import_matches_megatron(mcore, tmp_path, name, layout_):
    out = str(tmp_path / "ck")
    assert convert(["import", os.path.join(mcore, name, layout_), out]) == 0
    meta = json.load(open(os.path.join(out, "step-0", "meta.json")))
    assert meta["model_name"] == name.split("_")[0]
    if name == "t5":
        from models.t5.flavors import t5_flavors

        want = {k: v for k, v in vars(t5_flavors["debugmodel_megatron"]).items() if k not in ("vocab_size",
                "max_seq_len", "max_decoder_len", "max_position_rows")}
        assert {k: meta["model_args"][k] for k in want} == want, "the import is not flavor debugmodel_megatron's shape"
    ref = torch.load(os.path.join(mcore, f"{name}.out.pt"))
    model = _model(out)
    with torch.no_grad():
        if name == "t5":
            got = {"logits": model(TOKENS, DTOKENS)}
        else:
            res = model(TOKENS, token_types=TYPES if name == "bert_binary" else None)
            got = {"logits": res[0], "binary": res[1]} if name == "bert_binary" else {"logits": res, "binary": None}
    for key, want in ref.items():
        if want is None:
            assert got[key] is None
            continue
        diff = (got[key].float() - want).abs().max().item()
        print(f"{name} {layout_} {key}: max |diff| {diff:.2e}")
        torch.testing.assert_close(got[key].float(), want, atol=ATOL, rtol=0)


def test_t5_other_positions_are_refused(mcore, tmp_path, capsys):
    # Megatron's T5Model with relative positions (or rope) is not the variant titanlike has: one line, nothing written
    out = str(tmp_path / "ck")
    assert convert(["import", os.path.join(mcore, "t5", "td"), out,
                    "--megatron-arg", "position_embedding_type=relative"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "T5Model" in err and "learned_absolute" in err, err
    assert not os.path.exists(out)


def test_vocab_cut_keeps_the_output_bias_in_step(mcore, tmp_path):
    out = str(tmp_path / "cut")
    assert convert(["import", os.path.join(mcore, "bert_plain", "td"), out, "--vocab-size", "100"]) == 0
    model = _model(out)
    assert model.output.bias.shape == (100,) and model.tok_embeddings.weight.shape[0] == 100
    ref = torch.load(os.path.join(mcore, "bert_plain.out.pt"))["logits"]
    with torch.no_grad():
        got = model(TOKENS % 100)
    assert got.shape[-1] == 100
    if (TOKENS % 100).equal(TOKENS):
        torch.testing.assert_close(got, ref[..., :100], atol=ATOL, rtol=0)


if __name__ == "__main__":
    {"build": worker_build}[sys.argv[1]](*sys.argv[2:])
