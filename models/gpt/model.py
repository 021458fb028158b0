"""GPT-2 / GPT-3 decoder (Megatron's and HF GPT-2's architecture) with titanlike's Llama-style FQNs:

    tok_embeddings, pos_embeddings, layers.<i>.{attention_norm, attention.{wq, wk, wv, wo}, ffn_norm,
    feed_forward.{w1, w2}}, norm, output

Learned absolute positions, pre-LayerNorm with bias, tanh-approximated GELU MLP (HF's gelu_new), biases on every
projection but the output, and `output.weight` tied to `tok_embeddings.weight` by default (args.tie_embeddings).
`tied_parameters` names the tie as FQN pairs (source, copy): a pipeline split that puts the two on different stages
gives the copy's stage its own parameter, initialised as the source and kept equal by summing the two gradients
(parallelize/tied.py, as Megatron does with the word embeddings of the first and last stage).

The skeleton is models/common/decoder.py: the pipeline-stage conventions (modules set to None are skipped), the mask
for packed documents and context parallel, and the `rope_cache` buffer -- which here holds position *ids*
(arange(max_seq_len)), so the decoder's row selection (document positions, context-parallel chunks) yields each
token's position id for `pos_embeddings`.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from models.common.attention import causal_attention
from models.common.decoder import Decoder, DecoderBlock
from models.common.masks import AttnMask
from models.gpt.args import ModelArgs


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.head_dim = args.head_dim
        self.repeat_kv_heads = False  # no grouped KV heads; kept for the attention_fn contract
        self.attn_dropout = args.attn_dropout
        # The kernel (models/common/attention.py's contract); context parallel and fa4 replace it.
        self.attention_fn = causal_attention
        self.wq = nn.Linear(args.dim, args.dim, bias=True)
        self.wk = nn.Linear(args.dim, args.dim, bias=True)
        self.wv = nn.Linear(args.dim, args.dim, bias=True)
        self.wo = nn.Linear(args.dim, args.dim, bias=True)

    def forward(self, x: torch.Tensor, attn_mask: AttnMask | None = None) -> torch.Tensor:
        bs, seqlen, _ = x.shape
        # -1 heads: under tensor parallel each rank holds n_heads / tp of them.
        xq = self.wq(x).view(bs, seqlen, -1, self.head_dim)
        xk = self.wk(x).view(bs, seqlen, -1, self.head_dim)
        xv = self.wv(x).view(bs, seqlen, -1, self.head_dim)
        if self.attn_dropout and self.training:
            if attn_mask is not None or self.attention_fn is not causal_attention:
                raise ValueError("model attn_dropout > 0 is implemented for plain causal SDPA only (no document "
                                 "masking, context parallel or other kernels); set attn_dropout=0")
            out = F.scaled_dot_product_attention(xq.transpose(1, 2), xk.transpose(1, 2), xv.transpose(1, 2),
                                                 is_causal=True, dropout_p=self.attn_dropout).transpose(1, 2)
        else:
            out = self.attention_fn(xq, xk, xv, self.repeat_kv_heads, attn_mask)
        return self.wo(out.reshape(bs, seqlen, -1))

    def init_weights(self, init_std: float, out_std: float) -> None:
        for lin in (self.wq, self.wk, self.wv):
            nn.init.normal_(lin.weight, mean=0.0, std=init_std)
        nn.init.normal_(self.wo.weight, mean=0.0, std=out_std)
        for lin in (self.wq, self.wk, self.wv, self.wo):
            nn.init.zeros_(lin.bias)


class FeedForward(nn.Module):
    """w2(gelu_tanh(w1 x)), both with bias."""

    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=True)
        self.w2 = nn.Linear(hidden_dim, dim, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.gelu(self.w1(x), approximate="tanh"))

    def init_weights(self, init_std: float, out_std: float) -> None:
        nn.init.normal_(self.w1.weight, mean=0.0, std=init_std)
        nn.init.normal_(self.w2.weight, mean=0.0, std=out_std)
        nn.init.zeros_(self.w1.bias)
        nn.init.zeros_(self.w2.bias)


def _layer_norm(args: ModelArgs) -> nn.LayerNorm:
    return nn.LayerNorm(args.dim, eps=args.norm_eps, elementwise_affine=True, bias=True)


class TransformerBlock(DecoderBlock):
    """h = x + drop(attention(attention_norm(x))); h + drop(feed_forward(ffn_norm(h))), LayerNorms with bias."""

    def __init__(self, layer_id: int, args: ModelArgs):
        super().__init__(layer_id, args.dim, args.norm_eps, Attention(args), FeedForward(args.dim, args.hidden_dim),
                         moe=False)
        # Replaces the skeleton's RMSNorms in place (same FQNs, same registration order).
        self.attention_norm = _layer_norm(args)
        self.ffn_norm = _layer_norm(args)
        self.init_std = args.init_std
        # Megatron's scaled_init_method_normal: the projections into the residual stream, by total depth.
        self.weight_init_std = args.init_std / math.sqrt(2.0 * args.n_layers)
        self.dropout = nn.Dropout(args.hidden_dropout)

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None,
                attn_mask: AttnMask | None = None) -> torch.Tensor:
        h = x + self.dropout(self.attention(self.attention_norm(x), attn_mask=attn_mask))
        return h + self.dropout(self.feed_forward(self.ffn_norm(h)))

    def init_weights(self) -> None:
        self.attention_norm.reset_parameters()  # weight 1, bias 0
        self.ffn_norm.reset_parameters()
        self.attention.init_weights(self.init_std, self.weight_init_std)
        self.feed_forward.init_weights(self.init_std, self.weight_init_std)


class Transformer(Decoder):
    def __init__(self, args: ModelArgs):
        super().__init__(args, TransformerBlock)
        self.norm = _layer_norm(args)
        self.pos_embeddings = nn.Embedding(args.max_seq_len, args.dim)
        # Functional dropout (no module): every top-level module must belong to a pipeline stage.
        self.hidden_dropout = args.hidden_dropout
        if args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.tied = args.tie_embeddings
        # (source FQN, copy FQN): one parameter here; on a pipeline stage without the source the copy is its own
        # parameter, initialised (seeded_init) and updated (parallelize/tied.py) as the source.
        self.tied_parameters: list[tuple[str, str]] = (
            [("tok_embeddings.weight", "output.weight")] if args.tie_embeddings else [])

    def _rope_cache(self, device: torch.device | str | None) -> torch.Tensor:
        """Position ids [max_seq_len] (int64): the decoder selects their rows as it would RoPE's."""
        return torch.arange(self.args.max_seq_len, dtype=torch.int64, device=device)

    def tie_weights(self) -> None:
        """Point output.weight at tok_embeddings.weight again (to_empty, TP's distribute and a checkpoint load may
        leave two parameters); a no-op untied or on a pipeline stage without both."""
        if self.tied and self.tok_embeddings is not None and self.output is not None \
                and self.output.weight is not self.tok_embeddings.weight:
            self.output.weight = self.tok_embeddings.weight

    @torch.no_grad()
    def init_weights(self, buffer_device: torch.device | str | None = None) -> None:
        buffer_device = buffer_device if buffer_device is not None else self.rope_cache.device
        self.rope_cache = self._rope_cache(device=buffer_device)
        self.tie_weights()
        std = self.args.init_std
        if self.tok_embeddings is not None:
            nn.init.normal_(self.tok_embeddings.weight, mean=0.0, std=std)
        if self.pos_embeddings is not None:
            nn.init.normal_(self.pos_embeddings.weight, mean=0.0, std=std)
        for layer in self.layers.values():
            if layer is not None:
                layer.init_weights()
        if self.norm is not None:
            self.norm.reset_parameters()
        if self.output is not None and self.output.weight is not getattr(self.tok_embeddings, "weight", None):
            # Untied, or a pipeline stage's copy of the tied embedding: drawn as the embedding (under seeded_init
            # the copy draws from the embedding's FQN, tied_parameters, so it starts equal to the first stage's).
            nn.init.normal_(self.output.weight, mean=0.0, std=std)

    def forward(self, tokens: torch.Tensor, doc_ids: torch.Tensor | None = None,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        """tokens [B, S] -> logits [B, S, V] (see Decoder.forward: doc_ids, positions, context parallel and pipeline
        stages alike)."""
        seqlen = tokens.shape[1]
        pos, mask = self._attention_inputs(seqlen, doc_ids, positions, tokens.device)
        if self.tok_embeddings is not None:
            if pos.dim() == 1:
                if seqlen > pos.shape[0]:
                    raise ValueError(f"sequence of {seqlen} tokens is longer than the position table "
                                     f"(max_seq_len={pos.shape[0]})")
                pos = pos[:seqlen]
            h = self.tok_embeddings(tokens) + self.pos_embeddings(pos)
            if self.hidden_dropout:
                h = F.dropout(h, self.hidden_dropout, self.training)
        else:
            h = tokens
        for layer in self.layers.values():
            h = layer(h, None, mask)
        if self.norm is not None:
            h = self.norm(h)
        if self.output is not None:
            h = self.output(h)
        return h
