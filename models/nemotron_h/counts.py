"""Parameter counts, training FLOPs per token, pipeline costs and shape of the hybrid Mamba-2 families, from the args
alone (shared by nemotron_h and mamba2).

FLOPs are what the training step computes: 6 per weight per token (forward 2, backward 4) plus the sequence-mixing
work that has no weight:
  - MoE ("E"): 6 per active weight: the router, the top_k routed experts a token goes through, the shared experts and
    the latent projections (the k-way weighted sum and the routing itself are not counted);
  - attention ("*"): QK^T and PV over all S keys (no causal discount, as the other families): 12 x n_heads x head_dim
    x S per token;
  - Mamba-2 ("M"), models/common/ssd.py's chunked scan with chunk L (the sequence padded to a multiple of L), per
    token and forward: C.B^T scores 2 L N G, scores x (dt x) 2 L H P, each chunk's state 2 H P N, the carried state's
    reading 2 H P N; x3 for training (but for a single chunk, where no state reaches another chunk and the
    backward of those two state einsums is never run). The short conv is a weight (its 6 per weight per token is its
    real work); the gates, norms and the state's decay are elementwise and not counted.
"""
from __future__ import annotations

import math

from models.nemotron_h.args import ATTENTION, MAMBA, MLP, MOE, HybridArgs
from models.spec import ModelShape, ParamCounts, PipelineCosts


def moe_params(args: HybridArgs) -> tuple[int, int]:
    """(total, active) parameters of one "E" mixer (models/common/moe.py's MoE): the router, the routed experts (top_k
    of them active), the shared experts and the latent projections; the expert bias is a buffer."""
    m, d = args.moe, args.dim
    mats = 2 if m.expert_act == "relu2" else 3
    width = m.latent_dim or d
    expert = mats * width * m.hidden_dim
    shared = mats * d * (m.shared_hidden_dim or m.num_shared_experts * m.hidden_dim) if m.num_shared_experts else 0
    dense = m.num_experts * d + shared + 2 * d * m.latent_dim
    return dense + m.num_experts * expert, dense + m.top_k * expert


def mixer_params(args: HybridArgs, kind: str, active: bool = False) -> int:
    """Parameters of one block of `kind` (its pre-norm included); active: those a token uses (MoE: top_k experts)."""
    d = args.dim
    if kind == MAMBA:
        h, p, n, g = args.mamba_n_heads, args.mamba_head_dim, args.ssm_state_size, args.n_groups
        inner, conv_dim = h * p, h * p + 2 * g * n
        proj = d * (inner + conv_dim + h) + inner * d + (inner + conv_dim + h + d) * args.mamba_bias
        conv = conv_dim * args.conv_kernel + conv_dim * args.conv_bias
        mixer = proj + conv + 3 * h + inner  # + dt_bias, A_log, D, the gated norm's weight
    elif kind == ATTENTION:
        q, kv = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
        mixer = 2 * d * q + 2 * d * kv + (q + 2 * kv + d) * args.attention_bias
    elif kind == MLP:
        mixer = 2 * d * args.hidden_dim + (args.hidden_dim + d) * args.mlp_bias
    elif kind == MOE:
        mixer = moe_params(args)[1 if active else 0]
    else:
        raise ValueError(f"hybrid_override_pattern letter {kind!r} is not implemented; use 'M', '*', '-' or 'E'")
    return mixer + d


def param_counts(args: HybridArgs) -> ParamCounts:
    """Exact: embedding + each block + final norm + (untied) output. active: the MoE layers' top_k routed experts
    only (everything else counts)."""
    embedding, top = args.vocab_size * args.dim, args.dim + args.dim * args.vocab_size
    total = embedding + sum(mixer_params(args, k) for k in args.pattern()) + top
    active = embedding + sum(mixer_params(args, k, active=True) for k in args.pattern()) + top
    return ParamCounts(total=total, active=active, embedding=embedding)


def mixing_flops(args: HybridArgs, kind: str, seq_len: int) -> float:
    """Training FLOPs per token of a block's weightless sequence mixing (module docstring)."""
    if kind == ATTENTION:
        return 12 * args.n_heads * args.head_dim * seq_len
    if kind == MAMBA:
        h, p, n, g, L = args.mamba_n_heads, args.mamba_head_dim, args.ssm_state_size, args.n_groups, args.chunk_size
        per_token = 2 * L * n * g + 2 * L * h * p + 4 * h * p * n
        padded = math.ceil(seq_len / L) * L  # the scan computes the padding of the last chunk too
        # One chunk: no state crosses a chunk boundary, so autograd skips the state einsums' backward (6 H P N).
        skipped = 6 * h * p * n if padded == L else 0
        return (3 * per_token - skipped) * padded / seq_len
    return 0


def layer_flops(args: HybridArgs, kind: str, seq_len: int) -> float:
    return 6.0 * mixer_params(args, kind, active=True) + mixing_flops(args, kind, seq_len)


def flops_per_token(args: HybridArgs, seq_len: int) -> int:
    """Training FLOPs per token: every block's (weights and mixing), the final norm's gain and the output projection
    (the embedding is a lookup)."""
    blocks = sum(layer_flops(args, k, seq_len) for k in args.pattern())
    return int(round(blocks + 6 * (args.dim + args.dim * args.vocab_size)))


def pp_costs(args: HybridArgs, seq_len: int) -> PipelineCosts:
    """Each block's training FLOPs per token: Mamba, attention, MLP and MoE blocks differ a lot, so the split weighs
    them."""
    return PipelineCosts(layers={str(i): layer_flops(args, k, seq_len) for i, k in enumerate(args.pattern())},
                         embedding=0.0, output=6.0 * args.dim * args.vocab_size)


def shape(args: HybridArgs) -> ModelShape:
    """kv_dim: keys plus values per token of an attention layer (0 without attention: nothing to gather), kv_layers
    the attention layers; moe_topk: the routed experts per token of the "E" layers (0 without). Under context
    parallel each Mamba-2 layer all-to-alls its scan's inputs x | B | C | dt (models/common/mamba2.py's head_parts:
    inner + 2 G N + H per token) and its output y (inner) back (parallelize/cp_recurrent.py); the copies of a group's
    B and C that parts of one group's heads each carry (cp above the groups a TP rank holds) are not counted."""
    pattern = args.pattern()
    kv = 2 * args.n_kv_heads * args.head_dim if ATTENTION in pattern else 0
    topk = args.moe.top_k if MOE in pattern else 0
    inner = args.mamba_n_heads * args.mamba_head_dim
    a2a = (inner + 2 * args.n_groups * args.ssm_state_size + args.mamba_n_heads) + inner
    return ModelShape(dim=args.dim, n_layers=args.n_layers, kv_dim=kv, moe_topk=topk,
                      kv_layers=pattern.count(ATTENTION), cp_a2a_layers=pattern.count(MAMBA), cp_a2a_dim=a2a,
                      heads=args.n_heads if kv else 0, kv_heads=args.n_kv_heads if kv else 0,
                      qo_dim=2 * args.n_heads * args.head_dim if kv else 0)
