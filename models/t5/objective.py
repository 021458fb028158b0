"""T5's span corruption, made deterministically from each plain token row (T5 paper section 3.1.4; the sizes as
t5.data.preprocessors.random_spans_noise_mask computes them).

A row of S tokens: round(S * noise_density) of them (the noise) in n_spans = round(noise / mean_span_length) spans,
the rest in n_spans runs between them, the row starting with a kept run. The encoder reads the kept tokens with
sentinel i in place of span i, then padding up to S (attention_mask 0 there); the decoder is trained to produce
`sentinel_0 span_0 sentinel_1 span_1 ...` (noise + n_spans tokens), reading it shifted right after the start
token (pad_token_id), padded at the end to a multiple of decoder_multiple (so sequence parallel can cut it; the
padding has no targets and, the decoder being causal, changes nothing before it). Every row gets the same sizes.

Where the spans fall: two random segmentations (noise into n_spans non-empty parts, the kept tokens likewise), each
the n_spans - 1 smallest of hash keys over the possible cut points, keyed by (seed, step, the row's tokens, the
position) as the masked_lm objective's: the same rows at the same step get the same spans on any layout and after a
resume. The Batch: inputs {"tokens", "attention_mask", "decoder_tokens"} and labels [B, T].

Megatron's T5 data (`data.dataset = "t5"`, titanlike/data/t5_dataset.py), told apart by the batch's rank as BERT's
objective does: input_ids [B, 2, Se + Sd] (row 0 the encoder tokens then the decoder input, row 1 their padding
mask) and labels [B, Se + Sd] (IGNORE_INDEX over the encoder part, then the decoder targets). The data has
corrupted the spans already (with the tokenizer's own <extra_id_k>, numbered upwards as Megatron does), so nothing
is drawn here: both are cut at Se = training.seq_len (args.max_seq_len), the encoder mask becomes attention_mask
and the decoder's padding mask decoder_attention_mask (the decoder is causal and pads at the end, so that mask only
keeps padded queries from reading padded keys; the targets there are IGNORE_INDEX).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from models.batch import IGNORE_INDEX, Batch, StepContext, _mix

SENTINEL_TOKEN = "<extra_id_0>"  # T5's first sentinel, looked up in the run's tokenizer


@dataclass(frozen=True)
class SpanSizes:
    noise: int
    spans: int
    encoder: int  # kept tokens + sentinels (the rest of the S encoder positions is padding)
    decoder: int  # noise + sentinels
    padded: int  # the decoder's length: `decoder` rounded up to args.decoder_multiple (targets IGNORE_INDEX there)


def span_sizes(args: Any, seq_len: int) -> SpanSizes:
    noise = min(max(int(round(seq_len * args.noise_density)), 1), seq_len - 1)
    spans = max(int(round(noise / args.mean_span_length)), 1)
    m = args.decoder_multiple
    return SpanSizes(noise, spans, seq_len - noise + spans, noise + spans, -(-(noise + spans) // m) * m)


def _segment(keys: torch.Tensor, m: int, k: int) -> torch.Tensor:
    """[B, k] lengths >= 1 summing to m: cuts at the k - 1 cut points (of 1..m-1) with the smallest keys."""
    b = keys.shape[0]
    if k == 1:
        return torch.full((b, 1), m, dtype=torch.int64, device=keys.device)
    cuts = keys[:, :m - 1].argsort(dim=1)[:, :k - 1].sort(dim=1).values + 1
    zero = torch.zeros((b, 1), dtype=torch.int64, device=keys.device)
    return torch.cat([zero, cuts, zero + m], dim=1).diff(dim=1)


@dataclass(frozen=True)
class SpanCorruption:
    noise_density: float
    mean_span_length: float
    sentinel_top: int  # span i gets sentinel_top - i
    n_sentinels: int
    pad_id: int = 0
    decoder_multiple: int = 8
    loss: str = "cross_entropy"
    encoder_len: int = 0  # args.max_seq_len (= training.seq_len): where Megatron's T5 rows are cut
    decoder_limit: int = 0  # args.decoder_limit: the longest decoder the forward accepts

    def __call__(self, input_ids: torch.Tensor, labels: torch.Tensor, ctx: StepContext) -> Batch:
        if input_ids.ndim == 3:
            return self.megatron(input_ids, labels)
        b, s = input_ids.shape
        sz = span_sizes(self, s)
        if sz.spans > self.n_sentinels:
            raise ValueError(f"rows of {s} tokens make {sz.spans} noise spans and model.args.n_sentinels is "
                             f"{self.n_sentinels}; raise it (and the vocabulary's spare rows) or shorten "
                             f"training.seq_len")
        dev = input_ids.device
        pos = torch.arange(2 * s, device=dev, dtype=torch.int64)
        row = _mix(input_ids * (2 * pos[:s] + 1)).sum(dim=1, keepdim=True)  # depends on every token of the row
        keys = _mix(row + _mix(pos + (ctx.seed << 32) + ctx.step * 0x9E3779B9))  # [B, 2S]: two draws
        noise_len = _segment(keys[:, :s], sz.noise, sz.spans)
        kept_len = _segment(keys[:, s:], s - sz.noise, sz.spans)
        lens = torch.stack([kept_len, noise_len], dim=2).reshape(b, 2 * sz.spans)  # kept run, span, kept, span...
        starts = lens.cumsum(dim=1) - lens
        marks = torch.zeros((b, s + 1), dtype=torch.int64, device=dev)
        marks.scatter_add_(1, starts[:, 1:], torch.ones_like(starts[:, 1:]))
        seg = marks[:, :s].cumsum(dim=1)  # which run or span each position is in
        noise = seg % 2 == 1
        first = noise & torch.cat([torch.ones_like(noise[:, :1]), seg[:, 1:] != seg[:, :-1]], dim=1)
        sentinel = self.sentinel_top - seg // 2
        # Two slots per position, the sentinel before the token, compacted in order (every row keeps the same count).
        slots_sent = sentinel.unsqueeze(2)
        slots_tok = input_ids.unsqueeze(2)

        def compact(keep_sent: torch.Tensor, keep_tok: torch.Tensor, n: int) -> torch.Tensor:
            vals = torch.cat([slots_sent, slots_tok], dim=2).reshape(b, 2 * s)
            keep = torch.stack([keep_sent, keep_tok], dim=2).reshape(b, 2 * s)
            order = (~keep).to(torch.int8).argsort(dim=1, stable=True)[:, :n]
            return vals.gather(1, order)

        enc = compact(first, ~noise, sz.encoder)
        target = compact(first, noise, sz.decoder)
        tokens = torch.cat([enc, enc.new_full((b, s - sz.encoder), self.pad_id)], dim=1)
        mask = (torch.arange(s, device=dev) < sz.encoder).to(torch.int64).expand(b, s)
        dec_in = torch.cat([target.new_full((b, 1), self.pad_id), target[:, :-1]], dim=1)
        # Padding after the targets (causal: nothing before it reads it), so sequence parallel can cut the decoder.
        extra = sz.padded - sz.decoder
        dec_in = torch.cat([dec_in, dec_in.new_full((b, extra), self.pad_id)], dim=1)
        target = torch.cat([target, target.new_full((b, extra), IGNORE_INDEX)], dim=1)
        return Batch(inputs={"tokens": tokens, "attention_mask": mask, "decoder_tokens": dec_in}, labels=target,
                     sequence=("tokens", "attention_mask"))

    def megatron(self, input_ids: torch.Tensor, labels: torch.Tensor) -> Batch:
        """A data.dataset="t5" batch as the model reads it: cut at the encoder length, the masks from row 1."""
        se = self.encoder_len
        if input_ids.shape[1] != 2 or input_ids.shape[2] <= se or labels.shape != (input_ids.shape[0],
                                                                                     input_ids.shape[2]):
            raise ValueError(f"t5 objective: expected data.dataset=\"t5\" batches (input_ids [B, 2, Se + Sd], labels "
                             f"[B, Se + Sd], Se = training.seq_len = {se}) or plain tokens [B, S]; got "
                             f"{tuple(input_ids.shape)} / {tuple(labels.shape)}")
        return Batch(inputs={"tokens": input_ids[:, 0, :se], "attention_mask": input_ids[:, 1, :se],
                             "decoder_tokens": input_ids[:, 0, se:], "decoder_attention_mask": input_ids[:, 1, se:]},
                     labels=labels[:, se:], sequence=("tokens", "attention_mask"))

    @staticmethod
    def eval_metrics(output: torch.Tensor, batch: Batch) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Validation's token accuracy on the decoder targets, as (correct, targets) for the evaluator to add up over
        batches and ranks (titanlike/train/evaluate.py); the validation loss is already the mean target loss."""
        has = batch.labels != IGNORE_INDEX
        return {"token_accuracy": (((output.argmax(-1) == batch.labels) & has).sum(), has.sum())}

    def data_problem(self, data: Any) -> str | None:
        """Why Megatron's T5 data cannot feed this model, or None (one line naming the keys)."""
        if getattr(data, "dataset", "") != "t5":
            return None
        sd = int(getattr(data, "decoder_seq_length", 0))
        if sd > self.decoder_limit:
            return (f"data.decoder_seq_length={sd} is longer than the model's decoder limit {self.decoder_limit} "
                    f"(model.args.max_decoder_len, 0: training.seq_len); raise model.args.max_decoder_len")
        if sd % self.decoder_multiple:
            return (f"data.decoder_seq_length={sd} is not a multiple of model.args.decoder_multiple="
                    f"{self.decoder_multiple} (sequence parallel cuts the decoder); make it one, or lower "
                    f"model.args.decoder_multiple")
        return None

    def tokenizer_problem(self, tokenizer: Any) -> str | None:
        """Why these sentinel ids cannot work with `tokenizer`, or None: they must be the tokenizer's own extra ids
        (<extra_id_0> = sentinel_top) or rows past its vocabulary; anything else would turn real text into
        sentinels. A tokenizer that lists its sentinels (BertWordPiece with data.vocab_extra_ids: the ones Megatron's
        T5 data writes) must list exactly the model's ids, whichever data the run reads."""
        lowest = self.sentinel_top - self.n_sentinels + 1
        listed = list(getattr(tokenizer, "sentinel_ids", None) or [])
        if listed:
            if sorted(listed) == list(range(lowest, self.sentinel_top + 1)):
                return None
            return (f"model.args.sentinel_top={self.sentinel_top} / n_sentinels={self.n_sentinels} (ids {lowest}.."
                    f"{self.sentinel_top}) disagree with the tokenizer's {len(listed)} sentinels {min(listed)}.."
                    f"{max(listed)} (data.vocab_extra_ids); set model.args.sentinel_top={max(listed)} and "
                    f"n_sentinels={len(listed)}")
        if lowest >= tokenizer.vocab_size:
            return None
        own = tokenizer.token_to_id(SENTINEL_TOKEN) if hasattr(tokenizer, "token_to_id") else None
        if own == self.sentinel_top:
            return None
        return (f"model.args.sentinel_top: sentinels {lowest}..{self.sentinel_top} are real tokens of the tokenizer "
                f"({tokenizer.vocab_size} tokens, " + (f"whose <extra_id_0> is {own}" if own is not None else
                                                     "which has no <extra_id_0>") +
                f"); set model.vocab_size to at least {tokenizer.vocab_size + self.n_sentinels} with "
                f"model.args.sentinel_top=-1 (spare rows at the end)")


def span_corruption(args: Any) -> SpanCorruption:
    """The args' span settings; ValueError naming the key when the vocabulary or the decoder limit cannot hold
    them."""
    top = args.sentinel_top % args.vocab_size if args.sentinel_top < 0 else args.sentinel_top
    if top >= args.vocab_size or top - args.n_sentinels + 1 < 0:
        raise ValueError(f"model.args.sentinel_top={args.sentinel_top} with n_sentinels={args.n_sentinels} does not "
                         f"fit a vocabulary of {args.vocab_size}; set model.args.sentinel_top=-1 and "
                         f"model.vocab_size to the tokenizer's size + {args.n_sentinels}")
    sz = span_sizes(args, args.max_seq_len)
    if sz.padded > args.decoder_limit:
        raise ValueError(f"span corruption of {args.max_seq_len}-token rows gives {sz.padded} decoder tokens, more "
                         f"than model.args.max_decoder_len={args.decoder_limit}; raise model.args.max_decoder_len "
                         f"(0: training.seq_len)")
    return SpanCorruption(noise_density=args.noise_density, mean_span_length=args.mean_span_length,
                          sentinel_top=top, n_sentinels=args.n_sentinels, pad_id=args.pad_token_id,
                          decoder_multiple=args.decoder_multiple, encoder_len=args.max_seq_len,
                          decoder_limit=args.decoder_limit)
