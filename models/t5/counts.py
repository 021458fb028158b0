"""T5 parameter counts, training FLOPs per token and pipeline costs, from the args alone.

"Per token" is per encoder token (a training row's length, seq_len, which is what the loader and the throughput
metrics count). The decoder runs over the span-corruption targets, whose length the objective fixes from seq_len
(decoder_len: models/t5/objective.py's, its padding included, since it is computed), so its share is scaled by
decoder_len / seq_len."""
from __future__ import annotations

import torch

from models.spec import ModelShape, ParamCounts, PipelineCosts
from models.t5.args import ModelArgs
from models.t5.objective import span_sizes


def _meta(args: ModelArgs):
    from models.t5.model import T5

    with torch.device("meta"):
        return T5(args)


def _split(module) -> tuple[int, int]:
    """(matmul weights, 1-D weights) of a module."""
    ps = list(module.parameters())
    return sum(p.numel() for p in ps if p.ndim > 1), sum(p.numel() for p in ps if p.ndim == 1)


def param_counts(args: ModelArgs) -> ParamCounts:
    """Exact counts of the model built on the meta device (a tied head counts once). `embedding`: the word table and
    the two relative-position bias tables or the learned position table (lookups, no matmul FLOPs)."""
    model = _meta(args)
    total = sum(p.numel() for p in model.parameters())
    tables = (model.tok_embeddings, model.pos_embeddings, model.encoder_rel_bias, model.decoder_rel_bias)
    embedding = sum(p.numel() for m in tables if m is not None for p in m.parameters())
    return ParamCounts(total=total, active=total, embedding=embedding)


def pp_costs(args: ModelArgs, seq_len: int) -> PipelineCosts:
    """FLOPs per encoder token of each piece: 6 per matmul weight a token passes (forward 2, backward 4) plus the
    attention's scores and values, 12 * inner * (keys) per query; 1-D weights (norm gains) 6 each, once per token
    as the other families count them. Encoder blocks: S queries over S keys. Decoder blocks: T queries, over T keys
    (causal: the full [T, T] scores are computed, as SDPA does) and over the S encoder outputs, whose keys and
    values each decoder block projects once (S tokens). `embedding`: the encoder's final norm (between the stacks);
    `output`: the head over T tokens."""
    s, t = seq_len, decoder_len(args, seq_len)
    model = _meta(args)
    enc_mm, enc_1d = _split(model.encoder_layers["0"])
    dec_mm, dec_1d = _split(model.decoder_layers["0"])
    enc = 6 * enc_mm + 6 * enc_1d + 12 * args.inner_dim * s
    cross_kv = 2 * args.dim * args.inner_dim  # the cross-attention's keys and values: over the S encoder outputs
    dec = (6 * (dec_mm - cross_kv) * t + 12 * args.inner_dim * t * (t + s)) / s + 6 * cross_kv + 6 * dec_1d
    layers = {str(i): float(enc) for i in range(args.n_layers)}
    layers.update({str(args.n_layers + i): float(dec) for i in range(args.n_decoder_layers)})
    return PipelineCosts(layers=layers, embedding=6.0 * _norm_params(args),
                         output=6.0 * args.dim * args.vocab_size * t / s)


def _norm_params(args: ModelArgs) -> int:
    """One final norm's parameters: the gain, and LayerNorm's bias (Megatron's variant)."""
    return args.dim * (2 if args.norm == "layernorm" else 1)


def flops_per_token(args: ModelArgs, seq_len: int) -> float:
    """Training FLOPs per encoder token: the pieces of pp_costs plus the decoder's final norm (and a head's bias). A
    float: the decoder's share is a ratio of lengths."""
    costs = pp_costs(args, seq_len)
    head_bias = args.vocab_size if args.output_bias else 0  # (Megatron's tied head has its own bias)
    return sum(costs.layers.values()) + costs.embedding + costs.output + 6.0 * (_norm_params(args) + head_bias)


def decoder_len(args: ModelArgs, seq_len: int) -> int:
    return span_sizes(args, seq_len).padded


def shape(args: ModelArgs) -> ModelShape:
    # The encoder's width per token and attention layer (context parallel is refused; the planner reads it for
    # its memory model); both stacks count as layers.
    return ModelShape(dim=args.dim, n_layers=args.n_layers + args.n_decoder_layers, kv_dim=2 * args.inner_dim,
                      heads=args.n_heads, kv_heads=args.n_heads, qo_dim=2 * args.inner_dim)
