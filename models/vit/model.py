"""ViT (HF's ViTForImageClassification): conv patch embedding, a class token, learned positions, pre-LN blocks
(attention with qkv bias, exact-GELU MLP), a final LayerNorm and a linear classifier on the class token.
FQNs in titanlike's style:

    patch_embed.{proj, cls_token, pos_embed},
    layers.<i>.{attention_norm, attention.{wq, wk, wv, wo}, ffn_norm, feed_forward.{w1, w2}},
    norm, first_token, head

`first_token` (no parameters) picks the class token, as BERT's pooler input: a module of its own so a plan can
gather the sequence-parallel shards there (parallelize/vit.py) while this file stays free of distributed code.
"""
from __future__ import annotations

import torch
from torch import nn

from models.vit.args import ModelArgs
from models.common.encoder import EncoderAttention, FirstToken, GeluFeedForward


class PatchEmbed(nn.Module):
    """pixels [B, C, H, W] -> [B, 1 + N, dim]: a stride-p conv per patch, the class token first, plus positions."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.proj = nn.Conv2d(args.channels, args.dim, kernel_size=args.patch_size, stride=args.patch_size)
        self.cls_token = nn.Parameter(torch.empty(1, 1, args.dim))
        self.pos_embed = nn.Parameter(torch.empty(1, args.n_tokens, args.dim))

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        h, w = pixels.shape[-2:]
        if (h, w) != (self.args.image_size,) * 2:
            # a learned table of n_tokens rows: another grid would need interpolated positions (not done)
            raise ValueError(f"images of {h}x{w}: the model was built for {self.args.image_size}x"
                             f"{self.args.image_size} (model.args.image_size)")
        x = self.proj(pixels).flatten(2).transpose(1, 2)  # [B, N, D], patches in row-major order (HF's)
        cls = self.cls_token.expand(x.shape[0], -1, -1)
        return torch.cat([cls, x], dim=1) + self.pos_embed








class TransformerBlock(nn.Module):
    """Pre-LN: h = x + attn(norm1(x)); h + ffn(norm2(h))."""

    def __init__(self, layer_id: int, args: ModelArgs):
        super().__init__()
        self.layer_id = layer_id
        self.init_std = args.init_std
        self.attention_norm = nn.LayerNorm(args.dim, eps=args.norm_eps)
        self.attention = EncoderAttention(args.dim, args.head_dim)
        self.ffn_norm = nn.LayerNorm(args.dim, eps=args.norm_eps)
        self.feed_forward = GeluFeedForward(args.dim, args.hidden_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))

    def init_weights(self) -> None:
        for norm in (self.attention_norm, self.ffn_norm):
            norm.reset_parameters()
        for lin in (self.attention.wq, self.attention.wk, self.attention.wv, self.attention.wo,
                    self.feed_forward.w1, self.feed_forward.w2):
            nn.init.trunc_normal_(lin.weight, std=self.init_std)  # HF ViT's init: truncated normal, zero biases
            nn.init.zeros_(lin.bias)


class ViT(nn.Module):
    """pixels [B, C, H, W] (normalised: HF's ViTImageProcessor gives (x / 255 - 0.5) / 0.5) -> logits
    [B, n_classes]; with n_classes = 0 there is no head and the forward returns the final hidden states [B, T, D]."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.n_layers = args.n_layers
        self.patch_embed = PatchEmbed(args)
        # String keys: a pipeline split deletes entries without renumbering, so FQNs stay those of one process.
        self.layers = nn.ModuleDict({str(i): TransformerBlock(i, args) for i in range(args.n_layers)})
        self.norm = nn.LayerNorm(args.dim, eps=args.norm_eps)
        self.first_token = FirstToken() if args.n_classes else None
        self.head = nn.Linear(args.dim, args.n_classes) if args.n_classes else None

    @torch.no_grad()
    def init_weights(self, buffer_device: torch.device | str | None = None) -> None:
        """HF's ViT init (truncated normal matrices and tables, zero biases, unit LayerNorms); each parameter whole
        through torch.nn.init, so seeded_init gives any layout the one-process weights. No buffers."""
        std = self.args.init_std
        if self.patch_embed is not None:
            nn.init.trunc_normal_(self.patch_embed.proj.weight, std=std)
            nn.init.zeros_(self.patch_embed.proj.bias)
            nn.init.trunc_normal_(self.patch_embed.cls_token, std=std)
            nn.init.trunc_normal_(self.patch_embed.pos_embed, std=std)
        for layer in self.layers.values():
            if layer is not None:
                layer.init_weights()
        if self.norm is not None:
            self.norm.reset_parameters()
        if self.head is not None:
            nn.init.trunc_normal_(self.head.weight, std=std)
            nn.init.zeros_(self.head.bias)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """Pipeline stages: without patch_embed the input is hidden states; without head the output is."""
        h = self.patch_embed(pixels) if self.patch_embed is not None else pixels
        for layer in self.layers.values():
            h = layer(h)
        if self.norm is not None:
            h = self.norm(h)
        if self.head is not None:
            h = self.head(self.first_token(h))
        return h
