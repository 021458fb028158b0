"""ViT's peer (benchmark.py --model vit --peer timm): what ViT users pick, timm's VisionTransformer, trained the way
timm's own train.py does with --amp: fp32 weights under bf16 autocast (--bf16-weights: the weights themselves in
bf16), fused AdamW, `torch.compile` of the model where --compile.enable, SDPA attention (timm's fused_attn), on
random images and labels of the run's batch drawn on the device (no loader, nothing downloaded).

    python scripts/bench/peer_timm.py L/16 --training.local_batch_size 256 --training.steps 20 --compile.enable

The model: `timm.create_model(NAME, pretrained=False)` for the flavors timm names (B/16 vit_base_patch16_224, L/16
vit_large_patch16_224, H/14 vit_huge_patch14_224), else a VisionTransformer of the flavor's shape (the debug flavor,
for CPU tests). Both have what titanlike's ViT has: a class token, learned positions, q/k/v biases, exact GELU,
pre-LN blocks and a linear classifier on the class token, so the FLOPs match.

Unit: images. Prints torchtitan-style lines ("step: N loss: X memory: Y GiB tps: IMAGES/s tflops: T mfu: M%") with
FLOPs per image from titanlike's count for the same shape (models.vit.flops_per_image), so MFU compares with
titanlike's. Without timm installed: one line saying so, exit status 2.
"""
from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F

import models  # the repository on PYTHONPATH, as every bench script expects
from peer_flags import add_run_flags  # scripts/bench, beside this script
from peer_hf import timed_loop  # the timed step loop and its log line, shared with the transformers peer

TIMM_NAMES = {"B/16": "vit_base_patch16_224", "L/16": "vit_large_patch16_224", "H/14": "vit_huge_patch14_224"}


def build(flavor: str, device: str, bf16_weights: bool):
    """(timm model, titanlike's args of the flavor)."""
    import timm
    from timm.models.vision_transformer import VisionTransformer

    args = models.get_spec("vit").flavors[flavor]
    if not args.class_token or args.act != "gelu":
        raise SystemExit(f"peer_timm: flavor {flavor!r} is a SigLIP tower; timm's peer runs the ViT flavors "
                         f"({', '.join(f for f, a in models.get_spec('vit').flavors.items() if a.class_token)})")
    torch.manual_seed(0)
    if flavor in TIMM_NAMES:
        model = timm.create_model(TIMM_NAMES[flavor], pretrained=False, num_classes=args.n_classes)
    else:  # the same architecture at the flavor's shape (timm's ViT defaults: class token, qkv bias, exact GELU)
        model = VisionTransformer(img_size=args.image_size, patch_size=args.patch_size, embed_dim=args.dim,
                                  depth=args.n_layers, num_heads=args.n_heads, mlp_ratio=args.ffn_dim / args.dim,
                                  num_classes=args.n_classes)
    model = model.to(device, dtype=torch.bfloat16 if bf16_weights else torch.float32).train()
    return model, args


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("flavor")
    add_run_flags(p, batch=64, steps=20)  # (--training.seq_len is accepted and unused: a row is one image)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--bf16-weights", action="store_true", help="bf16 weights and optimizer instead of autocast")
    a, unknown = p.parse_known_args()
    if unknown:
        print(f"peer_timm: ignoring {unknown}", flush=True)
    try:
        import timm
    except ImportError:
        print("peer_timm: timm is not installed (pip install timm; the GPU machine has it)", flush=True)
        sys.exit(2)
    model, args = build(a.flavor, a.device, a.bf16_weights)
    print(f"peer_timm: timm {timm.__version__}, {type(model).__name__} {TIMM_NAMES.get(a.flavor, a.flavor)}, "
          f"{sum(p.numel() for p in model.parameters()):,} parameters, "
          f"{'bf16 weights' if a.bf16_weights else 'fp32 weights + bf16 autocast'}", flush=True)
    if a.ac == "full":
        model.set_grad_checkpointing(True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    fwd = torch.compile(model) if a.compile else model
    gen = torch.Generator(device=a.device).manual_seed(0)
    dtype = torch.bfloat16 if a.bf16_weights else torch.float32
    shape = (a.batch, args.channels, args.image_size, args.image_size)
    autocast = torch.autocast(a.device, dtype=torch.bfloat16, enabled=not a.bf16_weights)

    def step_fn(step):
        images = torch.randn(shape, device=a.device, generator=gen, dtype=dtype)
        labels = torch.randint(0, args.n_classes, (a.batch,), device=a.device, generator=gen)
        with autocast:
            return F.cross_entropy(fwd(images).float(), labels)

    from models.vit import flops_per_image

    timed_loop(step_fn, model, opt, a, a.batch, float(flops_per_image(args)), "cuda" if a.device == "cuda" else "cpu")


if __name__ == "__main__":
    main()
