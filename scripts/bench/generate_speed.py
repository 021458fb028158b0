"""Generation speed: titanlike's generate (eager, and with --compile's compiled decode step) beside transformers'
generate on the same random weights, greedy, fixed lengths (no EOS), tokens/s of new tokens per configuration.

    python scripts/bench/generate_speed.py                       # GPU: the default family's 1B flavor, bf16
    python scripts/bench/generate_speed.py --batch 1,32 --prompt-len 128 --new-tokens 256
    python scripts/bench/generate_speed.py --tiny                # CPU smoke run: a 2-layer shape, fp32

The transformers model is built in memory from the family's HF adapter (models/<name>/hf.py: hf_config + to_hf),
so nothing is downloaded (HF_HUB_OFFLINE is set). Timed calls follow one warm-up call of the same shape (which
also compiles); the time covers prefill and every decode step, as a user sees it. The "agree" column is how many
leading tokens of row 0 equal transformers' (bf16 rounding may make long greedy runs part ways).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach the network, even by accident

import torch  # noqa: E402

import models  # noqa: E402
from titanlike.infer import generate  # noqa: E402
from titanlike.infer.load import build_model  # noqa: E402


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _timed(fn, device: torch.device, iters: int):
    fn()  # warm-up: same shapes (compiles the decode step, fills allocator caches)
    out, best = None, float("inf")
    for _ in range(iters):
        _sync(device)
        t0 = time.perf_counter()
        out = fn()
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return out, best


def _hf_model(spec, args, model, dtype: torch.dtype, device: torch.device):
    import transformers

    cfg = spec.hf.hf_config(args, dtype)
    config = transformers.AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    with torch.device(device):
        hf = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    missing, unexpected = hf.load_state_dict(spec.hf.to_hf(model.state_dict(), args), strict=False)
    if [k for k in missing if "rotary" not in k] or unexpected:
        raise SystemExit(f"HF model does not take the exported weights: missing {missing[:3]}, "
                         f"unexpected {unexpected[:3]}")
    return hf.eval()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=models.DEFAULT_MODEL, choices=sorted(models.MODELS), help="model family")
    p.add_argument("--flavor", default="1B")
    p.add_argument("--batch", default="1,32", help="comma-separated batch sizes")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--iters", type=int, default=2, help="timed calls per row (the best is shown)")
    p.add_argument("--no-hf", action="store_true", help="skip transformers")
    p.add_argument("--no-compile", action="store_true", help="skip titanlike --compile")
    p.add_argument("--tiny", action="store_true", help="CPU smoke run: the debug flavor cut to 2 layers of dim 64")
    a = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() and not a.tiny else "cpu")
    spec = models.get_spec(a.model)
    if a.tiny:
        a.flavor, batches, a.prompt_len, a.new_tokens = "debugmodel", [1, 4], 16, 16
        args = dataclasses.replace(spec.flavors[a.flavor], dim=64, n_layers=2, vocab_size=256)
        dtype = torch.float32
    else:
        if device.type != "cuda":
            raise SystemExit("generate_speed.py times GPU generation: it needs a CUDA device (or --tiny on CPU)")
        batches = [int(b) for b in a.batch.split(",")]
        args = spec.flavor_args(a.flavor)
        dtype = torch.bfloat16
    args = dataclasses.replace(args, max_seq_len=a.prompt_len + a.new_tokens)
    torch.manual_seed(0)
    model = build_model(spec, args, device, dtype)
    hf = None if a.no_hf else _hf_model(spec, args, model, dtype, device)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"{a.model} {a.flavor}: {n_params / 1e6:.1f}M params, {dtype}, {device}"
          f"{' (' + torch.cuda.get_device_name() + ')' if device.type == 'cuda' else ''}, torch {torch.__version__}"
          f"; prompt {a.prompt_len}, {a.new_tokens} new tokens, greedy")
    print(f"{'batch':>5}  {'engine':<28} {'seconds':>8} {'new tok/s':>10}  agree")
    for b in batches:
        g = torch.Generator().manual_seed(b)
        prompts = torch.randint(0, args.vocab_size, (b, a.prompt_len), generator=g)
        rows = {}
        runs = [("titanlike eager", dict(compile=False))]
        if not a.no_compile:
            runs.append(("titanlike --compile", dict(compile=True)))
        for name, kw in runs:
            rows[name] = _timed(lambda kw=kw: generate(model, prompts.tolist(), max_new_tokens=a.new_tokens, **kw),
                                device, a.iters)
        if hf is not None:
            ids = prompts.to(device)

            def hf_generate():
                with torch.no_grad():
                    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=a.new_tokens,
                                      min_new_tokens=a.new_tokens, do_sample=False, eos_token_id=None,
                                      pad_token_id=0)
                return out[:, a.prompt_len:].tolist()

            import transformers
            rows[f"transformers {transformers.__version__}"] = _timed(hf_generate, device, a.iters)
        ref = next(iter(rows.values()))[0][0] if hf is None else list(rows.values())[-1][0][0]
        for name, (out, secs) in rows.items():
            agree = next((i for i, (x, y) in enumerate(zip(out[0], ref)) if x != y), len(ref))
            print(f"{b:>5}  {name:<28} {secs:>8.3f} {b * a.new_tokens / secs:>10.1f}  {agree}/{len(ref)}")


if __name__ == "__main__":
    main()
