"""Multi-token prediction (models/common/mtp.py, docs/mtp.md): off is unchanged, the loss and gradients against a
hand computation from the modules' parts (shifted targets, row and document ends), the DeepSeek-V3 HF layer round
trip with transformers' logits, counts, the config refusals, and debug DeepSeek-V3 / Llama runs training with MTP.
CPU, fp32, tiny shapes."""
from __future__ import annotations

import dataclasses
import math
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest
import torch
import torch.nn.functional as F

import models
from models.batch import IGNORE_INDEX, NextToken, StepContext
from models.common.masks import document_ids, document_positions
from models.common.mtp import MTPNextToken, mtp_objective
from models.deepseek_v3.hf import from_hf, hf_config, to_hf
from models.llama3.model import TransformerBlock as LlamaBlock

torch.set_num_threads(1)


def tiny_deepseek(**kw):
    from models.common.moe import MoEArgs
    from models.deepseek_v3 import ModelArgs

    base = dict(dim=64, n_layers=3, n_heads=4, vocab_size=128, max_seq_len=32, n_dense_layers=1, dense_hidden_dim=96,
                q_lora_rank=24, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                moe=MoEArgs(num_experts=8, top_k=2, hidden_dim=32, num_shared_experts=1, score_func="sigmoid",
                            route_norm=True, route_scale=2.5, n_groups=4, topk_groups=2))
    base.update(kw)
    return ModelArgs(**base)


def tiny_llama(**kw):
    from models.llama3 import ModelArgs

    return ModelArgs(**{**dict(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, max_seq_len=16,
                               multiple_of=16), **kw})


def build(spec_name: str, args, seed: int = 0):
    spec = models.get_spec(spec_name)
    torch.manual_seed(seed)
    with torch.device("meta"):
        model = spec.model_cls(args)
    model.to_empty(device="cpu")
    model.init_weights()
    return model


def test_mtp_off_is_unchanged():
    """Off: no module, no key, the plain next-token objective. On: the main model's weights (same seed) and its
    logits are bitwise those of the model without MTP, with or without the labels handed in."""
    off_args = tiny_deepseek()
    off, on = build("deepseek_v3", off_args), build("deepseek_v3", dataclasses.replace(off_args, mtp_num_layers=1))
    assert off.mtp is None and not any(k.startswith("mtp") for k in off.state_dict())
    assert isinstance(mtp_objective(off_args), NextToken)
    main = {k: v for k, v in on.state_dict().items() if not k.startswith("mtp.")}
    assert main.keys() == off.state_dict().keys()
    assert all(torch.equal(v, off.state_dict()[k]) for k, v in main.items())
    tokens = torch.randint(0, 128, (2, 12))
    labels = torch.randint(0, 128, (2, 12))
    ref = off(tokens)
    assert torch.equal(on(tokens), ref) and torch.equal(on(tokens, mtp_labels=labels), ref)
    batch = mtp_objective(on.args)(tokens, labels, StepContext(1, 0))
    assert isinstance(mtp_objective(on.args), MTPNextToken) and batch.kwargs()["mtp_labels"] is labels


def _hand_targets(labels, doc, k):
    b, s = labels.shape
    out = torch.full_like(labels, IGNORE_INDEX)
    for i in range(b):
        for t in range(s):
            if t + k < s and doc[i, t + k] == doc[i, t]:
                out[i, t] = labels[i, t + k]
    return out


def test_loss_and_gradients_match_hand_computation():
    """Llama with D=2 on packed documents: each depth's loss and the gradient of main + lambda/D * sum(MTP) equal a
    computation written here from the modules' parts; the shared embedding and head get the MTP share."""
    args = tiny_llama(mtp_num_layers=2, mtp_loss_weight=0.3)
    model = build("llama3", args)
    eos = 5
    tokens = torch.randint(6, 64, (2, 16))
    tokens[0, 4], tokens[0, 10], tokens[1, 7] = eos, eos, eos  # documents of 5, 6, 5 / 8, 8 tokens
    labels = torch.roll(tokens, -1, dims=1)
    labels[:, -1] = IGNORE_INDEX
    labels[1, 3] = IGNORE_INDEX  # an ignored label stays ignored at every depth that reads it
    doc = document_ids(tokens, eos)
    pos = document_positions(doc)

    logits = model(tokens, doc_ids=doc, positions=pos, mtp_labels=labels)
    main = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")
    main = main / (labels != IGNORE_INDEX).sum()
    main.backward()
    got = model.mtp.take_losses()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()

    # by hand: the main trunk, then each depth from its parts
    rope, mask = model._attention_inputs(16, doc, pos, tokens.device)
    h = model.tok_embeddings(tokens)
    for layer in model.layers.values():
        h = layer(h, rope, mask)
    h = model.norm(h)
    hand_main = F.cross_entropy(model.output(h).flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX,
                                reduction="sum") / (labels != IGNORE_INDEX).sum()
    prev, hand = h, []
    for k in (1, 2):
        m = model.mtp[str(k - 1)]
        shifted = torch.stack([torch.tensor([row[min(t + k, 15)] for t in range(16)]) for row in tokens])
        x = m.eh_proj(torch.cat([m.enorm(model.tok_embeddings(shifted)), m.hnorm(prev)], dim=-1))
        prev = m.norm(m.block(x, rope, mask))
        target = _hand_targets(labels, doc, k)
        n = (target != IGNORE_INDEX).sum()
        assert 0 < n < (labels != IGNORE_INDEX).sum() - 2  # row ends and document ends took some away
        hand.append(F.cross_entropy(model.output(prev).flatten(0, 1), target.flatten(), ignore_index=IGNORE_INDEX,
                                    reduction="sum") / n)
    torch.testing.assert_close(got, torch.stack(hand).detach(), rtol=1e-5, atol=1e-6)
    (hand_main + 0.3 / 2 * sum(hand)).backward(retain_graph=True)
    for name, p in model.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-6, msg=name)
    # the MTP share reaches the shared embedding and head: the main loss alone gives other gradients
    model.zero_grad()
    hand_main.backward()
    for name in ("tok_embeddings.weight", "output.weight"):
        assert (grads[name] - dict(model.named_parameters())[name].grad).abs().max() > 1e-6, name


def test_deepseek_hf_mtp_layer_round_trip_and_transformers_logits(tmp_path):
    """mtp_num_layers=1 exports as the published extra layer (model.layers.{n}.enorm / hnorm / eh_proj /
    shared_head.*, embed_tokens and the usual layer weights, MoE here as in DeepSeek-V3) and imports back to
    identical tensors; transformers' DeepseekV3ForCausalLM (which ignores that layer) gives the main logits."""
    transformers = pytest.importorskip("transformers")
    args = tiny_deepseek(mtp_num_layers=1)
    model = build("deepseek_v3", args).eval()
    with torch.no_grad():  # non-trivial norms, so a swapped norm would show
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
    sd = model.state_dict()
    hf = to_hf(sd, args)
    n = args.n_layers
    extra = {k[len(f"model.layers.{n}."):] for k in hf if k.startswith(f"model.layers.{n}.")}
    for key in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight", "shared_head.head.weight",
                "embed_tokens.weight", "input_layernorm.weight", "self_attn.kv_b_proj.weight", "mlp.gate.weight",
                "mlp.experts.7.down_proj.weight", "mlp.shared_experts.up_proj.weight"):
        assert key in extra, key
    assert torch.equal(hf[f"model.layers.{n}.shared_head.head.weight"], sd["output.weight"])
    assert hf[f"model.layers.{n}.eh_proj.weight"].shape == (64, 128)
    back = from_hf(hf, args)
    assert back.keys() == sd.keys() and all(torch.equal(back[k], sd[k]) for k in sd)
    # importing without MTP drops the layer, as before
    assert not any(k.startswith("mtp.") for k in from_hf(hf, dataclasses.replace(args, mtp_num_layers=0)))

    import json

    from safetensors.torch import save_file

    cfg = hf_config(args, torch.float32)
    assert cfg["num_nextn_predict_layers"] == 1
    save_file({k: v.contiguous() for k, v in hf.items()}, str(tmp_path / "model.safetensors"),
              metadata={"format": "pt"})
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32,
                                                            attn_implementation="eager").eval()
    assert type(ref).__name__ == "DeepseekV3ForCausalLM"
    tokens = torch.randint(0, 128, (2, 20))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), ref(tokens).logits, atol=1e-4, rtol=1e-4)


def test_counts_include_the_mtp_modules():
    """Exact parameter counts: the MTP module is 3 norms + eh_proj [dim, 2 dim] + one block of the family's
    (DeepSeek-V3: MoE by the layer rule, so its unrouted experts are inactive); FLOPs add a block's attention
    core and a pass through the head."""
    spec = models.get_spec("llama3")
    off, on = tiny_llama(), tiny_llama(mtp_num_layers=2)
    with torch.device("meta"):
        block = sum(p.numel() for p in LlamaBlock(2, off).parameters())
    per = 3 * 32 + 2 * 32 * 32 + block
    assert spec.param_counts(on).total - spec.param_counts(off).total == 2 * per
    assert spec.param_counts(on).active - spec.param_counts(off).active == 2 * per
    assert (spec.flops_per_token(on, 16) - spec.flops_per_token(off, 16)
            == 6 * 2 * per + 2 * 12 * 32 * 16 + 6 * 2 * 32 * 64)

    from models.deepseek_v3.model import TransformerBlock

    spec = models.get_spec("deepseek_v3")
    off, on = tiny_deepseek(), tiny_deepseek(mtp_num_layers=1)
    with torch.device("meta"):
        block = sum(p.numel() for p in TransformerBlock(3, off).parameters())
    per = 3 * 64 + 2 * 64 * 64 + block
    inactive = (8 - 2) * 3 * 64 * 32
    a, b = spec.param_counts(on), spec.param_counts(off)
    assert a.total - b.total == per and a.active - b.active == per - inactive
    attn = 6 * 16 * 4 * (24 + 16)
    assert spec.flops_per_token(on, 16) - spec.flops_per_token(off, 16) == 6 * (per - inactive) + attn + 6 * 64 * 128


def _load(*extra: str):
    from titanlike.config.load import load_config

    return load_config(["--config", "configs/debug_model.toml", "--training.device=cpu", *extra])


def test_bad_inputs_are_refused_in_one_line():
    from titanlike.config.load import ConfigError

    for axis in ("cp", "pp", "tp"):  # built for each (tests/multiproc: cp_worker.py, pp_worker.py, tp_worker.py)
        ok = _load("--model.args={mtp_num_layers = 1}", f"--parallelism.{axis}=2", "--parallelism.dp_shard=1")
        assert getattr(ok.parallelism, axis) == 2
    cases = [
        (["--model.args={mtp_num_layers = 8}", "--training.seq_len=8"], "leaves no target in sequences of 8"),
        (["--model.args={mtp_num_layers = 1}", "--parallelism.pp=2", "--parallelism.pp_schedule=ZBVZeroBubble"],
         "zero-bubble schedules split the last stage's backward"),
        (["--model.name=gpt", "--model.flavor=debugmodel", "--model.args={mtp_num_layers = 1}"],
         "model.args.mtp_num_layers is not a field of gpt's args: multi-token prediction needs a decoder whose "
         "embedding and output head"),
    ]
    for extra, text in cases:
        with pytest.raises(ConfigError) as e:
            _load(*extra)
        line = next((x for x in str(e.value).splitlines() if "mtp_num_layers" in x), "")
        assert text in line, (extra, str(e.value))


@pytest.mark.parametrize("config", ["configs/deepseek_v3_debug.toml", "configs/debug_model.toml"],
                         ids=["deepseek_v3", "llama3"])
def test_debug_run_trains_with_mtp(tmp_path, config):
    """A debug run with two MTP depths: the main loss and each depth's loss fall; the step line shows them."""
    from titanlike.config.load import load_config
    from titanlike.observe.metrics import MetricsLogger
    from titanlike.train.trainer import Trainer

    cfg = load_config(["--config", config, f"--job.dump_folder={tmp_path}", "--training.steps=8",
                       "--training.device=cpu", "--metrics.log_freq=1", "--metrics.enable_tensorboard=false",
                       "--lr_scheduler.warmup_steps=2",
                       "--model.args={mtp_num_layers = 2, mtp_loss_weight = 0.3}"])
    trainer = Trainer(cfg)
    try:
        history = trainer.train()
    finally:
        trainer.close()
    first, last = history[0], history[-1]
    assert all(math.isfinite(h["loss"]) for h in history)
    assert last["loss"] < first["loss"] - 0.5
    for k in (1, 2):
        assert last[f"mtp/loss_{k}"] < first[f"mtp/loss_{k}"] - 0.3
    assert last["mtp/total_loss"] == pytest.approx(last["loss"] + 0.15 * (last["mtp/loss_1"] + last["mtp/loss_2"]))
    assert "mtp " in MetricsLogger.format_line(8, last)


def test_megatron_mtp_keys_round_trip(tmp_path):
    """Llama with D=2 <-> megatron-core's names (mtp.layers.<i>.{enorm, hnorm, eh_proj, transformer_layer.*,
    final_layernorm}, megatron-core 0.16.1's MultiTokenPredictionLayer): the exact keys, a torch_dist folder written
    and read back with the MTP args, and the local layer spec's norm names / later releases' mtp_model_layer read
    the same; an import asking for one depth drops the second."""
    from models.llama3 import megatron
    from titanlike.checkpoint import megatron_format

    args = tiny_llama(mtp_num_layers=2, mtp_loss_weight=0.3)
    sd = build("llama3", args).state_dict()
    msd = megatron.to_megatron(sd, args)
    layer = {"self_attention.linear_qkv.weight", "self_attention.linear_qkv.layer_norm_weight",
             "self_attention.linear_proj.weight", "mlp.linear_fc1.layer_norm_weight", "mlp.linear_fc1.weight",
             "mlp.linear_fc2.weight"}
    for i in (0, 1):
        own = {k[len(f"mtp.layers.{i}."):] for k in msd if k.startswith(f"mtp.layers.{i}.")}
        assert own == {"enorm.weight", "hnorm.weight", "eh_proj.weight", "final_layernorm.weight"} | {
            "transformer_layer." + s for s in layer}
    assert torch.equal(msd["mtp.layers.1.final_layernorm.weight"], sd["mtp.1.norm.weight"])
    margs = {**megatron.megatron_args(args), "padded_vocab_size": 64}
    assert margs["mtp_num_layers"] == 2 and margs["mtp_loss_scaling_factor"] == 0.3
    megatron_format.write_torch_dist(str(tmp_path), 5, msd, margs, ())
    read_args, read = megatron_format.read_torch_dist(str(tmp_path / "iter_0000005"))
    back_args = megatron.args_from_megatron(read_args)
    assert back_args.mtp_num_layers == 2 and back_args.mtp_loss_weight == 0.3
    back = megatron.from_megatron(read, back_args, read_args)
    assert back.keys() == sd.keys() and all(torch.equal(back[k], sd[k]) for k in sd)
    local = {k.replace("transformer_layer.self_attention.linear_qkv.layer_norm_weight",
                       "mtp_model_layer.input_layernorm.weight")
              .replace("transformer_layer.mlp.linear_fc1.layer_norm_weight", "mtp_model_layer.pre_mlp_layernorm.weight")
              .replace("transformer_layer.", "mtp_model_layer."): v for k, v in msd.items()}
    local = {megatron_format._canonical(k): v for k, v in local.items()}
    again = megatron.from_megatron(local, args)
    assert again.keys() == sd.keys() and all(torch.equal(again[k], sd[k]) for k in sd)
    one = megatron.from_megatron(msd, dataclasses.replace(args, mtp_num_layers=1))
    assert not any(k.startswith("mtp.1.") for k in one) and "mtp.0.eh_proj.weight" in one
    assert megatron_format._rule("mtp.layers.0.eh_proj.weight", megatron.TP_SPLIT, "x") == "col"
    fc1 = "mtp.layers.0.transformer_layer.mlp.linear_fc1.weight"
    assert megatron_format._rule(fc1, megatron.TP_SPLIT, "x") == "glu"


def test_split_backward_schedules_refused_with_mtp_are_the_pipelines():
    # models/ cannot import parallelize/: the two lists are kept equal here
    from models.common.mtp import SPLIT_BACKWARD_SCHEDULES
    from parallelize.pp_split import SPLIT_BACKWARD_SCHEDULES as PIPELINE_SPLIT

    assert SPLIT_BACKWARD_SCHEDULES == PIPELINE_SPLIT
