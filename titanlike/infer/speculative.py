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

Rows of a batch stay aligned (left-padded prompts share slots, as in generate()): a round commits the smallest a of
the rows still generating (each row's accepted drafts are its main model's greedy tokens, so taking fewer of them is
exact). The MTP modules keep KV caches of their own blocks: depth d's state at slot p needs token p+d, which is a
draft until committed, so each round recomputes depth d from the first slot whose inputs were not all committed
(at most d slots back), and a draft's cache entries never outlive the round.

Greedy only (sampling would need the rejection-sampling rule); eager only (block shapes change every round).
"""
from __future__ import annotations

import dataclasses
import types
from typing import Callable

import torch

import models
from models.common.kv_cache import KVCache
from titanlike.infer.generate import _check_sampling, _Stops, step_at


@dataclasses.dataclass
class SpeculativeStats:
    drafted: int = 0  # draft tokens proposed to the verifier, summed over the rows still generating
    accepted: int = 0  # of those, committed without a main-model correction
    # drafts each row's main model agreed with, in order, before the batch commits its rows' smallest count: with
    # one row it equals `accepted`; in a batch the gap is what rows waiting for the worst row cost
    matched: int = 0
    rounds: int = 0  # verify forwards of the main model (after the prefill)
    committed: int = 0  # tokens committed per row by the prefill and the rounds (one row's count)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def match_rate(self) -> float:
        return self.matched / self.drafted if self.drafted else 0.0

    def line(self) -> str:
        return (f"speculative mtp: accepted {self.accepted} of {self.drafted} drafted tokens "
                f"({100 * self.acceptance_rate:.1f}%), {self.committed} tokens in {self.rounds + 1} main forwards")


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
    rows, length = len(prompts), longest + max_new_tokens
    pads = torch.tensor([longest - len(p) for p in prompts], device=device)
    slot = torch.arange(length, device=device)
    valid = slot[None, :] >= pads[:, None]
    positions = (slot[None, :] - pads[:, None]).clamp(min=0)
    seq = torch.zeros(rows, length, dtype=torch.long, device=device)  # committed tokens by slot
    seq[:, :longest] = torch.tensor([[0] * (longest - len(p)) + list(p) for p in prompts], device=device)
    run = _Drafter(model, rows, length, valid, positions)
    cache = (spec or models.spec_of(model)).cache(model, rows, length)
    stops, stats = _Stops(rows, eos_id, stop, on_token), SpeculativeStats()
    with cache.attached(model), run.attached():
        cache.set_step(step_at(valid, 0, longest, longest))
        logits = run.main(seq[:, :longest], 0)
        n = longest  # the slot of the newest committed token, not yet fed to the main model
        seq[:, n] = logits[:, -1].argmax(-1)
        _commit(stops, seq[:, n:n + 1], stats)
        while not all(stops.done) and stats.committed < max_new_tokens:
            k = min(k_max, max_new_tokens - stats.committed - 1)
            drafts = run.draft(seq, n, k)  # [B, k]
            cache.set_step(step_at(valid, n, k + 1, n + k + 1))
            y = run.main(torch.cat([seq[:, n:n + 1], drafts], dim=1), n).argmax(-1)  # [B, k+1]
            matched = (drafts == y[:, :k]).long().cumprod(dim=1).sum(dim=1)  # per row: drafts accepted in order
            live = torch.tensor([not d for d in stops.done], device=device)
            per_row = matched[live].tolist()  # how many drafts each live row accepts (a host sync, as _commit's)
            a = min(per_row)
            seq[:, n + 1:n + a + 1] = drafts[:, :a]
            seq[:, n + a + 1] = y[:, a]
            n_live = len(per_row)  # from the host list: live.sum() would wait for the device once more
            stats.drafted += k * n_live
            stats.accepted += a * n_live
            stats.matched += sum(per_row)
            stats.rounds += 1
            _commit(stops, seq[:, n + 1:n + a + 2], stats)
            n += a + 1
    stops.finish_all()
    return stops.out, stats


def _commit(stops: _Stops, new: torch.Tensor, stats: SpeculativeStats) -> None:
    for row, tokens in enumerate(new.tolist()):
        for t in tokens:
            stops.add(row, t)
    stats.committed += new.shape[1]


class _Drafter:
    """The main model's hidden states by slot, the MTP modules' KV caches and hidden states, and the draft chain."""

    def __init__(self, model: torch.nn.Module, rows: int, length: int, valid: torch.Tensor,
                 positions: torch.Tensor) -> None:
        self.model, self.valid, self.positions = model, valid, positions
        self.layers = list(model.mtp.values())
        # hidden[d]: the input hidden state of MTP depth d+1 by slot (hidden[0] is the main model's h^0)
        self.hidden: list[torch.Tensor | None] = [None] * len(self.layers)
        self.caches = [KVCache(rows, length) for _ in self.layers]
        self.fresh = [0] * len(self.layers)  # depth d+1: the first slot whose state must be (re)computed
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

    def _store(self, depth: int, first: int, h: torch.Tensor) -> None:
        if self.hidden[depth] is None:
            rows, length = self.valid.shape
            self.hidden[depth] = h.new_zeros(rows, length, h.shape[-1])
        self.hidden[depth][:, first:first + h.shape[1]] = h

    def main(self, tokens: torch.Tensor, first: int) -> torch.Tensor:
        """The main model's logits for tokens at slots first.. (the caller set its cache's Step); keeps h^0."""
        logits = self.model(tokens, positions=self.positions[:, first:first + tokens.shape[1]])
        self._store(0, first, self._h0)
        return logits

    def draft(self, seq: torch.Tensor, n: int, k: int) -> torch.Tensor:
        """[B, k] greedy drafts of tokens n+1..n+k from MTP depths 1..k at slot n-1 (see the module docstring)."""
        model, drafts = self.model, []
        for d in range(1, k + 1):
            first = self.fresh[d - 1]
            ext = torch.cat([seq[:, :n + 1], *drafts], dim=1)  # committed slots 0..n, then this round's drafts
            emb = model.tok_embeddings(ext[:, first + d:n + d])
            rope, _ = model._attention_inputs(n - first, None, self.positions[:, first:n], seq.device)
            self.caches[d - 1].set_step(step_at(self.valid, first, n - first, n))
            h = self.layers[d - 1](self.hidden[d - 1][:, first:n], emb, rope, None)
            if d < len(self.layers):
                self._store(d, first, h)
            # slots up to n-d read only committed tokens: they stay; later ones read a draft and are redone
            self.fresh[d - 1] = n - d + 1
            drafts.append(model.output(h[:, -1:]).argmax(-1))
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
