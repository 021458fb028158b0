"""Autoregressive generation with the cache the model's family declares (ModelSpec.cache, models/cache.py: K/V by
default, models/common/kv_cache.py), for any model of the registry.

    new_tokens = generate(model, [[1, 2, 3], [4, 5]], max_new_tokens=32)            # greedy
    generate(model, prompts, max_new_tokens=64, temperature=0.8, top_p=0.95, seed=0)  # sampled, reproducible

Prompts are left-padded into one batch: every row's next token then sits in the same cache slot, the mask hides the pad
slots (a carried state skips them: Step.valid), and positions count from each row's first real token, so a row gives the
tokens it gives alone. A prefill forward fills the cache, then each step feeds one token per row. An image-text model
(models/llava) takes `pixels` [N, C, H, W], its prompts' images in order: they enter the prefill only (their features
replace the placeholders there and live on as the cache's K/V), as the decode steps feed text tokens. The returned lists
hold only the new tokens, without the EOS token or the stop sequence that ended a row (as vLLM does; transformers keeps
the EOS).
"""
from __future__ import annotations

import weakref
from typing import Callable

import torch

import models
from models.cache import Step

# model -> (shape key, cache, compiled decode step): the compiled step's guards hold on to one cache object, so it is
# reused while the batch and length fit (a benchmark's warm-up then leaves the timed call nothing to compile).
_COMPILED: "weakref.WeakKeyDictionary[torch.nn.Module, tuple]" = weakref.WeakKeyDictionary()


def _check_sampling(max_new_tokens: int, temperature: float, top_k: int, top_p: float) -> None:
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be at least 1")
    if not temperature >= 0:  # also refuses NaN
        raise ValueError(f"temperature={temperature} must be >= 0 (0 = greedy)")
    if top_k < 0:
        raise ValueError(f"top_k={top_k} must be >= 0 (0 = no top-k cut)")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p={top_p} must lie in (0, 1] (1 = no nucleus cut)")


def next_tokens(logits: torch.Tensor, temperature: float, top_k: int, top_p: float,
                generator: torch.Generator | None) -> torch.Tensor:
    """[B, V] logits -> [B] tokens: argmax when temperature == 0, else a draw from the tempered distribution cut to
    the top_k tokens and to the smallest set whose probability reaches top_p (the most likely token always stays)."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        drop = probs.cumsum(dim=-1) - probs >= top_p  # the mass before a token already reaches top_p
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    return torch.multinomial(logits.softmax(dim=-1), 1, generator=generator).squeeze(-1)


def _mask(valid: torch.Tensor, first: int, n: int, attend: int) -> torch.Tensor:
    """[B, 1, n, attend] bool for the queries in slots first..first+n-1: causal over the valid (non-pad) slots. A pad
    query sees itself too, so its (unused) output stays finite and cannot poison later layers through its K/V."""
    q = torch.arange(first, first + n, device=valid.device)[:, None]
    kv = torch.arange(attend, device=valid.device)[None, :]
    return ((valid[:, None, :attend] & (kv <= q)[None]) | (kv == q)[None]).unsqueeze(1)


def step_at(valid: torch.Tensor, first: int, n: int, attend_len: int | None) -> Step:
    """The Step of a forward feeding slots first..first+n-1 of rows whose valid (non-pad) slots are `valid` [B, L];
    attend_len None: over all L slots (static shapes). The forward from slot 0 is the prefill: it starts sequences."""
    slots = torch.arange(first, first + n, device=valid.device)
    return Step(slots, _mask(valid, first, n, attend_len or valid.shape[1]), attend_len, valid[:, first:first + n],
                start=first == 0)


class _Stops:
    """Per-row EOS / stop-sequence bookkeeping and the streaming callback (tokens that may begin a stop sequence are
    held back until it is clear whether they do)."""

    def __init__(self, rows: int, eos_id, stop, on_token) -> None:
        self.eos = set([eos_id] if isinstance(eos_id, int) else (eos_id or []))
        self.stop = [list(s) for s in (stop or []) if len(s)]
        self.out: list[list[int]] = [[] for _ in range(rows)]
        self.done = [False] * rows
        self.sent = [0] * rows
        self.on_token = on_token

    def add(self, row: int, token: int) -> None:
        if self.done[row]:
            return
        out = self.out[row]
        if token in self.eos:
            self._finish(row)
            return
        out.append(token)
        for s in self.stop:
            if out[-len(s):] == s:
                del out[-len(s):]
                self._finish(row)
                return
        self._emit(row, len(out) - self._held(out))

    def _held(self, out: list[int]) -> int:
        """How many trailing tokens are a proper prefix of some stop sequence."""
        return max([n for s in self.stop for n in range(1, min(len(s), len(out) + 1))
                    if out[-n:] == s[:n]] + [0])

    def _finish(self, row: int) -> None:
        self.done[row] = True
        self._emit(row, len(self.out[row]))

    def finish_all(self) -> None:
        for row in range(len(self.out)):
            self._emit(row, len(self.out[row]))

    def _emit(self, row: int, upto: int) -> None:
        if self.on_token is not None:
            for t in self.out[row][self.sent[row]:upto]:
                self.on_token(row, t)
        self.sent[row] = max(self.sent[row], upto)


@torch.no_grad()
def generate(model: torch.nn.Module, prompts: list[list[int]], *, max_new_tokens: int,
             eos_id: int | list[int] | None = None, stop: list[list[int]] | None = None, temperature: float = 0.0,
             top_k: int = 0, top_p: float = 1.0, seed: int | None = None, compile: bool = False,
             on_token: Callable[[int, int], None] | None = None, spec=None,
             pixels: torch.Tensor | None = None) -> list[list[int]]:
    """The new tokens of each prompt (see the module docstring). `eos_id` (one id or several) and `stop` (token
    sequences) end a row; `seed` makes sampling reproducible (a torch.Generator on the model's device);
    `compile` compiles the one-token decode step over static cache shapes; `on_token(row, token)` is called for each
    returned token as soon as it is final; `spec`: the model's ModelSpec (default: the registry's for its class),
    whose `cache` is used; `pixels`: the prompts' images for an image-text model's prefill (see the module
    docstring; titanlike/infer/images.py reads files). The model should be in eval mode."""
    _check_sampling(max_new_tokens, temperature, top_k, top_p)
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token (give a BOS token for an empty prompt)")
    max_seq_len = model.args.max_seq_len
    longest = max(len(p) for p in prompts)
    if longest + max_new_tokens > max_seq_len:
        raise ValueError(f"a prompt of {longest} tokens plus max_new_tokens={max_new_tokens} exceeds the model's "
                         f"context of {max_seq_len} tokens; shorten the prompt or lower max_new_tokens")
    device = next(model.parameters()).device
    rows, length = len(prompts), longest + max_new_tokens
    pads = torch.tensor([longest - len(p) for p in prompts], device=device)
    tokens = torch.tensor([[0] * (longest - len(p)) + list(p) for p in prompts], device=device)
    slot = torch.arange(length, device=device)
    valid = slot[None, :] >= pads[:, None]  # [B, L]: generated slots are valid in every row
    positions = (slot[None, :] - pads[:, None]).clamp(min=0)
    generator = None
    if seed is not None:
        generator = torch.Generator(device).manual_seed(seed)
    cache, step = _cache_and_step(model, spec or models.spec_of(model), rows, length, device, compile)
    stops = _Stops(rows, eos_id, stop, on_token)
    images = {} if pixels is None else {"pixels": pixels.to(device, next(model.parameters()).dtype)}
    with cache.attached(model):
        cache.set_step(step_at(valid, 0, longest, longest))
        logits = model(tokens, positions=positions[:, :longest], **images)[:, -1]
        for t in range(max_new_tokens):
            new = next_tokens(logits, temperature, top_k, top_p, generator)
            for row, token in enumerate(new.tolist()):
                stops.add(row, token)
            if all(stops.done) or t == max_new_tokens - 1:
                break
            at = longest + t
            cache.set_step(step_at(valid, at, 1, None if compile else at + 1))
            logits = step(new[:, None], positions[:, at:at + 1])
    stops.finish_all()
    return stops.out


def _cache_and_step(model, spec, rows: int, length: int, device, compile: bool):
    """A fresh cache of the family's kind and the eager decode step, or (compile) the model's cached compiled step and
    its cache (reused by later calls: Step.start tells it that new sequences begin)."""
    def decode(tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return model(tokens, positions=positions)[:, -1]

    if not compile:
        return spec.cache(model, rows, length), decode
    key = (rows, length, str(device), next(model.parameters()).dtype)
    held = _COMPILED.get(model)
    if held is None or held[0] != key:
        held = (key, spec.cache(model, rows, length), torch.compile(decode, dynamic=False))
        _COMPILED[model] = held
    return held[1], held[2]
