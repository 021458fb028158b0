"""T5 (HF's T5ForConditionalGeneration: v1.1 and the original), an encoder-decoder, FQNs in titanlike's style:

    tok_embeddings, encoder_rel_bias, decoder_rel_bias (or pos_embeddings: Megatron's variant, below),
    encoder_layers.<i>.{attention_norm, attention.{wq, wk, wv, wo}, ffn_norm, feed_forward.{w1, w2[, w3]}},
    encoder_norm,
    decoder_layers.<i>.{attention_norm, attention.*, cross_norm, cross_attention.{wq, wk, wv, wo}, ffn_norm,
                        feed_forward.*},
    decoder_norm, output

Pre-norm blocks with T5's RMS LayerNorm (no mean, no bias), no biases anywhere, attention logits unscaled (T5 folds
the 1/sqrt(d) into the query's init). Each stack adds a learned bias per (relative-distance bucket, head) to its
self-attention logits, one table per stack shared by its blocks (HF keeps it in block 0); cross-attention has none.

Megatron-Core's T5Model (args.position_embedding = "learned" and the other switches of args.py; models/t5/megatron.py)
swaps the bias tables for one absolute table `pos_embeddings` added to both stacks' embeddings, the norms for
LayerNorm with bias, adds biases to every linear and to the tied head, a plain GELU FFN and 1/sqrt(head_dim) logits.

The shared plan steps (AC, compile, FSDP) walk `model.layers`: here a read-only view of both stacks in run order,
keyed "0".."L-1" (encoder blocks first), while the checkpoint names stay `encoder_layers.<i>` / `decoder_layers.<i>`.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from models.common.norms import RMSNorm
from models.t5.args import ModelArgs


def _norm(args: ModelArgs) -> nn.Module:
    return nn.LayerNorm(args.dim, eps=args.norm_eps) if args.norm == "layernorm" else RMSNorm(args.dim, args.norm_eps)


def relative_buckets(rel: torch.Tensor, bidirectional: bool, n_buckets: int, max_distance: int) -> torch.Tensor:
    """T5's bucket of each relative distance rel = key position - query position: half the buckets exact for small
    distances, the rest log-spaced up to max_distance. Bidirectional: keys after the query get the upper half of the
    buckets; causal: only keys at or before it count (later ones fall in bucket 0, and the mask drops them)."""
    out = torch.zeros_like(rel)
    if bidirectional:
        n_buckets //= 2
        out = out + (rel > 0).long() * n_buckets
        dist = rel.abs()
    else:
        dist = (-rel).clamp(min=0)
    exact = n_buckets // 2
    far = exact + (torch.log(dist.float() / exact) / math.log(max_distance / exact) * (n_buckets - exact)).long()
    far = far.clamp(max=n_buckets - 1)
    return out + torch.where(dist < exact, dist, far)


class Attention(nn.Module):
    """Multi-head attention without logit scaling. `mask`: a float bias added to the logits ([B|1, H, Sq, Sk]: the
    relative-position bias with -inf-like entries where masked), a bool mask (True = may attend) or None. `kv`: the
    sequence keys and values come from (cross-attention: the encoder output); None: x itself."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.head_dim = args.head_dim
        self.scale = args.head_dim ** -0.5 if args.attn_scale else 1.0
        b = args.linear_bias
        self.wq = nn.Linear(args.dim, args.inner_dim, bias=b)
        self.wk = nn.Linear(args.dim, args.inner_dim, bias=b)
        self.wv = nn.Linear(args.dim, args.inner_dim, bias=b)
        self.wo = nn.Linear(args.inner_dim, args.dim, bias=b)
        # generation (models/t5/generate.py): (k, v) -> (k, v) over the whole cached sequence, or `static` with the
        # cross-attention's k, v of the encoder output
        self.kv_cache = None

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None, kv: torch.Tensor | None = None):
        bs, seqlen, _ = x.shape
        src = x if kv is None else kv
        # -1 heads: under tensor parallel each rank holds n_heads / tp of them.
        q = self.wq(x).view(bs, seqlen, -1, self.head_dim).transpose(1, 2)
        cache = self.kv_cache
        if cache is not None and cache.static:  # generation's cross-attention: the encoder's keys, projected once
            k, v = cache.k, cache.v
        else:
            k = self.wk(src).view(bs, src.shape[1], -1, self.head_dim).transpose(1, 2)
            v = self.wv(src).view(bs, src.shape[1], -1, self.head_dim).transpose(1, 2)
            if cache is not None:
                k, v = cache(k, v)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale)
        return self.wo(out.transpose(1, 2).reshape(bs, seqlen, -1))


class FeedForward(nn.Module):
    """v1.1: w2(gelu_tanh(w1 x) * w3 x) (HF's gated-gelu, "gelu_new"); original: w2(relu(w1 x)); Megatron:
    w2(gelu(w1 x)) with biases."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.w1 = nn.Linear(args.dim, args.ffn_dim, bias=args.linear_bias)
        self.w2 = nn.Linear(args.ffn_dim, args.dim, bias=args.linear_bias)
        self.w3 = nn.Linear(args.dim, args.ffn_dim, bias=args.linear_bias) if args.gated else None
        self.relu = args.activation == "relu"
        self.approximate = args.gelu_approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.w3 is None:
            h = self.w1(x)
            return self.w2(F.relu(h) if self.relu else F.gelu(h, approximate=self.approximate))
        return self.w2(F.gelu(self.w1(x), approximate=self.approximate) * self.w3(x))


def _init_block(block: nn.Module, args: ModelArgs) -> None:
    """HF's T5 init (initializer_factor f): q ~ N(0, f (dim * head_dim)^-1/2) (the unscaled logits' 1/sqrt(d)),
    k, v ~ f dim^-1/2, o ~ f inner^-1/2; FFN inputs f dim^-1/2, output f ffn^-1/2; unit norms."""
    f = args.init_factor
    for norm in (m for m in block.children() if isinstance(m, (RMSNorm, nn.LayerNorm))):
        norm.reset_parameters()
    for lin in (m for m in block.modules() if isinstance(m, nn.Linear) and m.bias is not None):
        nn.init.zeros_(lin.bias)  # (Megatron's biases start at zero too)
    for attn in (m for m in block.children() if isinstance(m, Attention)):
        nn.init.normal_(attn.wq.weight, std=f * (args.dim * args.head_dim) ** -0.5)
        nn.init.normal_(attn.wk.weight, std=f * args.dim ** -0.5)
        nn.init.normal_(attn.wv.weight, std=f * args.dim ** -0.5)
        nn.init.normal_(attn.wo.weight, std=f * args.inner_dim ** -0.5)
    ffn = block.feed_forward
    for lin in (ffn.w1, ffn.w3):
        if lin is not None:
            nn.init.normal_(lin.weight, std=f * args.dim ** -0.5)
    nn.init.normal_(ffn.w2.weight, std=f * args.ffn_dim ** -0.5)


class EncoderBlock(nn.Module):
    def __init__(self, layer_id: int, args: ModelArgs):
        super().__init__()
        self.layer_id = layer_id
        self.attention_norm = _norm(args)
        self.attention = Attention(args)
        self.ffn_norm = _norm(args)
        self.feed_forward = FeedForward(args)

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), bias)
        return h + self.feed_forward(self.ffn_norm(h))


class DecoderBlock(nn.Module):
    def __init__(self, layer_id: int, args: ModelArgs):
        super().__init__()
        self.layer_id = layer_id
        self.attention_norm = _norm(args)
        self.attention = Attention(args)
        self.cross_norm = _norm(args)
        self.cross_attention = Attention(args)
        self.ffn_norm = _norm(args)
        self.feed_forward = FeedForward(args)

    def forward(self, x: torch.Tensor, enc: torch.Tensor, bias: torch.Tensor,
                cross_mask: torch.Tensor | None) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), bias)
        h = h + self.cross_attention(self.cross_norm(h), cross_mask, enc)
        return h + self.feed_forward(self.ffn_norm(h))


class T5(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.vocab_size = args.vocab_size
        self.n_layers = args.n_layers + args.n_decoder_layers
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)  # HF's `shared`: both stacks read it
        relative = args.position_embedding == "relative"
        # None under learned positions: the plans and FSDP's groups skip absent modules
        self.encoder_rel_bias = nn.Embedding(args.rel_buckets, args.n_heads) if relative else None
        self.decoder_rel_bias = nn.Embedding(args.rel_buckets, args.n_heads) if relative else None
        self.pos_embeddings = None if relative else nn.Embedding(args.max_position_rows or args.max_seq_len, args.dim)
        # String keys: FQNs stay those of one process whatever a plan does to the dict.
        self.encoder_layers = nn.ModuleDict({str(i): EncoderBlock(i, args) for i in range(args.n_layers)})
        self.encoder_norm = _norm(args)
        self.decoder_layers = nn.ModuleDict({str(i): DecoderBlock(i, args) for i in range(args.n_decoder_layers)})
        self.decoder_norm = _norm(args)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=args.output_bias)
        self.tied = args.tie_embeddings
        self.tied_parameters: list[tuple[str, str]] = []
        if self.tied:
            self.output.weight = self.tok_embeddings.weight
            self.tied_parameters = [("tok_embeddings.weight", "output.weight")]

    @property
    def layers(self) -> dict[str, nn.Module]:
        """Every block in run order, encoder then decoder, keyed "0".."L-1" (what AC, compile and FSDP walk)."""
        blocks = [*self.encoder_layers.values(), *self.decoder_layers.values()]
        return {str(i): b for i, b in enumerate(blocks)}

    def tie_weights(self) -> None:
        """Point output.weight at tok_embeddings.weight again (to_empty and TP's distribute leave two)."""
        if self.tied and self.output.weight is not self.tok_embeddings.weight:
            self.output.weight = self.tok_embeddings.weight

    @torch.no_grad()
    def init_weights(self, buffer_device: torch.device | str | None = None) -> None:
        """HF's T5 init (the word table N(0, f), bias tables N(0, f dim^-1/2)), except the untied head: N(0, f dim^-1/2)
        where HF draws N(0, f), whose unit-variance hidden states then give logits of std ~sqrt(dim) and a first loss
        far above ln(vocab) (29 against 7.7 on configs/t5_debug.toml). No buffers."""
        self.tie_weights()
        f = self.args.init_factor
        nn.init.normal_(self.tok_embeddings.weight, std=f)
        for table in (self.encoder_rel_bias, self.decoder_rel_bias, self.pos_embeddings):
            if table is not None:
                nn.init.normal_(table.weight, std=f * self.args.dim ** -0.5)
        if self.output.bias is not None:
            nn.init.zeros_(self.output.bias)
        for block in self.layers.values():
            _init_block(block, self.args)
        self.encoder_norm.reset_parameters()
        self.decoder_norm.reset_parameters()
        if not self.tied:
            nn.init.normal_(self.output.weight, std=f * self.args.dim ** -0.5)

    def embed(self, tokens: torch.Tensor, start: int = 0) -> torch.Tensor:
        """The word vectors, plus the absolute position of each (start..) under learned positions."""
        h = self.tok_embeddings(tokens)
        if self.pos_embeddings is None:
            return h
        rows = self.pos_embeddings.weight.shape[0]
        if start + tokens.shape[1] > rows:
            raise ValueError(f"{start + tokens.shape[1]} positions but the learned position table has {rows} rows "
                             f"(model.args.max_position_rows; 0: max_seq_len)")
        return h + self.pos_embeddings(torch.arange(start, start + tokens.shape[1], device=tokens.device))

    def position_bias(self, table: nn.Embedding | None, q_len: int, k_len: int, bidirectional: bool,
                      q_start: int = 0, device=None) -> torch.Tensor:
        """[1, H, q_len, k_len] the bias of queries q_start.. against keys 0..k_len-1 (H: this rank's heads); a zero
        [1, 1, q_len, k_len] without relative positions (the mask still needs a float tensor to fill)."""
        if table is None:
            return torch.zeros(1, 1, q_len, k_len, device=device, dtype=self.tok_embeddings.weight.dtype)
        q = torch.arange(q_start, q_start + q_len, device=device)
        k = torch.arange(k_len, device=device)
        buckets = relative_buckets(k[None, :] - q[:, None], bidirectional, self.args.rel_buckets,
                                   self.args.rel_max_distance)
        return table(buckets).permute(2, 0, 1).unsqueeze(0)

    @staticmethod
    def _masked(bias: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
        """The float mask SDPA adds: the bias, and the dtype's minimum where `keep` is False (as HF: a fully masked
        row stays finite)."""
        return bias if keep is None else bias.masked_fill(~keep, torch.finfo(bias.dtype).min)

    def encode(self, tokens: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """tokens [B, S] -> the encoder output [B, S, D] (after its final norm)."""
        seqlen = tokens.shape[1]
        h = self.embed(tokens)
        keys = None if attention_mask is None else attention_mask.bool()[:, None, None, :]
        bias = self._masked(self.position_bias(self.encoder_rel_bias, seqlen, seqlen, True, device=tokens.device),
                            keys).to(h.dtype)
        for block in self.encoder_layers.values():
            h = block(h, bias)
        return self.encoder_norm(h)

    def decode(self, decoder_tokens: torch.Tensor, enc: torch.Tensor, attention_mask: torch.Tensor | None = None,
               decoder_attention_mask: torch.Tensor | None = None, start: int = 0,
               keys: int | None = None) -> torch.Tensor:
        """decoder_tokens [B, T] (at positions start.., attending keys 0..keys-1 with a cache) -> logits [B, T, V]."""
        t = decoder_tokens.shape[1]
        k_len = keys if keys is not None else t
        if start + t > self.args.decoder_limit:
            raise ValueError(f"decoder input of {start + t} tokens is longer than model.args.max_decoder_len="
                             f"{self.args.decoder_limit} allows; raise model.args.max_decoder_len (0: max_seq_len)")
        h = self.embed(decoder_tokens, start)
        q_pos = torch.arange(start, start + t, device=h.device)
        keep = (torch.arange(k_len, device=h.device)[None, :] <= q_pos[:, None])[None, None]
        if decoder_attention_mask is not None:
            keep = keep & decoder_attention_mask.bool()[:, None, None, :]
        bias = self._masked(self.position_bias(self.decoder_rel_bias, t, k_len, False, start, h.device),
                            keep).to(h.dtype)
        cross = None if attention_mask is None else attention_mask.bool()[:, None, None, :]
        for block in self.decoder_layers.values():
            h = block(h, enc, bias, cross)
        h = self.decoder_norm(h)
        if self.tied and self.args.tied_scale:  # the original T5 rescales before its tied head (HF's tie)
            h = h * self.args.dim ** -0.5
        return self.output(h)

    def forward(self, tokens: torch.Tensor, decoder_tokens: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None,
                decoder_attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """tokens [B, S] (the encoder's), decoder_tokens [B, T] (the decoder's input: its targets shifted right
        after the start token) -> logits [B, T, V]. attention_mask [B, S] / decoder_attention_mask [B, T]: 1 =
        token, 0 = padding (HF's)."""
        if decoder_tokens is None:
            raise ValueError("T5.forward needs decoder_tokens (the decoder's input ids); the t5 objective "
                             "(models/t5/objective.py) makes them from each row")
        enc = self.encode(tokens, attention_mask)
        return self.decode(decoder_tokens, enc, attention_mask, decoder_attention_mask)
