"""Llama 3 decoder as a plain nn.Module with Meta's FQNs (they are public API: parallel plans,
checkpoints and the HF adapter key on them).

Built on the meta device, parallelized from outside, then materialised with
`model.to_empty(device=...)` + `model.init_weights()`. Every parameter and buffer is (re)set by
`init_weights`, so nothing relies on module constructors' own initialisation.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from models.common.ffn import FeedForward, ffn_hidden_dim
from models.common.norms import RMSNorm
from models.common.rope import apply_rotary_emb, precompute_rope_cache
from models.common.attention import causal_attention
from models.llama3.args import ModelArgs


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.head_dim = args.head_dim
        self.repeat_kv_heads = args.repeat_kv_heads
        # The attention kernel: SDPA by default; the trainer may point it at another with the same contract
        # (models/common/fa4.py for model.attn_backend = "fa4").
        self.attention_fn = causal_attention
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor, rope_cache: torch.Tensor) -> torch.Tensor:
        bs, seqlen, _ = x.shape
        # Head counts are inferred from the projection outputs (-1), never from args: under tensor
        # parallelism wq/wk/wv are column-sharded and each rank holds only n_heads/tp heads.
        xq = self.wq(x).view(bs, seqlen, -1, self.head_dim)
        xk = self.wk(x).view(bs, seqlen, -1, self.head_dim)
        xv = self.wv(x).view(bs, seqlen, -1, self.head_dim)
        xq, xk = apply_rotary_emb(xq, xk, rope_cache)
        out = self.attention_fn(xq, xk, xv, self.repeat_kv_heads)  # [B, S, H_local, D]
        return self.wo(out.reshape(bs, seqlen, -1))

    def init_weights(self, init_std: float) -> None:
        for lin in (self.wq, self.wk, self.wv):
            nn.init.trunc_normal_(lin.weight, mean=0.0, std=0.02, a=-3 * 0.02, b=3 * 0.02)
        # wo writes into the residual stream: depth-scaled std keeps its variance bounded with depth.
        nn.init.trunc_normal_(self.wo.weight, mean=0.0, std=init_std, a=-3 * init_std, b=3 * init_std)


class TransformerBlock(nn.Module):
    def __init__(self, layer_id: int, args: ModelArgs):
        super().__init__()
        # Kept on the block so pipeline stages (which delete other layers) still init with the right depth.
        self.layer_id = layer_id
        self.attention_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.feed_forward = FeedForward(args.dim, ffn_hidden_dim(args.dim, args.multiple_of, args.ffn_dim_multiplier))
        self.weight_init_std = 0.02 / math.sqrt(2 * (layer_id + 1))

    def forward(self, x: torch.Tensor, rope_cache: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), rope_cache)
        return h + self.feed_forward(self.ffn_norm(h))

    def init_weights(self) -> None:
        self.attention_norm.reset_parameters()
        self.ffn_norm.reset_parameters()
        self.attention.init_weights(self.weight_init_std)
        self.feed_forward.init_weights(self.weight_init_std)


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.vocab_size = args.vocab_size
        self.n_layers = args.n_layers
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        # ModuleDict with string indices: pipeline splitting deletes entries without renumbering, so
        # FQNs (and checkpoints) stay identical across layouts.
        self.layers = nn.ModuleDict({str(i): TransformerBlock(i, args) for i in range(args.n_layers)})
        self.norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        # Non-persistent: derived from args, so checkpoints do not carry it and any seq_len can load them.
        self.register_buffer("rope_cache", self._rope_cache(device=None), persistent=False)

    def _rope_cache(self, device: torch.device | str | None) -> torch.Tensor:
        a = self.args
        return precompute_rope_cache(
            a.head_dim, a.max_seq_len, a.rope_theta, a.use_scaled_rope, a.rope_scaling, device=device
        )

    @torch.no_grad()
    def init_weights(self, buffer_device: torch.device | str | None = None) -> None:
        """(Re)initialise every parameter and the RoPE buffer. Safe on DTensor params (uses nn.init).

        buffer_device: where to build rope_cache (e.g. the GPU when params were materialised on CPU);
        defaults to the current device of the buffer.
        """
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
            std = self.args.dim**-0.5
            nn.init.trunc_normal_(self.output.weight, mean=0.0, std=std, a=-3 * std, b=3 * std)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [B, S] int64 -> logits [B, S, V] in the parameters' dtype.

        Pipeline stages: without tok_embeddings the input is hidden states [B, S, dim]; without
        output the return value is hidden states.
        """
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        for layer in self.layers.values():
            h = layer(h, self.rope_cache)
        if self.norm is not None:
            h = self.norm(h)
        if self.output is not None:
            h = self.output(h)
        return h
