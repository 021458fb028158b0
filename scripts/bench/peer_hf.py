"""The peer for the families torchtitan does not train (the hybrids: nemotron_h, qwen3_next, mamba2; the encoder
families bert and t5): what a user runs today, transformers' own model class with its fast path, on the same shape,
data size and steps as titanlike.

    MODEL=nemotron_h python scripts/bench/peer_hf.py 8B_9L --training.seq_len 4096 --training.local_batch_size 1 \
        --training.steps 16 --compile.enable --vocab 131072
    python scripts/bench/peer_hf.py bert-large --model bert --training.seq_len 512 --training.local_batch_size 16 \
        --training.steps 30 --compile.enable --vocab 30522
    python scripts/bench/peer_hf.py t5-v1_1-large --model t5 --decoder-len 128 --training.seq_len 512 \
        --training.local_batch_size 8 --training.steps 30 --compile.enable --vocab 32128

BERT and T5 (`encoder_step`): `BertForPreTraining` / `T5ForConditionalGeneration` built from the HF config
titanlike's adapter writes for the flavor (models/<family>/hf.py; BertForPreTraining whatever the flavor's
binary_head), bf16 weights, fused AdamW, SDPA, `torch.compile` of the model, on random tokens of the run's shape
(nothing is downloaded). BERT: [B, seq] tokens, 15% of the positions (BERT's mask_rate) carry an MLM label (their
input set to the flavor's mask id), and a next-sentence label per row (0/1); no padding mask, as titanlike's plain
rows have none. T5: [B, seq] encoder tokens with an all-ones attention mask, [B, decoder_len] decoder inputs and
labels; --decoder-len 0 takes titanlike's own decoder length for seq (models/t5/counts.py decoder_len: the span
objective's noise + sentinels, padded to model.args.decoder_multiple); N > 0 sets decoder_multiple = N, as
benchmark.py --dec-seq N does on titanlike's side. Tokens per step for both families: batch x seq (the encoder's
tokens for T5, as titanlike's loader and metrics count them); FLOPs per token: titanlike's flops_per_token for the
same args (T5: per encoder token with the decoder's share at that decoder length; BERT: without the binary head when
the flavor has none, so the peer's pooler + NSP classifier, under 0.1% of a step, go uncounted). Runs on CPU too
(no fla needed for these two), for tests. Initialisation is transformers' own (its T5 starts near loss 40: the
untied head's init), which throughput does not depend on.

The model: `AutoModelForCausalLM.from_config` of the HF config titanlike's adapter writes for the flavor (the same
shapes, so the same FLOPs per token), bf16 weights and AdamW (fused) on them, SDPA attention, grouped-GEMM experts
(experts_implementation="grouped_mm"), random tokens, `torch.compile` of the model where --compile.enable (fla's
kernels are graph breaks in it: they are torch.compiler.disable'd).
The fast path: with fla-core installed, transformers' Qwen3-Next runs fla's `chunk_gated_delta_rule` by itself. Its
Mamba-2 fast path (mamba-ssm, causal-conv1d) needs CUDA-built packages that the GPU machine cannot install, and
transformers otherwise falls back to a PyTorch scan; so, as issue 35 prescribes, the peer's Mamba-2 mixers run
flash-linear-attention's Triton kernels in the same shape: fla's `chunk_simple_gla` (the SSD) and its Triton
`causal_conv1d`, patched into transformers' module in place of the mamba-ssm calls (`patch_fla`). Never a PyTorch
fallback: the run stops if fla-core is missing.

fla-core 0.6 refuses its gated backward kernel on Hopper with the Triton that torch 2.11 pins (fla issue 640: Triton
miscompiles it). The peer lifts that refusal, as a user of transformers with fla on such a GPU would have to: its
speed is the kernels', but on an H100 the lifted kernel's bf16 gradients were found wrong (docs/hybrid.md), which is
why titanlike no longer lifts it.

LLaVA (`--model llava --images K`): transformers' LlavaForConditionalGeneration with K images per row, in
scripts/bench/peer_hf_vlm.py (its docstring has the details).

Prints torchtitan-style lines ("step: N loss: X memory: Y GiB tps: Z tflops: T mfu: M%") that
scripts/bench/benchmark.py parses (--peer hf).
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import os
import time

import torch
import torch.nn.functional as F

import models  # the repository on PYTHONPATH, as every bench script expects
from peer_flags import add_run_flags  # scripts/bench, beside this script

PEAK = 989e12  # dense bf16 FLOP/s of an H100/H200, as titanlike's MFU


def _fla_conv(hidden_states, weight, bias=None, activation=None, **kwargs):
    """transformers' causal_conv1d_fn contract ([B, D, T] in and out) on fla's Triton convolution."""
    from fla.modules.causal_conv1d import causal_conv1d

    y, _ = causal_conv1d(hidden_states.transpose(1, 2), weight, bias, activation=activation)
    return y.transpose(1, 2)


def _fla_ssd(hidden_states, dt, A, B, C, chunk_size, D=None, dt_bias=None, initial_states=None, dt_softplus=False,
             dt_limit=(0.0, float("inf")), return_final_states=False, **kwargs):
    """transformers' mamba2_chunk_scan contract (mamba-ssm's mamba_chunk_scan_combined) on fla's chunk_simple_gla:
    q = C, k = B, v = x * dt, g = A * dt, scale 1."""
    from fla.ops.simple_gla import chunk_simple_gla

    h, g = hidden_states.shape[2], B.shape[2]
    dt = dt.float()
    if dt_bias is not None:
        dt = dt + dt_bias.float()
    if dt_softplus:
        dt = F.softplus(dt)
    dt = dt.clamp(min=dt_limit[0], max=dt_limit[1])
    v = (hidden_states.float() * dt[..., None]).to(hidden_states.dtype)
    k = B.repeat_interleave(h // g, dim=2).to(hidden_states.dtype)
    q = C.repeat_interleave(h // g, dim=2).to(hidden_states.dtype)
    y, final = chunk_simple_gla(q, k, v, g=A.float() * dt, scale=1.0, initial_state=initial_states,
                                output_final_state=return_final_states)
    if D is not None:
        y = (y.float() + hidden_states.float() * D.float()[:, None]).to(hidden_states.dtype)
    return (y, final) if return_final_states else y


def patch_fla(model_type: str) -> list[str]:
    """Point transformers' slow paths for this model type at fla's kernels; returns what was patched."""
    import importlib

    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    import fla.ops.common.chunk_o as chunk_o

    chunk_o.TRITON_ABOVE_3_7_1 = True  # lifted for speed only: its gradients may be wrong (module docstring)
    mod = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    patched = []
    for name, fn in (("causal_conv1d_fn", _fla_conv), ("mamba2_chunk_scan", _fla_ssd),
                     ("chunk_gated_delta_rule", chunk_gated_delta_rule)):
        if hasattr(mod, name):
            setattr(mod, name, fn)
            patched.append(name)
    return patched


def _profiler(step: int):
    """PEER_PROFILE_STEP=N: a torch.profiler trace of step N (chrome JSON in PEER_PROFILE_DIR, default ./peer_trace),
    with the ProfilerStep annotations scripts/bench/kernel_breakdown.py reads; None when unset."""
    if step < 1:
        return None
    out = os.environ.get("PEER_PROFILE_DIR", "peer_trace")
    os.makedirs(out, exist_ok=True)
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    prof = torch.profiler.profile(
        activities=acts, schedule=torch.profiler.schedule(wait=max(step - 2, 0), warmup=min(step - 1, 1), active=1),
        on_trace_ready=lambda p: p.export_chrome_trace(os.path.join(out, f"peer_step{step}.json")))
    prof.start()
    return prof


def _memory_gib(device: str) -> float:
    if device == "cuda":
        return torch.cuda.max_memory_reserved() / 2**30
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def timed_loop(step_fn, model, opt, a, tokens: int, fpt: float, device: str) -> None:
    """a.steps optimizer steps of step_fn(step) -> loss, a torchtitan-style line every a.log_freq steps (tok/s over
    `tokens` per step since the last line)."""
    t_last, n_since = time.perf_counter(), 0
    prof = _profiler(int(os.environ.get("PEER_PROFILE_STEP", "0")))
    for step in range(1, a.steps + 1):
        loss = step_fn(step)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if prof is not None:
            prof.step()
        n_since += 1
        if step % a.log_freq == 0 or step == a.steps:
            if device == "cuda":
                torch.cuda.synchronize()
            now = time.perf_counter()
            tps = tokens * n_since / (now - t_last)
            t_last, n_since = now, 0
            value = loss.item()
            print(f"step: {step} loss: {value if math.isfinite(value) else float('nan'):.4f} "
                  f"memory: {_memory_gib(device):.2f}GiB tps: {tps:,.0f} tflops: {tps * fpt / 1e12:.2f} "
                  f"mfu: {100 * tps * fpt / PEAK:.2f}%", flush=True)
    if prof is not None:
        prof.stop()


def encoder_args(model_name: str, flavor: str, vocab: int, seq: int, decoder_len: int = 0):
    """The flavor's args at this run's vocabulary and length; T5 with decoder_len > 0: decoder_multiple = it, so
    titanlike's objective (and its FLOPs count) pads the decoder to exactly that length."""
    args = dataclasses.replace(models.get_spec(model_name).flavors[flavor], max_seq_len=seq,
                               **({"vocab_size": vocab} if vocab else {}))
    if decoder_len and model_name == "t5":
        from models.t5.counts import decoder_len as t5_decoder_len

        args = dataclasses.replace(args, decoder_multiple=decoder_len)
        if t5_decoder_len(args, seq) != decoder_len:
            raise ValueError(f"t5 decoder length {decoder_len} is shorter than the span objective's targets at "
                             f"seq {seq} ({t5_decoder_len(args, seq)} after padding): give at least that")
    return args


def encoder_step(model_name: str, args, a, device: str):
    """(model, step_fn(step) -> loss) for BERT (BertForPreTraining, MLM + NSP labels) or T5
    (T5ForConditionalGeneration) on random tokens of the run's shape."""
    from transformers import BertConfig, BertForPreTraining, T5Config, T5ForConditionalGeneration

    spec = models.get_spec(model_name)
    cfg = dict(spec.hf.hf_config(args, torch.bfloat16, **({"max_position_embeddings": args.n_positions}
                                                          if model_name == "bert" else {})))
    for k in ("architectures", "model_type", "torch_dtype"):
        cfg.pop(k, None)
    config = (BertConfig if model_name == "bert" else T5Config)(**cfg)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(device):
        model = (BertForPreTraining if model_name == "bert" else T5ForConditionalGeneration)(config)
    model.to(torch.bfloat16).train()
    if a.ac == "full":
        model.gradient_checkpointing_enable()
    fwd = torch.compile(model) if a.compile else model
    gen = torch.Generator(device=device).manual_seed(0)
    v, b, s = args.vocab_size, a.batch, a.seq

    def rand(*shape, high=v):
        return torch.randint(0, high, shape, device=device, generator=gen)

    if model_name == "bert":
        mask_id = args.mask_token_id % v

        def step_fn(step):
            ids = rand(b, s)
            picked = torch.rand(b, s, device=device, generator=gen) < args.mask_rate
            labels = torch.where(picked, ids, -100)
            types = (torch.arange(s, device=device) >= s // 2).long().expand(b, s)  # a sentence pair's halves
            return fwd(input_ids=ids.masked_fill(picked, mask_id), token_type_ids=types, labels=labels,
                       next_sentence_label=rand(b, high=2)).loss
    else:
        from models.t5.counts import decoder_len

        t = decoder_len(args, s)
        ones = torch.ones(b, s, dtype=torch.long, device=device)

        def step_fn(step):
            return fwd(input_ids=rand(b, s), attention_mask=ones, decoder_input_ids=rand(b, t), labels=rand(b, t),
                       use_cache=False).loss
    return model, step_fn


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("flavor")
    p.add_argument("--model", default=os.environ.get("MODEL", "nemotron_h"))
    add_run_flags(p, batch=1, steps=16)
    p.add_argument("--vocab", type=int, default=int(os.environ.get("VOCAB", "0")))
    p.add_argument("--decoder-len", type=int, default=0,
                   help="t5: decoder tokens per row (0: titanlike's span-objective length for seq)")
    p.add_argument("--images", type=int, default=1, help="llava: images per row (each its tower's placeholders)")
    a, unknown = p.parse_known_args()
    if unknown:
        print(f"peer_hf: ignoring {unknown}", flush=True)
    spec = models.get_spec(a.model)
    if a.model == "llava":  # LlavaForConditionalGeneration: its own module (peer_hf_vlm.py)
        from peer_hf_vlm import vlm_step

        device = "cuda" if torch.cuda.is_available() else "cpu"
        model, step_fn, tokens, fpt = vlm_step(a, device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        timed_loop(step_fn, model, opt, a, tokens, fpt, device)
        return
    if a.model in ("bert", "t5"):
        device = "cuda" if torch.cuda.is_available() else "cpu"
        args = encoder_args(a.model, a.flavor, a.vocab, a.seq, a.decoder_len)
        model, step_fn = encoder_step(a.model, args, a, device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        timed_loop(step_fn, model, opt, a, a.batch * a.seq, spec.flops_per_token(args, a.seq), device)
        return
    from transformers import AutoConfig, AutoModelForCausalLM

    flavor = spec.flavors[a.flavor]
    args = dataclasses.replace(flavor, vocab_size=a.vocab or flavor.vocab_size, max_seq_len=a.seq)
    cfg = dict(spec.hf.hf_config(args, torch.bfloat16, max_position_embeddings=a.seq))
    cfg.pop("architectures", None)
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    config._attn_implementation = "sdpa"
    try:
        config._experts_implementation = "grouped_mm"
    except (AttributeError, ValueError) as e:
        print(f"peer_hf: experts_implementation grouped_mm not set ({e})", flush=True)
    print(f"peer_hf: fla patched into transformers: {patch_fla(config.model_type)}", flush=True)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.train()
    if a.ac == "full":
        model.gradient_checkpointing_enable()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True)
    fwd = torch.compile(model) if a.compile else model
    gen = torch.Generator(device="cuda").manual_seed(0)

    def step_fn(step):
        ids = torch.randint(0, args.vocab_size, (a.batch, a.seq), device="cuda", generator=gen)
        return fwd(input_ids=ids, labels=ids, use_cache=False).loss

    timed_loop(step_fn, model, opt, a, a.batch * a.seq, spec.flops_per_token(args, a.seq), "cuda")


if __name__ == "__main__":
    main()
