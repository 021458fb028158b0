"""Causal attention alone, forward + backward, at a model flavor's head shape: which kernel and which layout is
fastest on this GPU. Each row is timed with the q/k/v layout the model hands to attention ([B, S, H, D] projected
activations, transposed to [B, H, S, D] views).

    python scripts/bench/attention_bench.py --flavor 1B --seq 4096 --batch 2 [--iters 20] [--flex]

Rows: SDPA backends (cuDNN, flash = FlashAttention-2, memory-efficient) with the KV heads repeated first (`repeat`,
what the memory-efficient kernel needs) or passed once with `enable_gqa=True` (`gqa`, the model's default);
FlashAttention-4 where flash-attn-4 imports (models/common/fa4.py); with `--flex`, compiled FlexAttention with
a causal block mask (Triton), default and autotuned. TFLOP/s counts the causal half of the score matrix, backward as
2.5x forward. Figures: docs/benchmarks.md (attention kernels).
"""
from __future__ import annotations

import argparse
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import models
from models.common.fa4 import fa4_causal_attention, fa4_unavailable
from models.common.attention import repeat_kv
from optimizer_bench import timed  # ms per call after 3 warm-up calls, synchronised


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--flavor", default="1B")
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--flex", action="store_true", help="also FlexAttention (compiles; --flex autotune is slow)")
    p.add_argument("--model", default=models.DEFAULT_MODEL, choices=sorted(models.MODELS), help="model family")
    a = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("attention_bench.py times GPU attention kernels: it needs a CUDA device")
    args = models.get_spec(a.model).flavors[a.flavor]
    hq, hkv, d = args.n_heads, args.n_kv_heads or args.n_heads, args.dim // args.n_heads
    b, s = a.batch, a.seq
    flops = 4 * b * s * s * hq * d / 2 * 3.5  # causal half; forward 1x + backward 2.5x
    print(f"{a.flavor}: batch {b}, seq {s}, {hq} query heads, {hkv} KV heads, head dim {d}; "
          f"{flops / 1e9:.0f} GFLOP per forward+backward, torch {torch.__version__}, "
          f"cuDNN {torch.backends.cudnn.version()}")
    gen = torch.Generator(device="cuda").manual_seed(0)

    def leaf(h: int) -> torch.Tensor:  # [B, S, H, D] as the projections produce it
        return torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()

    q, k, v = leaf(hq), leaf(hkv), leaf(hkv)
    dout = torch.randn(b, hq, s, d, device="cuda", dtype=torch.bfloat16, generator=gen)

    def sdpa_row(backend: SDPBackend, gqa: bool):
        def step():
            kk, vv = (k, v) if gqa else (repeat_kv(k, hq // hkv), repeat_kv(v, hq // hkv))
            with sdpa_kernel([backend]):
                out = F.scaled_dot_product_attention(q.transpose(1, 2), kk.transpose(1, 2), vv.transpose(1, 2),
                                                     is_causal=True, enable_gqa=gqa)
            out.backward(dout)
        return step

    rows = [(f"sdpa {name} {'gqa' if gqa else 'repeat'}", sdpa_row(be, gqa))
            for name, be in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION),
                             ("efficient", SDPBackend.EFFICIENT_ATTENTION))
            for gqa in (False, True)]
    reason = fa4_unavailable(q.device)
    if reason is None:
        def fa4_step():
            fa4_causal_attention(q, k, v).transpose(1, 2).backward(dout)
        rows.append(("fa4 (flash-attn-4)", fa4_step))
    else:
        print(f"fa4: not run ({reason})")
    if a.flex:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        mask = create_block_mask(lambda b_, h_, qi, ki: qi >= ki, None, None, s, s, device="cuda")
        for name, mode, opts in (("flex default", None, None), ("flex autotuned", "max-autotune-no-cudagraphs", None)):
            fn = torch.compile(flex_attention, mode=mode, dynamic=False)

            def step(fn=fn, opts=opts):
                out = fn(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), block_mask=mask,
                         enable_gqa=True, kernel_options=opts)
                out.backward(dout)
            rows.append((name, step))
    for name, step in rows:
        try:
            ms = timed(step, a.iters)
        except RuntimeError as e:  # a backend that refuses the shape says so in one line
            print(f"{name:28s} refused: {str(e).splitlines()[0][:110]}")
            continue
        finally:
            q.grad = k.grad = v.grad = None
        print(f"{name:28s} {ms:8.3f} ms  {flops / ms / 1e9:6.1f} TFLOP/s   x{args.n_layers} layers: "
              f"{ms * args.n_layers:6.1f} ms")


if __name__ == "__main__":
    main()
