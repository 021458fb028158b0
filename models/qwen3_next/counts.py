"""Qwen3-Next parameter counts, training FLOPs per token and pipeline costs, from the args alone (meta builds)."""
from __future__ import annotations

import math

import torch

from models.qwen3_next.args import Qwen3NextArgs
from models.spec import ModelShape, ParamCounts, PipelineCosts


def _inactive_per_moe_layer(args: Qwen3NextArgs) -> int:
    """Routed-expert parameters a token skips in one MoE layer: all experts but its top_k (SwiGLU w1, w2, w3). The
    shared expert and its gate, like the router, see every token."""
    return (args.moe.num_experts - args.moe.top_k) * 3 * args.dim * args.moe.hidden_dim if args.moe else 0


def param_counts(args: Qwen3NextArgs) -> ParamCounts:
    """Exact totals from the meta-built model; active = total less the routed experts a token skips."""
    from models.qwen3_next.model import Transformer

    with torch.device("meta"):
        model = Transformer(args)
    total = sum(p.numel() for p in model.parameters())
    n_moe = sum(args.is_moe_layer(i) for i in range(args.n_layers))
    return ParamCounts(total=total, active=total - n_moe * _inactive_per_moe_layer(args),
                       embedding=model.tok_embeddings.weight.numel())


def attention_flops(args: Qwen3NextArgs, seq_len: int) -> int:
    """Score and value matmuls of one full-attention layer per token, forward + backward: 2 matmuls x 2 FLOPs x 3
    passes = 12 per query-head channel per key (no causal discount, as the other families count it)."""
    return 12 * args.n_heads * args.head_dim * seq_len


def delta_rule_terms(args: Qwen3NextArgs, seq_len: int) -> tuple[int, int]:
    """(matmul, triangular-solve) training FLOPs per token of one Gated DeltaNet layer's chunked delta rule
    (models/common/delta_rule.py), beyond its projections and conv (which the parameters count). Per value head and
    chunk of L tokens (the sequence padded to whole chunks), forward: the within-chunk products k_beta k^T and q k^T
    (2 L^2 dk each), the reads and writes of the carried state w S, q S, k^T delta (2 L dk dv each), the
    within-chunk output attn @ delta (2 L^2 dv); matmuls cost 3x that in training. The two unit-lower solves (I + A)
    against v and k (L^2 dv and L^2 dk forward) cost ~4x in training: the backward solves again (1x) and forms the
    gradient of A by a matmul (2x)."""
    L = args.linear_chunk_size
    dk, dv, hv = args.linear_head_k_dim, args.linear_head_v_dim, args.linear_n_v_heads
    per_chunk_mm = 4 * L * L * dk + 6 * L * dk * dv + 2 * L * L * dv
    per_chunk_solve = L * L * (dk + dv)
    chunks = math.ceil(seq_len / L)
    return (3 * hv * chunks * per_chunk_mm // seq_len, 4 * hv * chunks * per_chunk_solve // seq_len)


def _mixer_flops(args: Qwen3NextArgs, full_attention: bool, seq_len: int) -> int:
    return attention_flops(args, seq_len) if full_attention else sum(delta_rule_terms(args, seq_len))


def flops_per_token(args: Qwen3NextArgs, seq_len: int) -> int:
    """Training FLOPs per token: 6 per active non-embedding parameter (the routed experts a token skips do not
    count) plus each layer's sequence-dependent mixer term: attention's scores for the full-attention layers, the
    delta rule's chunked work for the DeltaNet layers."""
    counts = param_counts(args)
    mixers = sum(_mixer_flops(args, args.is_full_attention(i), seq_len) for i in range(args.n_layers))
    return 6 * (counts.active - counts.embedding) + mixers


def pp_costs(args: Qwen3NextArgs, seq_len: int) -> PipelineCosts:
    """FLOPs per token of each piece: a block 6 x its active parameters + its mixer term; the four block kinds
    (attention or DeltaNet, MoE or dense) differ. The output projection 6 * dim * vocab; the embedding no matmul."""
    from models.qwen3_next.model import Block

    costs: dict[tuple[bool, bool], float] = {}
    for i in range(args.n_layers):
        kind = args.layer_kind(i)
        if kind not in costs:
            with torch.device("meta"):
                params = sum(p.numel() for p in Block(i, args).parameters())
            active = params - (_inactive_per_moe_layer(args) if kind[1] else 0)
            costs[kind] = 6.0 * active + _mixer_flops(args, kind[0], seq_len)
    return PipelineCosts(layers={str(i): costs[args.layer_kind(i)] for i in range(args.n_layers)},
                         embedding=0.0, output=6.0 * args.dim * args.vocab_size)


def shape(args: Qwen3NextArgs) -> ModelShape:
    """kv_dim: the keys and values per token of one full-attention layer, kv_layers those layers (the DeltaNet layers
    carry a fixed state, nothing per token to gather). Under context parallel each Gated DeltaNet layer all-to-alls
    its rule's inputs q | k | v | b | a (models/common/gated_deltanet.py's head_parts: 2 key_dim + value_dim + 2 value
    heads per token) and its output o (value_dim) back (parallelize/cp_recurrent.py)."""
    attention = sum(args.is_full_attention(i) for i in range(args.n_layers))
    key_dim, value_dim = args.linear_n_k_heads * args.linear_head_k_dim, args.linear_n_v_heads * args.linear_head_v_dim
    a2a = (2 * key_dim + value_dim + 2 * args.linear_n_v_heads) + value_dim
    return ModelShape(dim=args.dim, n_layers=args.n_layers, kv_dim=2 * args.n_kv_heads * args.head_dim,
                      moe_topk=args.moe.top_k if args.moe else 0, kv_layers=attention,
                      cp_a2a_layers=args.n_layers - attention, cp_a2a_dim=a2a, heads=args.n_heads if attention else 0,
                      kv_heads=args.n_kv_heads if attention else 0, qo_dim=2 * args.n_heads * args.head_dim)
