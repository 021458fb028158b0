"""ViT parameter counts, training FLOPs and pipeline costs, from the args alone.

The trainer's unit is the loader token; a ViT's loader row of `seq_len` values is one image (its pixel bytes), so
flops_per_token = FLOPs per image / seq_len. FLOPs per image count matmuls only (6 per weight and token it passes:
forward 2, backward 4), as torch's FLOP counter sees them (tests/unit/test_vit.py holds them to it exactly):
- blocks: every one of the T = patches (+ 1, ViT's class token) tokens through q, k, v, o and the MLP; attention
  12 * dim * T^2 a layer;
- patch projection: 4 per weight and patch: the images need no gradient, so its backward is the weight's alone;
- classifier: one pooled vector, 6 * dim * n_classes;
- SigLIP's MAP head, where the classifier reads it (pool="map"): k and v over the T tokens, q, o and the MLP on the
  one probe, attention 12 * dim * T. With pool="mean" (HF's SiglipForImageClassification) it holds parameters but
  does not run in the forward: no FLOPs.
Biases, norms (CLIP's pre-LayerNorm too), the class token, the probe, the token average and the position table are
elementwise (no matmul FLOPs); so is CLIP's quick-GELU.
"""
from __future__ import annotations

from models.spec import ModelShape, ParamCounts, PipelineCosts
from models.vit.args import ModelArgs


def param_counts(args: ModelArgs) -> ParamCounts:
    d, c, p = args.dim, args.channels, args.patch_size
    cls = d if args.class_token else 0
    # conv weight (+ bias: not CLIP's), class token, positions (+ CLIP's pre-LayerNorm)
    patch = c * p * p * d + d * args.patch_bias + cls + args.n_tokens * d + 2 * d * args.pre_norm
    block = 4 * (d * d + d) + 2 * d * args.ffn_dim + args.ffn_dim + d + 4 * d  # + two LayerNorms
    map_head = d + block - 2 * d if args.map_head else 0  # the probe + a block's attention and MLP, one LayerNorm
    head = d * args.n_classes + args.n_classes
    total = patch + args.n_layers * block + 2 * d + map_head + head
    # embedding: lookups without matmul FLOPs — the class token and the position table (the patch conv is a matmul)
    return ParamCounts(total=total, active=total, embedding=cls + args.n_tokens * d)


def _block_flops(args: ModelArgs) -> int:
    d, t = args.dim, args.n_tokens
    return 6 * t * (4 * d * d + 2 * d * args.ffn_dim) + 12 * d * t * t


def _embed_flops(args: ModelArgs) -> int:
    return 4 * args.n_patches * args.channels * args.patch_size ** 2 * args.dim


def _output_flops(args: ModelArgs) -> int:
    """The classifier, and the MAP head where the classifier reads it."""
    d, t = args.dim, args.n_tokens
    pool = 6 * t * 2 * d * d + 6 * (2 * d * d + 2 * d * args.ffn_dim) + 12 * d * t
    return 6 * d * args.n_classes + (pool if args.n_classes and args.pool == "map" else 0)


def flops_per_image(args: ModelArgs) -> int:
    """Training FLOPs (forward + backward) of one image."""
    return args.n_layers * _block_flops(args) + _embed_flops(args) + _output_flops(args)


def flops_per_patch_token(args: ModelArgs) -> float:
    """Per token the blocks see (patches + the class token, if any): the figure to compare with a text model's."""
    return flops_per_image(args) / args.n_tokens


def flops_per_token(args: ModelArgs, seq_len: int) -> float:
    """Per loader token: one image per row of seq_len values."""
    return flops_per_image(args) / seq_len


def pp_costs(args: ModelArgs, seq_len: int) -> PipelineCosts:
    return PipelineCosts(layers={str(i): _block_flops(args) / seq_len for i in range(args.n_layers)},
                         embedding=_embed_flops(args) / seq_len, output=_output_flops(args) / seq_len)


def shape(args: ModelArgs) -> ModelShape:
    return ModelShape(dim=args.dim, n_layers=args.n_layers, kv_dim=2 * args.dim, heads=args.n_heads,
                      kv_heads=args.n_heads, qo_dim=2 * args.dim)
