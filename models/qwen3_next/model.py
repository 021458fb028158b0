"""Qwen3-Next as a plain nn.Module (FQNs are public API: plans, checkpoints and the HF adapter key on them):

    tok_embeddings, layers.<i>.{attention_norm, attention.{wq, wk, wv, wo, q_norm, k_norm}
                                | linear_attn.{in_proj_qkvz, in_proj_ba, conv1d, dt_bias, A_log, norm, out_proj},
                                ffn_norm, moe.{router.gate, experts.{w1, w2, w3}, shared_expert.{w1, w2, w3},
                                               shared_expert_gate} | feed_forward.{w1, w2, w3}}, norm, output

A hybrid decoder: layer i mixes tokens with gated attention (models/common/attention.py GatedAttention: Qwen3's
attention with q/k norms, its output gated by sigmoid of a second query-sized projection, RoPE on a fraction of each
head) where args.is_full_attention(i), else with Gated DeltaNet (models/common/gated_deltanet.py); every 4th layer
is attention by default. Every RMSNorm around the blocks and on q/k is zero-centred (scale 1 + weight, weight
starting at 0; HF Qwen3NextRMSNorm); the DeltaNet's output norm is a plain gated one. The FFN is the MoE with a
shared expert whose output is scaled by sigmoid(shared_expert_gate(x)) per token (HF Qwen3NextSparseMoeBlock).

Packed documents: `doc_ids` reach the attention through the skeleton's AttnMask and the DeltaNet layers as they are
(their conv taps and recurrent state restart at every document start).

Context parallel (cp_shard, set by parallelize/cp.py): tokens are this rank's load-balanced chunks; the skeleton's
mask and RoPE rows place them in the whole sequence (the gated attention gathers the whole sequence's K/V), and each
DeltaNet's sequence_fn runs its conv + delta rule on whole sequences of a part of its key heads
(parallelize/cp_recurrent.py).
"""
from __future__ import annotations

import math

import torch
from torch import nn

from models.common.attention import GatedAttention
from models.common.decoder import Decoder
from models.common.ffn import FeedForward
from models.common.gated_deltanet import GatedDeltaNet
from models.common.masks import AttnMask
from models.common.moe import MoE, MoEArgs
from models.common.norms import ZeroCenteredRMSNorm
from models.common.rope import precompute_rope_cache
from models.qwen3_next.args import Qwen3NextArgs


class SharedExpertMoE(MoE):
    """The routed experts (models/common/moe.py) plus one shared SwiGLU expert whose output each token scales by
    sigmoid(shared_expert_gate(x)), a learned per-token scalar: HF Qwen3NextSparseMoeBlock. In the family rather than
    in MoEArgs because only this gate differs from the shared experts the common MoE already has."""

    def __init__(self, dim: int, args: MoEArgs, shared_hidden_dim: int):
        super().__init__(dim, args)
        self.shared_expert = FeedForward(dim, shared_hidden_dim)
        self.shared_expert_gate = nn.Linear(dim, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)

    def init_weights(self, init_std: float) -> None:
        super().init_weights(init_std)
        self.shared_expert.init_weights(init_std)
        nn.init.trunc_normal_(self.shared_expert_gate.weight, mean=0.0, std=0.02, a=-0.06, b=0.06)


class Block(nn.Module):
    """Pre-norm residual block: h = x + mixer(attention_norm(x)); h + ffn(ffn_norm(h)). The mixer is `attention`
    (full attention layers) or `linear_attn` (Gated DeltaNet), the FFN `moe` or `feed_forward`: only the real ones
    exist, so FQNs and plans see the block's kind."""

    def __init__(self, layer_id: int, args: Qwen3NextArgs):
        super().__init__()
        self.layer_id = layer_id
        self.full_attention, self.moe_enabled = args.layer_kind(layer_id)
        self.attention_norm = ZeroCenteredRMSNorm(args.dim, eps=args.norm_eps)
        if self.full_attention:
            self.attention = GatedAttention(args.dim, args.n_heads, args.n_kv_heads, args.head_dim,
                                            norm_eps=args.norm_eps, rotary_dim=args.rotary_dim,
                                            zero_centered_norms=True, repeat_kv_heads=args.repeat_kv_heads)
        else:
            self.linear_attn = GatedDeltaNet(args.dim, args.linear_n_k_heads, args.linear_n_v_heads,
                                             args.linear_head_k_dim, args.linear_head_v_dim,
                                             conv_kernel=args.linear_conv_kernel, norm_eps=args.norm_eps,
                                             chunk_size=args.linear_chunk_size)
        self.ffn_norm = ZeroCenteredRMSNorm(args.dim, eps=args.norm_eps)
        if self.moe_enabled:
            if args.shared_hidden_dim > 0:
                self.moe = SharedExpertMoE(args.dim, args.moe, args.shared_hidden_dim)
            else:
                self.moe = MoE(args.dim, args.moe)
        else:
            self.feed_forward = FeedForward(args.dim, args.hidden_dim)
        # For the projections writing into the residual stream: depth-scaled, as models/common/decoder.py's blocks.
        self.weight_init_std = 0.02 / math.sqrt(2 * (layer_id + 1))
        # Generation only (models/qwen3_next/cache.py sets it while attached): the DeltaNet's carried state.
        self.recurrent_cache = None

    def forward(self, x: torch.Tensor, rope_cache: torch.Tensor, attn_mask: AttnMask | None = None,
                doc_ids: torch.Tensor | None = None) -> torch.Tensor:
        h = self.attention_norm(x)
        if self.full_attention:
            h = self.attention(h, rope_cache, attn_mask=attn_mask)
        elif self.recurrent_cache is not None:
            h = self.recurrent_cache.mix(self.linear_attn, h)
        else:
            h = self.linear_attn(h, doc_ids=doc_ids)
        h = x + h
        return h + (self.moe if self.moe_enabled else self.feed_forward)(self.ffn_norm(h))

    def init_weights(self) -> None:
        self.attention_norm.reset_parameters()
        self.ffn_norm.reset_parameters()
        (self.attention if self.full_attention else self.linear_attn).init_weights(self.weight_init_std)
        (self.moe if self.moe_enabled else self.feed_forward).init_weights(self.weight_init_std)


class Transformer(Decoder):
    """The Decoder skeleton (models/common/decoder.py: embedding, layers, final norm, untied output, RoPE table,
    pipeline stages) with Qwen3-Next's blocks and a zero-centred final norm; the forward also hands doc_ids to the
    DeltaNet layers."""

    def __init__(self, args: Qwen3NextArgs):
        super().__init__(args, Block)
        self.norm = ZeroCenteredRMSNorm(args.dim, eps=args.norm_eps)  # same slot: registration order is kept

    def _rope_cache(self, device: torch.device | str | None) -> torch.Tensor:
        return precompute_rope_cache(self.args.rotary_dim, self.args.max_seq_len, self.args.rope_theta,
                                     device=device)

    def forward(self, tokens: torch.Tensor, doc_ids: torch.Tensor | None = None,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        """As Decoder.forward: tokens [B, S] (hidden states on later pipeline stages) -> logits [B, S, V];
        doc_ids [B, S_full] keep attention and the DeltaNet state within documents (the whole sequence's: under
        context parallel tokens are this rank's chunks, cp_shard, and doc_ids stay uncut); positions are RoPE's."""
        rope, mask = self._attention_inputs(tokens.shape[1], doc_ids, positions, tokens.device)
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        for layer in self.layers.values():
            h = layer(h, rope, mask, doc_ids)
        if self.norm is not None:
            h = self.norm(h)
        if self.output is not None:
            h = self.output(h)
        return h
