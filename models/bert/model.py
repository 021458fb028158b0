"""BERT (HF's BertForPreTraining / BertForMaskedLM, Megatron's BERT) and RoBERTa (HF's RobertaForMaskedLM): a
bidirectional encoder with a masked-LM head, FQNs in titanlike's style:

    tok_embeddings, pos_embeddings, type_embeddings, emb_norm,
    layers.<i>.{attention_norm, attention.{wq, wk, wv, wo}, ffn_norm, feed_forward.{w1, w2}},
    norm, first_token, pooler, binary, mlm_dense, mlm_norm, output

Post-LN blocks (the original; `emb_norm` after the embedding sum, no final `norm`) or pre-LN (args.pre_ln,
Megatron's: no `emb_norm`, a final `norm`); the absent one is None, as modules of other pipeline stages are, so the
plans and FSDP's groups skip it. The MLM head is dense + exact GELU + LayerNorm, then `output` (its own bias) whose
weight is `tok_embeddings.weight` (one Parameter; `tied_parameters` names the pair as GPT does). `pooler` + `binary`
(the next-sentence / sentence-order head) exist only with args.binary_head; the forward then returns (MLM logits,
binary logits [B, 2]). The pooler's input is taken by `first_token`, a module without parameters, so a plan can give
it the whole sequence (parallelize/bert.py gathers it from the sequence-parallel shards there) while this file stays
free of distributed code.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from models.bert.args import ModelArgs
from models.common.encoder import EncoderAttention, FirstToken, GeluFeedForward


def _layer_norm(args: ModelArgs) -> nn.LayerNorm:
    return nn.LayerNorm(args.dim, eps=args.norm_eps)

class TransformerBlock(nn.Module):
    """Post-LN: h = norm1(x + attn(x)); norm2(h + ffn(h)). Pre-LN: h = x + attn(norm1(x)); h + ffn(norm2(h))."""

    def __init__(self, layer_id: int, args: ModelArgs):
        super().__init__()
        self.layer_id = layer_id
        self.pre_ln = args.pre_ln
        self.attention_norm = _layer_norm(args)
        self.attention = EncoderAttention(args.dim, args.head_dim)
        self.ffn_norm = _layer_norm(args)
        self.feed_forward = GeluFeedForward(args.dim, args.hidden_dim, args.gelu_approximate)
        self.dropout = args.hidden_dropout
        self.init_std = args.init_std
        # Megatron scales the projections into the residual stream by depth (pre-LN); HF BERT does not (post-LN
        # renormalises the stream after every branch).
        self.out_std = args.init_std / math.sqrt(2.0 * args.n_layers) if args.pre_ln else args.init_std

    def _drop(self, x: torch.Tensor) -> torch.Tensor:
        return F.dropout(x, self.dropout, self.training) if self.dropout else x

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        if self.pre_ln:
            h = x + self._drop(self.attention(self.attention_norm(x), mask))
            return h + self._drop(self.feed_forward(self.ffn_norm(h)))
        h = self.attention_norm(x + self._drop(self.attention(x, mask)))
        return self.ffn_norm(h + self._drop(self.feed_forward(h)))

    def init_weights(self) -> None:
        for norm in (self.attention_norm, self.ffn_norm):
            norm.reset_parameters()
        for lin, std in ((self.attention.wq, self.init_std), (self.attention.wk, self.init_std),
                         (self.attention.wv, self.init_std), (self.attention.wo, self.out_std),
                         (self.feed_forward.w1, self.init_std), (self.feed_forward.w2, self.out_std)):
            nn.init.normal_(lin.weight, mean=0.0, std=std)
            nn.init.zeros_(lin.bias)


class Bert(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.vocab_size = args.vocab_size
        self.n_layers = args.n_layers
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.pos_embeddings = nn.Embedding(args.n_positions, args.dim)
        self.type_embeddings = nn.Embedding(args.type_vocab_size, args.dim) if args.type_vocab_size else None
        self.emb_norm = None if args.pre_ln else _layer_norm(args)
        # String keys: a pipeline split deletes entries without renumbering, so FQNs stay those of one process.
        self.layers = nn.ModuleDict({str(i): TransformerBlock(i, args) for i in range(args.n_layers)})
        self.norm = _layer_norm(args) if args.pre_ln else None
        self.first_token = FirstToken() if args.binary_head else None
        self.pooler = nn.Linear(args.dim, args.dim) if args.binary_head else None
        self.binary = nn.Linear(args.dim, 2) if args.binary_head else None
        self.mlm_dense = nn.Linear(args.dim, args.dim)
        self.mlm_norm = _layer_norm(args)
        self.output = nn.Linear(args.dim, args.vocab_size)
        self.output.weight = self.tok_embeddings.weight
        self.tied = True
        self.tied_parameters: list[tuple[str, str]] = [("tok_embeddings.weight", "output.weight")]

    def tie_weights(self) -> None:
        """Point output.weight at tok_embeddings.weight again (to_empty, TP's distribute and a checkpoint load may
        leave two parameters); a no-op on a pipeline stage without both."""
        if self.tok_embeddings is not None and self.output is not None \
                and self.output.weight is not self.tok_embeddings.weight:
            self.output.weight = self.tok_embeddings.weight

    @torch.no_grad()
    def init_weights(self, buffer_device: torch.device | str | None = None) -> None:
        """HF BERT's init: normal(init_std) matrices and tables, zero biases, unit LayerNorms. No buffers."""
        self.tie_weights()
        std = self.args.init_std
        for emb in (self.tok_embeddings, self.pos_embeddings, self.type_embeddings):
            if emb is not None:
                nn.init.normal_(emb.weight, mean=0.0, std=std)
        for layer in self.layers.values():
            if layer is not None:
                layer.init_weights()
        for norm in (self.emb_norm, self.norm, self.mlm_norm):
            if norm is not None:
                norm.reset_parameters()
        for lin in (self.pooler, self.binary, self.mlm_dense):
            if lin is not None:
                nn.init.normal_(lin.weight, mean=0.0, std=std)
                nn.init.zeros_(lin.bias)
        if self.output is not None:
            nn.init.zeros_(self.output.bias)
            if self.output.weight is not getattr(self.tok_embeddings, "weight", None):
                # a pipeline stage's copy of the tied table: drawn from the embedding's FQN under seeded_init
                nn.init.normal_(self.output.weight, mean=0.0, std=std)

    def _positions(self, tokens: torch.Tensor, positions) -> torch.Tensor:
        off, seqlen = self.args.position_offset, tokens.shape[1]
        if positions is not None:  # restarted per packed document (data.reset_position_ids)
            return positions + off
        if off:  # RoBERTa (HF's rule): count the tokens that are not padding; padding sits at padding_idx
            m = (tokens != self.args.pad_token_id).long()
            return torch.cumsum(m, dim=1) * m + self.args.pad_token_id
        if seqlen > self.args.max_seq_len:
            raise ValueError(f"sequence of {seqlen} tokens is longer than the position table "
                             f"(max_seq_len={self.args.max_seq_len})")
        return torch.arange(seqlen, device=tokens.device)

    @staticmethod
    def _mask(attention_mask, doc_ids, seqlen: int) -> torch.Tensor | None:
        """bool [B, 1, S|1, S]: keys that are not padding, in the query's own document."""
        mask = None
        if doc_ids is not None:
            mask = (doc_ids[:, :, None] == doc_ids[:, None, :])[:, None]
        if attention_mask is not None:
            keys = attention_mask.bool()[:, None, None, :]
            mask = keys if mask is None else mask & keys
        return mask

    def forward(self, tokens: torch.Tensor, token_types: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None, doc_ids: torch.Tensor | None = None,
                positions: torch.Tensor | None = None):
        """tokens [B, S] -> MLM logits [B, S, V] (with args.binary_head: and the binary logits [B, 2]).
        token_types [B, S] (default 0); attention_mask [B, S] 1 = token, 0 = padding (HF's); doc_ids [B, S]:
        attention stays within packed documents; positions [B, S]: per-document position ids. Pipeline stages:
        without tok_embeddings the input is hidden states; without output the return value is hidden states."""
        seqlen = tokens.shape[1]
        mask = self._mask(attention_mask, doc_ids, seqlen)
        if self.tok_embeddings is not None:
            pos = self._positions(tokens, positions)
            h = self.tok_embeddings(tokens) + self.pos_embeddings(pos)
            if self.type_embeddings is not None:
                h = h + self.type_embeddings(token_types if token_types is not None else torch.zeros_like(tokens))
            if self.emb_norm is not None:
                h = self.emb_norm(h)
            if self.args.hidden_dropout:
                h = F.dropout(h, self.args.hidden_dropout, self.training)
        else:
            h = tokens
        for layer in self.layers.values():
            h = layer(h, mask)
        if self.norm is not None:
            h = self.norm(h)
        binary = None
        if self.binary is not None:
            binary = self.binary(torch.tanh(self.pooler(self.first_token(h))))
        if self.mlm_dense is not None:
            h = self.mlm_norm(F.gelu(self.mlm_dense(h)))
        if self.output is not None:
            h = self.output(h)
        return h if binary is None else (h, binary)
