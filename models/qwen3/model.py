"""Qwen3 decoder (dense and MoE) as a plain nn.Module with Llama-style FQNs (public API: plans, checkpoints and the
HF adapter key on them):

    tok_embeddings, layers.<i>.{attention_norm, attention.{wq, wk, wv, wo, q_norm, k_norm}, ffn_norm,
    feed_forward.{w1, w2, w3} | moe.{router.gate, experts.{w1, w2, w3}, ...}}, norm, output

What differs from Llama: the head size is its own (q/k/v project to n_heads * head_dim, which need not be dim), q and
k are RMS-normalised per head before RoPE, and a block's FFN may be a mixture of experts (models/common/moe.py).
RoPE rotates interleaved pairs as everywhere in titanlike (models/common/rope.py); the HF adapter permutes wq/wk
rows and the q/k norm weights into HF's half-split layout.

Built on the meta device, parallelized from outside, materialised with `to_empty` + `init_weights()`.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from models.common.attention import causal_attention
from models.common.ffn import FeedForward
from models.common.moe import MoE
from models.common.norms import RMSNorm
from models.common.rope import apply_rotary_emb, precompute_rope_cache
from models.qwen3.args import Qwen3Args


def _trunc_normal(weight: torch.Tensor, std: float) -> None:
    nn.init.trunc_normal_(weight, mean=0.0, std=std, a=-3 * std, b=3 * std)


class Attention(nn.Module):
    def __init__(self, args: Qwen3Args):
        super().__init__()
        self.head_dim = args.head_dim
        self.repeat_kv_heads = args.repeat_kv_heads
        # SDPA by default; the trainer may swap in another kernel with the same contract (models/common/fa4.py).
        self.attention_fn = causal_attention
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)
        self.q_norm = RMSNorm(args.head_dim, eps=args.norm_eps)
        self.k_norm = RMSNorm(args.head_dim, eps=args.norm_eps)

    def forward(self, x: torch.Tensor, rope_cache: torch.Tensor) -> torch.Tensor:
        bs, seqlen, _ = x.shape
        # Head counts come from the projections (-1): under TP each rank holds n_heads/tp and n_kv_heads/tp heads.
        xq = self.q_norm(self.wq(x).view(bs, seqlen, -1, self.head_dim))
        xk = self.k_norm(self.wk(x).view(bs, seqlen, -1, self.head_dim))
        xv = self.wv(x).view(bs, seqlen, -1, self.head_dim)
        xq, xk = apply_rotary_emb(xq, xk, rope_cache)
        out = self.attention_fn(xq, xk, xv, self.repeat_kv_heads)  # [B, S, H_local, head_dim]
        return self.wo(out.reshape(bs, seqlen, -1))

    def init_weights(self, init_std: float) -> None:
        for lin in (self.wq, self.wk, self.wv):
            _trunc_normal(lin.weight, 0.02)
        _trunc_normal(self.wo.weight, init_std)  # writes into the residual stream: depth-scaled
        self.q_norm.reset_parameters()
        self.k_norm.reset_parameters()


class TransformerBlock(nn.Module):
    """Pre-norm block; its FFN is `feed_forward` (dense SwiGLU) or `moe`, never both (only one attribute exists,
    so plans and state dicts see the block's real modules)."""

    def __init__(self, layer_id: int, args: Qwen3Args):
        super().__init__()
        self.layer_id = layer_id  # kept on the block: pipeline stages init with the right depth
        self.moe_enabled = args.is_moe_layer(layer_id)
        self.attention_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.dim, eps=args.norm_eps)
        if self.moe_enabled:
            self.moe = MoE(args.dim, args.moe)
        else:
            self.feed_forward = FeedForward(args.dim, args.hidden_dim)
        self.weight_init_std = 0.02 / math.sqrt(2 * (layer_id + 1))

    def forward(self, x: torch.Tensor, rope_cache: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), rope_cache)
        ffn = self.moe if self.moe_enabled else self.feed_forward
        return h + ffn(self.ffn_norm(h))

    def init_weights(self) -> None:
        self.attention_norm.reset_parameters()
        self.ffn_norm.reset_parameters()
        self.attention.init_weights(self.weight_init_std)
        (self.moe if self.moe_enabled else self.feed_forward).init_weights(self.weight_init_std)


class Transformer(nn.Module):
    def __init__(self, args: Qwen3Args):
        super().__init__()
        self.args = args
        self.vocab_size = args.vocab_size
        self.n_layers = args.n_layers
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        # String keys: pipeline splitting deletes entries without renumbering, so FQNs stay the same in every layout.
        self.layers = nn.ModuleDict({str(i): TransformerBlock(i, args) for i in range(args.n_layers)})
        self.norm = RMSNorm(args.dim, eps=args.norm_eps)
        # Never tied to tok_embeddings, whatever the upstream flavor does (see flavors.py for why).
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        # Non-persistent: derived from args, so checkpoints do not carry it and any seq_len can load them.
        self.register_buffer("rope_cache", self._rope_cache(device=None), persistent=False)

    def _rope_cache(self, device: torch.device | str | None) -> torch.Tensor:
        return precompute_rope_cache(self.args.head_dim, self.args.max_seq_len, self.args.rope_theta, device=device)

    @torch.no_grad()
    def init_weights(self, buffer_device: torch.device | str | None = None) -> None:
        """(Re)initialise every parameter and buffer (nn.init: safe on DTensors). buffer_device: where to build the
        RoPE table (default: where the buffer is)."""
        buffer_device = buffer_device if buffer_device is not None else self.rope_cache.device
        self.rope_cache = self._rope_cache(device=buffer_device)
        if self.tok_embeddings is not None:
            nn.init.normal_(self.tok_embeddings.weight, mean=0.0, std=1.0)
        for layer in self.layers.values():
            if layer is not None:
                layer.init_weights()
        if self.norm is not None:
            self.norm.reset_parameters()
        if self.output is not None:
            _trunc_normal(self.output.weight, self.args.dim ** -0.5)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [B, S] -> logits [B, S, V]. A pipeline stage without tok_embeddings takes hidden states, one
        without output returns them."""
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        for layer in self.layers.values():
            h = layer(h, self.rope_cache)
        if self.norm is not None:
            h = self.norm(h)
        if self.output is not None:
            h = self.output(h)
        return h
