"""ViT parameter counts, training FLOPs and pipeline costs, from the args alone.

The trainer's unit is the loader token; a ViT's loader row of `seq_len` values is one image (its pixel bytes), so
flops_per_token = FLOPs per image / seq_len. FLOPs per image count matmuls only (6 per weight and token it passes:
forward 2, backward 4), as torch's FLOP counter sees them (tests/unit/test_vit.py holds them to it exactly):
- blocks: every one of the T = patches + 1 tokens through q, k, v, o and the MLP; attention 12 * dim * T^2 a layer;
- patch projection: 4 per weight and patch: the images need no gradient, so its backward is the weight's alone;
- classifier: the class token only, 6 * dim * n_classes.
Biases, norms, the class token and the position table are elementwise (no matmul FLOPs).
"""
from __future__ import annotations

from models.spec import ModelShape, ParamCounts, PipelineCosts
from models.vit.args import ModelArgs


def param_counts(args: ModelArgs) -> ParamCounts:
    d, c, p = args.dim, args.channels, args.patch_size
    patch = c * p * p * d + d + d + args.n_tokens * d  # conv weight + bias, class token, positions
    block = 4 * (d * d + d) + 2 * d * args.ffn_dim + args.ffn_dim + d + 4 * d  # + two LayerNorms
    head = d * args.n_classes + args.n_classes
    total = patch + args.n_layers * block + 2 * d + head
    # embedding: lookups without matmul FLOPs — the class token and the position table (the patch conv is a matmul)
    return ParamCounts(total=total, active=total, embedding=d + args.n_tokens * d)


def _block_flops(args: ModelArgs) -> int:
    d, t = args.dim, args.n_tokens
    return 6 * t * (4 * d * d + 2 * d * args.ffn_dim) + 12 * d * t * t


def _embed_flops(args: ModelArgs) -> int:
    return 4 * args.n_patches * args.channels * args.patch_size ** 2 * args.dim


def flops_per_image(args: ModelArgs) -> int:
    """Training FLOPs (forward + backward) of one image."""
    return args.n_layers * _block_flops(args) + _embed_flops(args) + 6 * args.dim * args.n_classes


def flops_per_patch_token(args: ModelArgs) -> float:
    """Per token the blocks see (patches + the class token): the figure to compare with a text model's."""
    return flops_per_image(args) / args.n_tokens


def flops_per_token(args: ModelArgs, seq_len: int) -> float:
    """Per loader token: one image per row of seq_len values."""
    return flops_per_image(args) / seq_len


def pp_costs(args: ModelArgs, seq_len: int) -> PipelineCosts:
    return PipelineCosts(layers={str(i): _block_flops(args) / seq_len for i in range(args.n_layers)},
                         embedding=_embed_flops(args) / seq_len, output=6 * args.dim * args.n_classes / seq_len)


def shape(args: ModelArgs) -> ModelShape:
    return ModelShape(dim=args.dim, n_layers=args.n_layers, kv_dim=2 * args.dim, heads=args.n_heads,
                      kv_heads=args.n_heads, qo_dim=2 * args.dim)
