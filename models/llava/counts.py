"""LLaVA parameter counts, FLOPs and pipeline costs: the language model's (per token, its family's formulas) plus the
images' (tower + projector, matmuls only, as models/vit/counts.py) spread over the loader row: a row of seq_len
values carries images_per_row image slots (objective.py) and T = seq_len - slots' pixels tokens, so FLOPs per loader
value = (T x the decoder's per token at length T + images) / seq_len. The image share is what full slots cost; rows
with fewer images cost less. (Before 2026-11-26 the decoder's attention term was taken at seq_len, pixels included:
an overcount that grows with the image size.)"""
from __future__ import annotations

import torch

from models.llava.args import ModelArgs
from models.spec import ModelShape, ParamCounts, PipelineCosts


def _spec(args: ModelArgs):
    from models.llava import families

    return families.language(args.language_family)


def param_counts(args: ModelArgs) -> ParamCounts:
    """Exact counts of the model as built (meta). transformers' LlavaForConditionalGeneration holds more: the tower's
    blocks past the feature layer, its final LayerNorm and ViTModel's pooler (SigLIP: post_layernorm), which never reach
    the logits."""
    from models.llava.model import Llava

    with torch.device("meta"):
        model = Llava(args)
    total = sum(p.numel() for p in model.parameters())
    pe = model.vision.patch_embed
    cls = pe.cls_token.numel() if pe.cls_token is not None else 0  # a SigLIP tower has none
    emb = model.tok_embeddings.weight.numel() + cls + pe.pos_embed.numel()
    return ParamCounts(total=total, active=total, embedding=emb)


def flops_per_image(args: ModelArgs) -> int:
    """Training FLOPs of one image: the tower's used blocks on every token, the patch conv (no input gradient: 4 per
    weight and patch), the projector on the image's placeholders (6 per weight)."""
    v, t = args.vision, args.vision.n_tokens
    block = 6 * t * (4 * v.dim * v.dim + 2 * v.dim * v.ffn_dim) + 12 * v.dim * t * t
    conv = 4 * v.n_patches * v.channels * v.patch_size ** 2 * v.dim
    proj = 6 * args.image_tokens * (v.dim * args.dim + args.dim * args.dim)
    return args.vision_layers_used * block + conv + proj


def text_len(args: ModelArgs, seq_len: int) -> int:
    """The decoder's tokens in a loader row of seq_len values: what follows the image slots. A row too short to hold
    the slots (the model contract's short token rows) counts as all text."""
    head = args.images_per_row * args.pixels
    return seq_len - head if seq_len > head else seq_len


def flops_per_token(args: ModelArgs, seq_len: int) -> float:
    """Per loader value. The decoder's attention grows with its own length (the text), not with the row's pixel
    slots: its per-token figure is taken at text_len and spread over the row, as the images' are."""
    t = text_len(args, seq_len)
    text = _spec(args).flops_per_token(args.text_args, t)
    return (text * t / seq_len if t != seq_len else text) + args.images_per_row * flops_per_image(args) / seq_len


def pp_costs(args: ModelArgs, seq_len: int) -> PipelineCosts:
    t = text_len(args, seq_len)
    c = _spec(args).pp_costs(args.text_args, t)
    share = t / seq_len if t != seq_len else 1  # (1: integers stay integers where nothing is spread)
    return PipelineCosts(layers={k: v * share for k, v in c.layers.items()},
                         embedding=c.embedding * share + args.images_per_row * flops_per_image(args) / seq_len,
                         output=c.output * share)


def shape(args: ModelArgs) -> ModelShape:
    return _spec(args).shape(args.text_args)
