"""BERT parameter counts, training FLOPs per token and pipeline costs, from the args alone."""
from __future__ import annotations

import torch

from models.bert.args import ModelArgs
from models.spec import ModelShape, ParamCounts, PipelineCosts


def _meta(args: ModelArgs):
    from models.bert.model import Bert

    with torch.device("meta"):
        return Bert(args)


def _numel(module) -> int:
    return 0 if module is None else sum(p.numel() for p in module.parameters())


def param_counts(args: ModelArgs) -> ParamCounts:
    """Exact counts of the model built on the meta device; the tied MLM decoder counts once (it is the word
    table). `embedding`: the word, position and token-type tables (lookups, no matmul FLOPs)."""
    model = _meta(args)
    total = sum(p.numel() for p in model.parameters())  # parameters() yields a shared one once
    embedding = sum(_numel(getattr(model, m)) for m in ("tok_embeddings", "pos_embeddings", "type_embeddings"))
    return ParamCounts(total=total, active=total, embedding=embedding)


def flops_per_token(args: ModelArgs, seq_len: int) -> int:
    """6 per matmul weight a token passes (forward 2, backward 4): the blocks', the MLM head's and the decoder's,
    which is the word table; plus the attention scores and values over the whole (bidirectional) sequence,
    12 * n_layers * dim * seq_len. The binary head (pooler + classifier) runs once per sequence: its share per token."""
    counts = param_counts(args)
    model = _meta(args)
    binary = _numel(model.pooler) + _numel(model.binary)
    matmul = counts.total - counts.embedding - binary + args.dim * args.vocab_size
    return 6 * matmul + 12 * args.n_layers * args.dim * seq_len + (6 * binary) // seq_len


def pp_costs(args: ModelArgs, seq_len: int) -> PipelineCosts:
    """Per block 6 * its parameters + 12 * dim * seq_len; before the blocks the embedding LayerNorm (the tables are
    lookups); after them the MLM transform and the decoder (6 * dim * (dim + vocab))."""
    model = _meta(args)
    block = 6.0 * _numel(model.layers["0"]) + 12.0 * args.dim * seq_len
    binary = 6.0 * (_numel(model.pooler) + _numel(model.binary)) / seq_len
    return PipelineCosts(layers={str(i): block for i in range(args.n_layers)},
                         embedding=6.0 * _numel(model.emb_norm),
                         output=6.0 * args.dim * (args.dim + args.vocab_size) + binary)


def shape(args: ModelArgs) -> ModelShape:
    return ModelShape(dim=args.dim, n_layers=args.n_layers, kv_dim=2 * args.dim, heads=args.n_heads,
                      kv_heads=args.n_heads, qo_dim=2 * args.dim)
