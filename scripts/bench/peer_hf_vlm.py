"""LLaVA's peer (benchmark.py --model llava --peer hf; peer_hf.py hands `--model llava` here): transformers'
LlavaForConditionalGeneration built from the HF config titanlike's adapter writes for the flavor
(models/llava/hf.py: for 1B-siglip a SiglipVisionConfig so400m/14-384 tower, feature layer -1, strategy "full", and
the 1B decoder's text_config), random init, bf16 weights, fused AdamW, SDPA attention, `torch.compile` of the model
where --compile.enable; nothing downloaded.

    python scripts/bench/peer_hf.py 1B-siglip --model llava --images 4 --vocab 128256 --training.seq_len 4096 \
        --training.local_batch_size 2 --training.steps 20 --compile.enable

Inputs, the shape titanlike's mock_image_text rows have (titanlike/data/image_text.py): per row `seq` token ids,
random below the image token (the vocabulary's last id), with --images runs of image_tokens placeholders (each image
expanded to the tower's patch count, as HF's processor expands `<image>`) starting at k x seq / K; pixel_values
[B x K, 3, side, side]; labels the ids with the placeholders ignored (-100). Drawn on the device each step.

Unit: decoder tokens (batch x seq per step, placeholders included), as benchmark.py counts titanlike's. FLOPs per
token: titanlike's count for the same args (the decoder at seq + K images' tower and projector, spread over seq:
scripts/bench/bench_vision.py flops_per_unit). HF's tower also runs SigLIP's post_layernorm (no matmul: uncounted).
"""
from __future__ import annotations

import dataclasses

import torch

import models
from bench_vision import flops_per_unit


def llava_args(flavor: str, vocab: int, seq: int, images: int):
    spec = models.get_spec("llava")
    args = spec.flavors[flavor]
    return spec, dataclasses.replace(args, vocab_size=vocab or args.vocab_size, max_seq_len=seq,
                                     images_per_row=images)


def build(flavor: str, vocab: int, seq: int, images: int, device: str):
    """(model, titanlike's args) for the flavor at this run's vocabulary, length and images per row."""
    from transformers import AutoConfig, LlavaForConditionalGeneration

    spec, args = llava_args(flavor, vocab, seq, images)
    if images * args.image_tokens >= seq:
        raise SystemExit(f"peer_hf: {images} images x {args.image_tokens} placeholders do not fit in "
                         f"--training.seq_len {seq}; lower --images or raise the length")
    cfg = dict(spec.hf.hf_config(args, torch.bfloat16, max_position_embeddings=seq))
    for k in ("architectures", "model_type", "torch_dtype"):
        cfg.pop(k, None)
    config = AutoConfig.for_model("llava", **cfg)
    torch.manual_seed(0)
    with torch.device(device):
        model = LlavaForConditionalGeneration._from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa")
    return model.train(), args


def vlm_step(a, device: str):
    """(model, step_fn(step) -> loss, tokens per step, FLOPs per token) for llava at the run's shape."""
    model, args = build(a.flavor, a.vocab, a.seq, a.images, device)
    if a.ac == "full":
        model.gradient_checkpointing_enable()
    fwd = torch.compile(model) if a.compile else model
    gen = torch.Generator(device=device).manual_seed(0)
    b, s, k, n = a.batch, a.seq, a.images, args.image_tokens
    side, image = args.vision.image_size, args.image_token
    runs = torch.zeros(s, dtype=torch.bool, device=device)
    for j in range(k):  # the placeholder runs where titanlike's mock rows put them
        runs[j * s // k:j * s // k + n] = True

    def step_fn(step):
        ids = torch.randint(0, image, (b, s), device=device, generator=gen).masked_fill(runs, image)
        pixels = torch.randn(b * k, args.vision.channels, side, side, device=device, generator=gen,
                             dtype=torch.bfloat16)
        return fwd(input_ids=ids, pixel_values=pixels, labels=ids.masked_fill(runs, -100), use_cache=False).loss

    case = {"model": "llava", "flavor": a.flavor, "images": k, "seq": s}
    return model, step_fn, b * s, flops_per_unit(case, args.vocab_size)
