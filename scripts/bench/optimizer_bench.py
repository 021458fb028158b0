"""The optimizer step alone, over a model flavor's parameter shapes (fp32, random gradients): time per step and the
memory bandwidth it reaches, for fused / foreach / compiled AdamW, fused clipping (`grad_scale`) and the grad norm,
and for the master-weight AdamW (bf16 weights and gradients, fp32 moments, the masters' low 16 bits: 26 B/param).

    python scripts/bench/optimizer_bench.py --flavor 1B [--vocab 128256] [--iters 10] [--compiled]

AdamW moves 28 bytes per fp32 parameter (reads param, grad, two moments; writes param and moments); a plain device
copy is printed as the roofline. Figures: docs/benchmarks.md (master weights and the optimizer update).
"""
from __future__ import annotations

import argparse
import dataclasses
import time

import torch

import models


def timed(step, iters: int) -> float:
    """ms per call, after 3 warm-up calls."""
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(iters):
        step()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / iters * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--flavor", default="1B")
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--compiled", action="store_true", help="also torch.compile the step (a long first compile)")
    p.add_argument("--model", default=models.DEFAULT_MODEL, choices=sorted(models.MODELS), help="model family")
    a = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("optimizer_bench.py measures GPU memory bandwidth: it needs a CUDA device")
    spec = models.get_spec(a.model)
    with torch.device("meta"):
        model = spec.model_cls(dataclasses.replace(spec.flavors[a.flavor], vocab_size=a.vocab))
    shapes = [p.shape for p in model.parameters()]
    n = sum(s.numel() for s in shapes)

    def params():
        ps = [torch.nn.Parameter(torch.randn(s, device="cuda") * 0.02) for s in shapes]
        for q in ps:
            q.grad = torch.randn_like(q) * 1e-3
        return ps

    def row(name: str, ms: float) -> None:
        print(f"{name:42s} {ms:8.2f} ms  {28 * n / ms / 1e9:6.2f} TB/s at 28 B/param")

    print(f"{a.flavor}: {n / 1e9:.3f}B fp32 parameters in {len(shapes)} tensors; AdamW moves {28 * n / 1e9:.1f} GB")
    for kw in ({"fused": True}, {"foreach": True}):
        opt = torch.optim.AdamW(params(), lr=1e-4, weight_decay=0.1, **kw)
        row(f"AdamW {kw}", timed(opt.step, a.iters))
        if "fused" in kw:
            opt.grad_scale = torch.tensor(2.0, device="cuda")  # what titanlike's fused clipping passes
            row("AdamW fused + grad_scale (fused clipping)", timed(opt.step, a.iters))
        grads = [q.grad for group in opt.param_groups for q in group["params"]]
        del opt
    row("_foreach_norm (gradient norm)", timed(lambda: torch._foreach_norm(grads), a.iters))
    if a.compiled:
        opt = torch.optim.AdamW(params(), lr=torch.tensor(1e-4, device="cuda"), weight_decay=0.1, foreach=True,
                                capturable=True)
        step = torch.compile(opt.step)
        t = time.perf_counter()
        step()
        torch.cuda.synchronize()
        print(f"compiled step: first call {time.perf_counter() - t:.1f} s")
        row("AdamW compiled (foreach, capturable)", timed(step, a.iters))
        del opt
    master_weights(spec, a)
    x, y = torch.empty(n, device="cuda"), torch.empty(n, device="cuda")
    ms = timed(lambda: y.copy_(x), a.iters)
    print(f"{'device copy (roofline)':42s} {ms:8.2f} ms  {8 * n / ms / 1e9:6.2f} TB/s")


def master_weights(spec, a) -> None:
    """titanlike/optim/master_weights.py's compiled update (reads bf16 grads, writes bf16 weights) and its fp32 grad
    norm."""
    from titanlike.config.sections import Optimizer
    from titanlike.optim.master_weights import build_master_weight_adamw

    with torch.device("meta"):
        model = spec.model_cls(dataclasses.replace(spec.flavors[a.flavor], vocab_size=a.vocab))
    model.to_empty(device="cuda")
    with torch.no_grad():
        for q in model.parameters():
            q.normal_(0, 0.02)
    t = time.perf_counter()
    opt = build_master_weight_adamw(model, Optimizer(lr=1e-4), compile=True, accumulate_fp32=False)
    for q in model.parameters():
        q.grad = torch.randn_like(q) * 1e-3
    opt.step()
    torch.cuda.synchronize()
    print(f"master-weight step: first call (compile) {time.perf_counter() - t:.1f} s")
    n = sum(q.numel() for q in model.parameters())
    def clip_and_step(o=opt):  # (bound now: `opt` is deleted below to free the GPU for the next case)
        o.clip_grad_norm_(1.0)
        o.step()

    for name, ms in (("master-weight AdamW (compiled, bf16 grads)", timed(opt.step, a.iters)),
                     ("  + grad norm and fused clipping", timed(clip_and_step, a.iters))):
        print(f"{name:42s} {ms:8.2f} ms  {26 * n / ms / 1e9:6.2f} TB/s at 26 B/param")
    del opt, model


if __name__ == "__main__":
    main()
