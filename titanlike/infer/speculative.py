"""Speculative decoding with a model's own multi-token-prediction modules (DeepSeek-V3 report §5.4.3; docs/mtp.md).

    new_tokens, stats = mtp_generate(model, prompts, max_new_tokens=64)    # greedy, exactly generate()'s tokens
    stats.acceptance_rate                                                   # accepted drafts / drafted tokens

Each round, with the committed tokens x_0..x_n (x_n not yet fed to the main model) and the main model's hidden state
h^0 (after its final norm, what the head and the MTP modules read) at every fed slot:
  draft   MTP depth d (1..k, k <= mtp_num_layers) at slot n-1 reads h^{d-1}_{n-1} and the embedding of token n-1+d
          (x_n for d = 1, else depth d-1's draft) and drafts token n+d: the chain of the report's Figure 3, the
          inputs MTP was trained on.
  verify  one main-model forward over [x_n, draft_1..draft_k] at slots n..n+k: its greedy tokens y_0..y_k. Drafts
          are accepted while draft_j == y_{j-1}; then y_a (a = drafts accepted) is the main model's own next token,
          so every round commits a+1 tokens, each the main model's greedy choice given the committed prefix.
  rollback nothing to undo: the KV caches are written by slot and a query sees only slots at or before its own, so
          K/V written for rejected tokens sit past the committed end and the next round's forward overwrites them.

Rows of a batch advance apart: every row commits its own a+1 tokens, so each keeps its own slot n (the KV caches
and the MTP caches take per-row slots, models/common/kv_cache.py) and its own positions, and sees only its own
committed slots; a hard row no longer holds the others to one token per round. A row that has finished (EOS, stop
sequence, max_new_tokens) stays where it is: the batch still computes it, and nothing of it is kept. The MTP modules
keep KV caches of their own blocks: depth d's state at slot p needs token p+d, which is a draft until committed, so
each round recomputes depth d from each row's first slot whose inputs were not all committed, and a draft's cache
entries never outlive the round.

Greedy only (sampling would need the rejection-sampling rule); eager only (block shapes change every round).
"""
from __future__ import annotations

import dataclasses
import types
from typing import Callable

import torch

import models
from models.common.kv_cache import KVCache
from models.cache import Step
from titanlike.infer.generate import _check_sampling, _Stops, step_at


@dataclasses.dataclass
class SpeculativeStats:
    """Sums over the rows, each counted only while it is still generating; the rows_* lists hold each row's own."""

    drafted: int = 0  # draft tokens proposed to the verifier
    accepted: int = 0  # of those, committed without a main-model correction
    # drafts each row's main model agreed with, in order; above `accepted` only where max_new_tokens cut a round
    matched: int = 0
    rounds: int = 0  # verify forwards of the main model (after the prefill)
    committed: int = 0  # tokens committed by the prefill and the rounds, all rows together
    row_forwards: int = 0  # main forwards (prefill included) summed over the rows they computed while live
    rows_drafted: list[int] = dataclasses.field(default_factory=list)
    rows_accepted: list[int] = dataclasses.field(default_factory=list)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def match_rate(self) -> float:
        return self.matched / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_forward(self) -> float:
        """Tokens a live row commits per main forward (1 without drafts)."""
        return self.committed / self.row_forwards if self.row_forwards else 0.0

    def line(self) -> str:
        return (f"speculative mtp: accepted {self.accepted} of {self.drafted} drafted tokens "
                f"({100 * self.acceptance_rate:.1f}%), {self.committed} tokens in {self.rounds + 1} main forwards "
                f"({self.tokens_per_forward:.2f} per row and forward)")


def _refusals(model: torch.nn.Module, temperature: float, compile: bool, draft_tokens: int | None) -> int:
    mtp = getattr(model, "mtp", None)
    if mtp is None:
        raise ValueError("speculative decoding with MTP needs the model's MTP modules and this model has none "
                         "(model.args.mtp_num_layers = 0): train or import it with model.args.mtp_num_layers >= 1, "
                         "or generate without --speculative")
    if temperature != 0:
        raise ValueError(f"speculative decoding with MTP is greedy only (temperature={temperature}): use "
                         f"temperature 0 or generate without --speculative")
    if compile:
        raise ValueError("speculative decoding with MTP runs eager (its block shapes change every round): drop "
                         "--compile or --speculative")
    depth = len(mtp)
    k = depth if draft_tokens is None else draft_tokens
    if not 1 <= k <= depth:
        raise ValueError(f"draft_tokens={k}: the model has {depth} MTP modules, so draft between 1 and {depth}")
    return k


@torch.no_grad()
def mtp_generate(model: torch.nn.Module, prompts: list[list[int]], *, max_new_tokens: int,
                 eos_id: int | list[int] | None = None, stop: list[list[int]] | None = None,
                 temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int | None = None,
                 compile: bool = False, on_token: Callable[[int, int], None] | None = None, spec=None,
                 draft_tokens: int | None = None, pixels=None) -> tuple[list[list[int]], SpeculativeStats]:
    """generate()'s arguments and greedy result (see titanlike/infer/generate.py), drafted by the model's MTP modules
    `draft_tokens` at a time (default: all of them); returns (new tokens per prompt, SpeculativeStats)."""
    _check_sampling(max_new_tokens, temperature, top_k, top_p)
    if pixels is not None:  # the MTP families are text decoders: an image-text model has no MTP modules here
        raise ValueError("--speculative mtp takes text prompts only: drop --image (or --speculative)")
    k_max = _refusals(model, temperature, compile, draft_tokens)
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token (give a BOS token for an empty prompt)")
    longest = max(len(p) for p in prompts)
    if longest + max_new_tokens > model.args.max_seq_len:
        raise ValueError(f"a prompt of {longest} tokens plus max_new_tokens={max_new_tokens} exceeds the model's "
                         f"context of {model.args.max_seq_len} tokens; shorten the prompt or lower max_new_tokens")
    device = next(model.parameters()).device
    rows = len(prompts)
    # a row's verify block may reach k_max slots past its last token; those slots' positions are clamped into the
    # RoPE table (only tokens past the row's max_new_tokens sit there, and nothing reads them)
    length = longest + max_new_tokens + k_max
    pads = torch.tensor([longest - len(p) for p in prompts], device=device)
    slot = torch.arange(length, device=device)
    valid = slot[None, :] >= pads[:, None]
    positions = (slot[None, :] - pads[:, None]).clamp(min=0, max=model.args.max_seq_len - 1)
    seq = torch.zeros(rows, length + 1, dtype=torch.long, device=device)  # committed tokens by slot, per row
    seq[:, :longest] = torch.tensor([[0] * (longest - len(p)) + list(p) for p in prompts], device=device)
    run = _Drafter(model, rows, length, valid, positions)
    cache = (spec or models.spec_of(model)).cache(model, rows, length)
    stops = _Stops(rows, eos_id, stop, on_token)
    stats = SpeculativeStats(rows_drafted=[0] * rows, rows_accepted=[0] * rows)
    count = [1] * rows  # tokens committed per row
    with cache.attached(model), run.attached():
        cache.set_step(step_at(valid, 0, longest, longest))
        logits = run.main(seq[:, :longest], slot[:longest].expand(rows, -1))
        n_host = [longest] * rows  # per row: the slot of its newest committed token, not yet fed to the main model
        n = torch.tensor(n_host, device=device)
        seq[:, longest] = logits[:, -1].argmax(-1)
        for row, t in enumerate(seq[:, longest].tolist()):
            stops.add(row, t)
        stats.committed, stats.row_forwards = rows, rows
        while True:
            live = [r for r in range(rows) if not stops.done[r] and count[r] < max_new_tokens]
            if not live:
                break
            # one draft depth for the batch (tensor shapes); a row near its end takes fewer of them below
            k = min(k_max, max(max_new_tokens - count[r] - 1 for r in live))
            drafts = run.draft(seq, n, n_host, k)  # [B, k]
            cache.set_step(_rows_step(valid, n, k + 1, max(n_host) + k + 1))
            block = n[:, None] + torch.arange(k + 1, device=device)  # each row's slots n..n+k
            y = run.main(torch.cat([seq.gather(1, n[:, None]), drafts], dim=1), block).argmax(-1)  # [B, k+1]
            matched = (drafts == y[:, :k]).long().cumprod(dim=1).sum(dim=1).tolist()  # per row, in order
            # y[:a] are the accepted drafts and y[a] the main model's next token: every row's y goes to its slots
            # n+1..n+k+1; what lies past its commit is overwritten before anything reads it as committed
            seq.scatter_(1, block + 1, y)
            y_host, step = y.tolist(), [0] * rows
            for r in live:
                a = min(matched[r], max_new_tokens - count[r] - 1)
                stats.rows_drafted[r] += k
                stats.rows_accepted[r] += a
                stats.matched += matched[r]
                for t in y_host[r][:a + 1]:
                    stops.add(r, t)
                count[r] += a + 1
                step[r] = a + 1
                stats.committed += a + 1
            stats.rounds += 1
            stats.row_forwards += len(live)
            n_host = [p + s for p, s in zip(n_host, step)]
            n = n + torch.tensor(step, device=device)
    stats.drafted, stats.accepted = sum(stats.rows_drafted), sum(stats.rows_accepted)
    stops.finish_all()
    return stops.out, stats


def _rows_step(valid: torch.Tensor, first: torch.Tensor, n: int, attend_len: int) -> Step:
    """The Step of a forward feeding each row r its slots first[r]..first[r]+n-1 (generate.step_at with one start per
    row): causal over the row's own valid slots, a pad query seeing itself."""
    slots = first[:, None] + torch.arange(n, device=valid.device)  # [B, n]
    kv = torch.arange(attend_len, device=valid.device)
    q = slots[:, :, None]
    mask = (valid[:, None, :attend_len] & (kv <= q)) | (kv == q)
    return Step(slots, mask.unsqueeze(1), attend_len, valid.gather(1, slots), start=False)


class _Drafter:
    """The main model's hidden states by slot, the MTP modules' KV caches and hidden states, and the draft chain."""

    def __init__(self, model: torch.nn.Module, rows: int, length: int, valid: torch.Tensor,
                 positions: torch.Tensor) -> None:
        self.model, self.valid, self.positions = model, valid, positions
        self.layers = list(model.mtp.values())
        # hidden[d]: the input hidden state of MTP depth d+1 by slot (hidden[0] is the main model's h^0)
        self.hidden: list[torch.Tensor | None] = [None] * len(self.layers)
        self.caches = [KVCache(rows, length) for _ in self.layers]
        # depth d+1, per row: the first slot whose state must be (re)computed
        self.fresh = [[0] * rows for _ in self.layers]
        self._h0: torch.Tensor | None = None

    def attached(self):
        """The MTP blocks' attention through their caches, and a hook keeping the main model's h^0."""
        import contextlib

        @contextlib.contextmanager
        def ctx():
            def keep(module, inputs, out):
                self._h0 = out

            hook = self.model.norm.register_forward_hook(keep)
            with contextlib.ExitStack() as stack:
                for layer, cache in zip(self.layers, self.caches):
                    stack.enter_context(cache.attached(types.SimpleNamespace(layers={"0": layer.block})))
                try:
                    yield
                finally:
                    hook.remove()
        return ctx()

    def _store(self, depth: int, slots: torch.Tensor, h: torch.Tensor) -> None:
        if self.hidden[depth] is None:
            rows, length = self.valid.shape
            self.hidden[depth] = h.new_zeros(rows, length, h.shape[-1])
        self.hidden[depth].scatter_(1, slots[..., None].expand(-1, -1, h.shape[-1]), h)

    def main(self, tokens: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """The main model's logits for tokens at each row's `slots` [B, S] (the caller set its cache's Step); keeps
        h^0."""
        logits = self.model(tokens, positions=self.positions.gather(1, slots))
        self._store(0, slots, self._h0)
        return logits

    def draft(self, seq: torch.Tensor, n: torch.Tensor, n_host: list[int], k: int) -> torch.Tensor:
        """[B, k] greedy drafts of each row's tokens n+1..n+k from MTP depths 1..k at its slot n-1 (see the module
        docstring); n [B] and n_host are the same slots, on the device and on the host."""
        model, drafts, dim = self.model, [], None
        ext = seq.clone()  # committed tokens, then this round's drafts at each row's slots n+1..
        for d in range(1, k + 1):
            # one window length m for the batch, ending at each row's slot n-1 and covering what it must redo
            # (recomputing a committed slot again gives what it held); clamped at slot 0 for short rows, whose
            # window then runs past n-1 into slots that are redone before a committed query reads them
            m = max(p - f for p, f in zip(n_host, self.fresh[d - 1]))
            start = (n - m).clamp(min=0)
            slots = start[:, None] + torch.arange(m, device=seq.device)  # [B, m]
            emb = model.tok_embeddings(ext.gather(1, slots + d))
            rope, _ = model._attention_inputs(m, None, self.positions.gather(1, slots), seq.device)
            self.caches[d - 1].set_step(_rows_step(self.valid, start, m, max(max(p - m, 0) for p in n_host) + m))
            h_in = self.hidden[d - 1]
            dim = h_in.shape[-1]
            h = self.layers[d - 1](h_in.gather(1, slots[..., None].expand(-1, -1, dim)), emb, rope, None)
            if d < len(self.layers):
                self._store(d, slots, h)
            # slots up to n-d read only committed tokens: they stay; later ones read a draft and are redone
            self.fresh[d - 1] = [p - d + 1 for p in n_host]
            last = h.gather(1, (n - 1 - start)[:, None, None].expand(-1, 1, dim))  # each row's slot n-1
            drafts.append(model.output(last).argmax(-1))  # [B, 1]
            ext.scatter_(1, (n + d)[:, None], drafts[-1])
        return torch.cat(drafts, dim=1) if drafts else seq.new_zeros(seq.shape[0], 0)


def for_script(mode: str, model: torch.nn.Module, temperature: float, compile: bool,
               report: Callable[[str], None]) -> Callable[..., list[list[int]]]:
    """scripts/generate.py's --speculative MODE, checked before anything is printed: a generate()-shaped function
    that reports the acceptance rate of its call."""
    if mode != "mtp":
        raise ValueError(f"--speculative {mode}: the one mode is mtp (the model's multi-token-prediction modules)")
    _refusals(model, temperature, compile, None)

    def gen(model, prompts, **kw):
        out, stats = mtp_generate(model, prompts, **kw)
        report(stats.line())
        return out
    return gen
