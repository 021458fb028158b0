"""ViT (HF's ViTForImageClassification): conv patch embedding, a class token, learned positions, pre-LN blocks
(attention with qkv bias, exact-GELU MLP), a final LayerNorm and a linear classifier on the class token.
The same model with ModelArgs' SigLIP options is HF's SiglipVisionModel (no class token, tanh-GELU, the MAP head
`map_head` after the final LayerNorm) and, with pool="mean", SiglipForImageClassification; with its CLIP options,
HF's CLIPVisionModel (patch conv without bias, a LayerNorm on the embeddings `patch_embed.norm`, quick-GELU, the
final LayerNorm on the pooled class token only) and, with pool="mean_patches", CLIPForImageClassification.
FQNs in titanlike's style:

    patch_embed.{proj, cls_token (ViT, CLIP), pos_embed, norm (CLIP only)},
    layers.<i>.{attention_norm, attention.{wq, wk, wv, wo}, ffn_norm, feed_forward.{w1, w2}},
    norm, map_head.{probe, attention.{wq, wk, wv, wo}, norm, feed_forward.{w1, w2}} (SigLIP),
    first_token | mean_tokens (no parameters), head

`first_token` (no parameters) picks the class token, as BERT's pooler input: a module of its own so a plan can
gather the sequence-parallel shards there (parallelize/vit.py) while this file stays free of distributed code.
"""
from __future__ import annotations

import torch
from torch import nn

from models.vit.args import ModelArgs
from models.common.encoder import EncoderAttention, FirstToken, GeluFeedForward, MeanTokens


class PatchEmbed(nn.Module):
    """pixels [B, C, H, W] -> [B, T, dim]: a stride-p conv per patch (an image size that is no multiple of the
    patch drops the last rows and columns, as HF's valid conv: SigLIP so400m's 384 / 14), the class token first
    (ViT, CLIP), plus positions, then CLIP's pre-LayerNorm (`norm`, HF's pre_layrnorm). The norm lives here, not
    on the model: the output is then HF's hidden_states[0] (what LLaVA's feature layers count from), and the
    plans' and pipeline's input module stays one (`patch_embed`)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.proj = nn.Conv2d(args.channels, args.dim, kernel_size=args.patch_size, stride=args.patch_size,
                              bias=args.patch_bias)
        self.cls_token = nn.Parameter(torch.empty(1, 1, args.dim)) if args.class_token else None
        self.pos_embed = nn.Parameter(torch.empty(1, args.n_tokens, args.dim))
        # built only when enabled: ViT and SigLIP checkpoints keep their keys
        self.norm = nn.LayerNorm(args.dim, eps=args.norm_eps) if args.pre_norm else None

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        h, w = pixels.shape[-2:]
        if (h, w) != (self.args.image_size,) * 2:
            # a learned table of n_tokens rows: another grid would need interpolated positions (not done)
            raise ValueError(f"images of {h}x{w}: the model was built for {self.args.image_size}x"
                             f"{self.args.image_size} (model.args.image_size)")
        # Pixels arrive fp32 from the loader; bf16 weights (master-weight training) need bf16 input to the conv.
        x = self.proj(pixels.to(self.proj.weight.dtype)).flatten(2).transpose(1, 2)  # [B, N, D], HF's patch order
        if self.cls_token is not None:
            x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)
        x = x + self.pos_embed
        return self.norm(x) if self.norm is not None else x


class AttentionPool(nn.Module):
    """SigLIP's multihead attention pooling (HF SiglipMultiheadAttentionPoolingHead): h = attention(probe, tokens),
    then h + mlp(norm(h)); no norm before the attention and no residual around it, as HF. The attention is
    nn.MultiheadAttention's math (biased q/k/v/o, 1 / sqrt(head_dim)) with q, k, v as the blocks' separate Linears:
    the adapter splits HF's fused in_proj. [B, T, D] -> [B, D] (HF's pooler_output)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.probe = nn.Parameter(torch.empty(1, 1, args.dim))
        self.attention = EncoderAttention(args.dim, args.head_dim)
        self.norm = nn.LayerNorm(args.dim, eps=args.norm_eps)
        self.feed_forward = GeluFeedForward(args.dim, args.hidden_dim, args.approximate)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        x = self.attention(self.probe.expand(h.shape[0], -1, -1), kv=h)
        return (x + self.feed_forward(self.norm(x)))[:, 0]


class TransformerBlock(nn.Module):
    """Pre-LN: h = x + attn(norm1(x)); h + ffn(norm2(h))."""

    def __init__(self, layer_id: int, args: ModelArgs):
        super().__init__()
        self.layer_id = layer_id
        self.init_std = args.init_std
        self.attention_norm = nn.LayerNorm(args.dim, eps=args.norm_eps)
        self.attention = EncoderAttention(args.dim, args.head_dim)
        self.ffn_norm = nn.LayerNorm(args.dim, eps=args.norm_eps)
        self.feed_forward = GeluFeedForward(args.dim, args.hidden_dim, args.approximate)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))

    def init_weights(self) -> None:
        _init_attention_mlp(self.attention_norm, self.ffn_norm, self.attention, self.feed_forward, self.init_std)


def _init_attention_mlp(norm1: nn.LayerNorm, norm2: nn.LayerNorm, attention: EncoderAttention,
                        feed_forward: GeluFeedForward, std: float) -> None:
    """HF ViT's init, kept for SigLIP too (nothing needs HF's SigLIP init): unit LayerNorms, truncated normal
    matrices, zero biases."""
    for norm in (norm1, norm2):
        norm.reset_parameters()
    for lin in (attention.wq, attention.wk, attention.wv, attention.wo, feed_forward.w1, feed_forward.w2):
        nn.init.trunc_normal_(lin.weight, std=std)
        nn.init.zeros_(lin.bias)


class ViT(nn.Module):
    """pixels [B, C, H, W] (normalised: args.normalise, (x / 255 - mean) / std) -> logits
    [B, n_classes]; with n_classes = 0 there is no head and the forward returns the final hidden states [B, T, D]
    (HF's last_hidden_state: normed for ViT and SigLIP, the last block's output for CLIP; `pooled` gives HF's
    pooler_output: SigLIP's MAP head, CLIP's normed class token)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.n_layers = args.n_layers
        self.patch_embed = PatchEmbed(args)
        # String keys: a pipeline split deletes entries without renumbering, so FQNs stay those of one process.
        self.layers = nn.ModuleDict({str(i): TransformerBlock(i, args) for i in range(args.n_layers)})
        self.norm = nn.LayerNorm(args.dim, eps=args.norm_eps)
        self.map_head = AttentionPool(args) if args.map_head else None
        self.first_token = FirstToken() if args.n_classes and args.pool == "cls" else None
        self.mean_tokens = MeanTokens(int(args.pool == "mean_patches")) if args.n_classes and args.pool in (
            "mean", "mean_patches") else None
        self.head = nn.Linear(args.dim, args.n_classes) if args.n_classes else None

    @torch.no_grad()
    def init_weights(self, buffer_device: torch.device | str | None = None) -> None:
        """HF's ViT init (truncated normal matrices and tables, zero biases, unit LayerNorms); each parameter whole
        through torch.nn.init, so seeded_init gives any layout the one-process weights. No buffers."""
        std = self.args.init_std
        if self.patch_embed is not None:
            nn.init.trunc_normal_(self.patch_embed.proj.weight, std=std)
            if self.patch_embed.proj.bias is not None:
                nn.init.zeros_(self.patch_embed.proj.bias)
            if self.patch_embed.norm is not None:
                self.patch_embed.norm.reset_parameters()
            if self.patch_embed.cls_token is not None:
                nn.init.trunc_normal_(self.patch_embed.cls_token, std=std)
            nn.init.trunc_normal_(self.patch_embed.pos_embed, std=std)
        for layer in self.layers.values():
            if layer is not None:
                layer.init_weights()
        if self.norm is not None:
            self.norm.reset_parameters()
        if self.map_head is not None:
            m = self.map_head
            nn.init.trunc_normal_(m.probe, std=std)
            _init_attention_mlp(m.norm, m.norm, m.attention, m.feed_forward, std)
        if self.head is not None:
            nn.init.trunc_normal_(self.head.weight, std=std)
            nn.init.zeros_(self.head.bias)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """Pipeline stages: without patch_embed the input is hidden states; without head the output is."""
        h = self.patch_embed(pixels) if self.patch_embed is not None else pixels
        for layer in self.layers.values():
            h = layer(h)
        if self.norm is not None and self.args.final_norm == "tokens":  # (CLIP's norms the pooled class token)
            h = self.norm(h)
        if self.head is not None:
            h = self.head(self._pool(h))
        return h

    def _pool(self, h: torch.Tensor) -> torch.Tensor:
        """What the classifier reads (args.pool): the class token, the token average, or the MAP head's output."""
        if self.first_token is not None:
            return self.first_token(h)
        return self.mean_tokens(h) if self.mean_tokens is not None else self.map_head(h)

    def pooled(self, last_hidden_state: torch.Tensor) -> torch.Tensor:
        """HF's pooler_output from the forward's output at n_classes = 0: SiglipVisionModel's MAP head, or
        CLIPVisionModel's post_layernorm on the class token."""
        if self.args.final_norm == "cls":
            return self.norm(last_hidden_state[:, 0])
        if self.map_head is None:
            raise ValueError("model.args.map_head=false: this model has no pooling head")
        return self.map_head(last_hidden_state)
