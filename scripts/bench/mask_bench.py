"""Masked attention alone (models/common/masks.py), forward + backward at a flavor's head shape on one GPU: what
packed documents cost against plain causal attention, and what one context-parallel rank's attention costs.

    python scripts/bench/mask_bench.py --flavor 1B --seq 32768 [--doc-len 4096] [--iters 10]

Rows:
- causal: plain causal SDPA (model.attn_backend = auto: cuDNN first on Hopper) — what a run without masks uses;
- docs flex: block-causal within documents on FlexAttention (model.mask_kernel = auto on a GPU), documents of
  exponentially distributed lengths with mean --doc-len (the embedded corpus's Python files average about 5k tokens);
  the block-mask build is timed on its own row (once per forward, shared by all layers);
- docs varlen: the same documents through torch.nn.attention.varlen (flash varlen), where this torch has it;
- cp2 rank r sdpa / flex: one rank of context parallel 2 (its two load-balanced chunks of queries over all keys),
  SDPA per chunk with a dense lower-right mask ("sdpa") or FlexAttention with the rank's query positions ("flex",
  what model.mask_kernel = auto runs on a GPU).
Figures: docs/benchmarks.md (long context).
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

import models
from models.common.backends import sdpa_context
from models.common.masks import build_mask, document_ids, load_balanced_chunks, masked_attention
from optimizer_bench import timed  # ms per call after 3 warm-up calls, synchronised


def _documents(s: int, mean_len: int, gen: torch.Generator) -> torch.Tensor:
    """[1, s] tokens with EOD (id 1) closing documents of exponentially distributed lengths."""
    tokens = torch.full((1, s), 2, dtype=torch.long)
    pos = 0
    while True:
        pos += max(1, int(torch.empty(1).exponential_(1.0 / mean_len, generator=gen).item()))
        if pos >= s:
            break
        tokens[0, pos - 1] = 1
    return tokens.cuda()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--flavor", default="1B")
    p.add_argument("--model", default=models.DEFAULT_MODEL, choices=sorted(models.MODELS))
    p.add_argument("--seq", type=int, default=32768)
    p.add_argument("--doc-len", type=int, default=4096)
    p.add_argument("--iters", type=int, default=10)
    a = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("mask_bench.py times GPU attention kernels: it needs a CUDA device")
    args = models.get_spec(a.model).flavors[a.flavor]
    hq, hkv, d, s = args.n_heads, args.n_kv_heads or args.n_heads, args.dim // args.n_heads, a.seq
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, s, h, d, device=dev, dtype=torch.bfloat16).requires_grad_() for h in (hq, hkv, hkv))
    doc_ids = document_ids(_documents(s, a.doc_len, gen), 1)
    n_docs = int(doc_ids.max()) + 1
    causal_flops = 4 * s * s * hq * d / 2 * 3.5  # causal half of the scores; backward 2.5x forward
    print(f"{a.flavor}: seq {s}, {hq} query / {hkv} KV heads, head dim {d}; {n_docs} documents (mean {s // n_docs} "
          f"tokens); torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}")
    sdpa = sdpa_context("auto", dev)
    rows = []

    def causal():
        with sdpa():
            out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                 is_causal=True, enable_gqa=True)
            out.sum().backward()
    rows.append(("causal (cuDNN first)", causal))

    doc_mask = build_mask(None, doc_ids, s, "flex", dev)
    rows.append(("docs: flex block-mask build", lambda: build_mask(None, doc_ids, s, "flex", dev)))
    rows.append(("docs flex", lambda: masked_attention(q, k, v, doc_mask).sum().backward()))
    try:
        from torch.nn.attention.varlen import varlen_attn

        lengths = torch.bincount(doc_ids[0])
        cu = F.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)
        longest = int(lengths.max())

        def varlen():
            kk, vv = (t[0].repeat_interleave(hq // hkv, dim=1) for t in (k, v))  # flash varlen: equal head counts
            out = varlen_attn(q[0], kk, vv, cu, cu, longest, longest, window_size=(-1, 0))
            out.sum().backward()
        rows.append(("docs varlen (flash, repeated KV)", varlen))
    except (ImportError, TypeError) as e:
        print(f"docs varlen: not run ({e})")

    for rank in range(2):
        chunks = load_balanced_chunks(s, rank, 2)
        qi = torch.cat([torch.arange(x, y, device=dev) for x, y in chunks])
        q_local = q.detach()[:, qi].requires_grad_()
        for kernel in ("sdpa", "flex"):
            m = build_mask(chunks, None, s, kernel, dev)

            def cp_step(m=m, q_local=q_local):
                with sdpa():
                    masked_attention(q_local, k, v, m).sum().backward()
            rows.append((f"cp2 rank {rank} {kernel}", cp_step))

    for name, step in rows:
        try:
            ms = timed(step, a.iters)
        except (RuntimeError, ValueError, TypeError) as e:
            print(f"{name:34s} refused: {str(e).splitlines()[0][:110]}")
            continue
        finally:
            q.grad = k.grad = v.grad = None
        share = "" if "build" in name else f"  {causal_flops / ms / 1e9:6.1f} causal-equivalent TFLOP/s"
        print(f"{name:34s} {ms:8.3f} ms{share}   x{args.n_layers} layers: {ms * args.n_layers:7.1f} ms")


if __name__ == "__main__":
    main()
