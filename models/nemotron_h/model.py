"""The hybrid Mamba-2 model skeleton (NemotronH; models/mamba2 is the all-Mamba case): a stack of pre-norm residual
blocks, each with ONE mixer, as in HF NemotronH / Mamba2 and Megatron's hybrid model:

    tok_embeddings, layers.<i>.{norm, mixer}, norm, output

    x = x + mixer(norm(x))        mixer by the layer's pattern letter (args.pattern()):
      "M" Mamba-2 (models/common/mamba2.py; FQNs in_proj, conv1d, dt_bias, A_log, D, norm, out_proj: transformers';
          in_proj's rows and conv1d's channels group-major, so tensor parallel shards whole groups)
      "*" attention without positional encoding (NemotronH's has no RoPE): wq, wk, wv, wo, grouped KV heads
      "-" squared-ReLU MLP: w1 (HF up_proj), w2 (down_proj)
      "E" mixture of experts (models/common/moe.py's MoE by args.moe): router.gate (HF gate.weight), expert_bias (HF
          gate.e_score_correction_bias), experts.w1/w2 (up/down, squared ReLU), shared_experts.w1/w2, and with a
          latent width latent_in/latent_out (HF fc1_latent_proj / fc2_latent_proj)

Packed documents: doc_ids [B, S] restart the Mamba state and conv window at every document and confine attention to
it (models/common/masks.py). Context parallel (cp_shard, set by parallelize/cp.py): tokens are this rank's chunks,
attention masks place them in the whole sequence, each Mamba mixer's sequence_fn scans whole sequences. `positions`
is accepted (the trainer and generation pass it) and unused: nothing here is positional. Built on the meta device,
parallelized from outside, materialised with to_empty + init_weights().
"""
from __future__ import annotations

import math

import torch
from torch import nn

from models.common.attention import causal_attention
from models.common.ffn import ReLU2FeedForward as ReLU2MLP  # NemotronH's "-" layers: w2(relu(w1 x)^2)
from models.common.mamba2 import Mamba2Mixer
from models.common.masks import AttnMask, forward_mask
from models.common.moe import MoE
from models.common.norms import RMSNorm
from models.nemotron_h.args import ATTENTION, MAMBA, MLP, MOE, HybridArgs


def _trunc_normal(weight: torch.Tensor, std: float) -> None:
    nn.init.trunc_normal_(weight, mean=0.0, std=std, a=-3 * std, b=3 * std)


class Attention(nn.Module):
    """Causal grouped-query attention with no positional encoding (NemotronH's "*" layers). The kernel is
    `attention_fn` (models/common/attention.py's contract), so document masks and generation's KV cache work as in
    the decoder families."""

    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, head_dim: int, bias: bool = False,
                 repeat_kv_heads: bool = False):
        super().__init__()
        self.head_dim, self.repeat_kv_heads = head_dim, repeat_kv_heads
        self.attention_fn = causal_attention
        self.wq = nn.Linear(dim, n_heads * head_dim, bias=bias)
        self.wk = nn.Linear(dim, n_kv_heads * head_dim, bias=bias)
        self.wv = nn.Linear(dim, n_kv_heads * head_dim, bias=bias)
        self.wo = nn.Linear(n_heads * head_dim, dim, bias=bias)

    def forward(self, x: torch.Tensor, attn_mask: AttnMask | None = None) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, -1, self.head_dim)
        k = self.wk(x).view(b, s, -1, self.head_dim)
        v = self.wv(x).view(b, s, -1, self.head_dim)
        return self.wo(self.attention_fn(q, k, v, self.repeat_kv_heads, attn_mask).reshape(b, s, -1))

    def init_weights(self, init_std: float) -> None:
        for lin in (self.wq, self.wk, self.wv):
            _trunc_normal(lin.weight, 0.02)
        _trunc_normal(self.wo.weight, init_std)  # writes into the residual stream: depth-scaled
        for lin in (self.wq, self.wk, self.wv, self.wo):
            if lin.bias is not None:
                nn.init.zeros_(lin.bias)


def build_mixer(kind: str, args: HybridArgs) -> nn.Module:
    if kind == MAMBA:
        return Mamba2Mixer(args.dim, args.mamba_n_heads, args.mamba_head_dim, state_size=args.ssm_state_size,
                           n_groups=args.n_groups, conv_kernel=args.conv_kernel, chunk_size=args.chunk_size,
                           dt_limit=args.mixer_dt_limit(), bias=args.mamba_bias, conv_bias=args.conv_bias,
                           norm_eps=args.norm_eps, dt_init_range=(args.dt_min, args.dt_max),
                           dt_init_floor=args.dt_floor)
    if kind == ATTENTION:
        return Attention(args.dim, args.n_heads, args.n_kv_heads, args.head_dim, bias=args.attention_bias,
                         repeat_kv_heads=args.repeat_kv_heads)
    if kind == MLP:
        return ReLU2MLP(args.dim, args.hidden_dim, bias=args.mlp_bias)
    if kind == MOE and getattr(args, "moe", None) is not None:
        return MoE(args.dim, args.moe)
    # The spec's check names the key and the fix first; this guards a hand-built model.
    raise ValueError(f"hybrid_override_pattern letter {kind!r} is not implemented here; use 'M', '*', '-' or 'E' "
                     f"(with model.args.moe)")


class HybridBlock(nn.Module):
    """x + mixer(norm(x)). `kind` is the pattern letter. `cache` is None in training; generation's cache
    (models/nemotron_h/cache.py) sets it on Mamba blocks to carry their state across forwards."""

    def __init__(self, layer_id: int, kind: str, args: HybridArgs):
        super().__init__()
        self.layer_id, self.kind = layer_id, kind
        self.norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.mixer = build_mixer(kind, args)
        # For the projections writing into the residual stream: depth-scaled, as models/common/decoder.py's blocks.
        self.weight_init_std = 0.02 / math.sqrt(2 * (layer_id + 1))
        self.cache = None

    def forward(self, x: torch.Tensor, attn_mask: AttnMask | None = None,
                doc_ids: torch.Tensor | None = None) -> torch.Tensor:
        h = self.norm(x)
        if self.kind == MAMBA:
            out = self.mixer(h, doc_ids) if self.cache is None else self.cache(self.mixer, h)
        elif self.kind == ATTENTION:
            out = self.mixer(h, attn_mask)
        else:
            out = self.mixer(h)
        return x + out

    def init_weights(self) -> None:
        self.norm.reset_parameters()
        self.mixer.init_weights(self.weight_init_std)


class HybridModel(nn.Module):
    """tokens [B, S] -> logits [B, S, V]. `tok_embeddings`, `norm`, `output` may be None (pipeline stages): the
    forward then takes / returns hidden states. The output projection is never tied to the embedding (HF imports
    untie: models/nemotron_h/hf.py)."""

    def __init__(self, args: HybridArgs):
        super().__init__()
        self.args = args
        self.vocab_size, self.n_layers = args.vocab_size, args.n_layers
        pattern = args.pattern()
        if len(pattern) != args.n_layers:  # the spec's check says it first, with the fix
            raise ValueError(f"hybrid_override_pattern has {len(pattern)} layers but n_layers={args.n_layers}")
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        # String keys: pipeline splitting deletes entries without renumbering, so FQNs stay across layouts.
        self.layers = nn.ModuleDict({str(i): HybridBlock(i, kind, args) for i, kind in enumerate(pattern)})
        self.norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.has_attention = ATTENTION in pattern
        self.mask_kernel = "sdpa"  # the masked-attention kernel for packed documents (the trainer sets it)
        # models.common.masks.CPShard (rank, degree, method) when context parallel holds this rank's load-balanced
        # chunks of every sequence (set by parallelize/cp.py, which also swaps the Mamba mixers' sequence_fn); None:
        # the whole sequence.
        self.cp_shard: tuple | None = None

    @torch.no_grad()
    def init_weights(self, buffer_device: torch.device | str | None = None) -> None:
        """(Re)initialise every parameter (no buffers). Modules another pipeline stage holds are None."""
        if self.tok_embeddings is not None:
            nn.init.normal_(self.tok_embeddings.weight, mean=0.0, std=1.0)
        for layer in self.layers.values():
            layer.init_weights()
        if self.norm is not None:
            self.norm.reset_parameters()
        if self.output is not None:
            _trunc_normal(self.output.weight, self.args.dim ** -0.5)

    def forward(self, tokens: torch.Tensor, doc_ids: torch.Tensor | None = None,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        """doc_ids [B, S_full]: every token's document in the whole sequence (non-decreasing along a row,
        models.common.masks.document_ids). Under context parallel tokens are this rank's chunks (cp_shard)."""
        mask = None
        if self.has_attention:  # one mask for every attention layer
            _, mask = forward_mask(self.cp_shard, tokens.shape[1], doc_ids, self.mask_kernel, tokens.device)
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        for layer in self.layers.values():
            h = layer(h, mask, doc_ids)
        if self.norm is not None:
            h = self.norm(h)
        if self.output is not None:
            h = self.output(h)
        return h


class NemotronHModel(HybridModel):
    """nemotron_h's model class: the skeleton itself, named so that a Mamba2 model (models/mamba2's subclass of the
    skeleton) is no instance of it (models.spec_of and isinstance lookups tell the families apart)."""
