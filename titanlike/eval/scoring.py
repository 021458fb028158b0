"""Log-likelihoods of token continuations with plain full forwards of a model (no KV cache needed).

Used by the harness adapter (harness.py) for `loglikelihood` and `loglikelihood_rolling`, by a script on one process
or in the training loop on every rank. `TokenScorer.score(pairs)` takes (context ids, continuation ids) pairs and
returns (sum of log p(continuation | context), whether greedy decoding would produce the continuation) per pair.

Data-parallel sharding (`shard=(rank, degree, group)`): each DP rank scores every degree-th pair, padded to the same
count so that every rank runs the same number of forwards (FSDP's all-gathers are collectives: a rank with one batch
fewer would hang the others), then one all-reduce over the DP group gives every rank all the results. Ranks that
share a DP rank (TP) get the same pairs and run the same forwards, as training does.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F


def full_logits(out) -> torch.Tensor:
    """The model's output as a plain fp32 tensor: under loss parallel (TP) the logits are a vocabulary-sharded
    DTensor, gathered here (evaluation batches are small; the training loss never gathers them)."""
    if hasattr(out, "full_tensor"):
        out = out.full_tensor()
    return out.float()


class TokenScorer:
    """Batched continuation scoring. `max_len`: the longest input the model takes (its context); longer inputs keep
    their last max_len tokens, as lm_eval's HF model does. `fixed_shape`: batches are padded to
    batch_size rows and to a power-of-two width (at least 64, at most max_len), so a compiled model sees at most
    log2(max_len) shapes (the training loop uses it; padding every request to the full context instead made 500
    four-choice documents of ~150 tokens take 42 s on a 1B model at 4096, H100). Right padding cannot change earlier
    positions under causal attention. `context`: a context manager entered around each forward (autocast, the SDPA
    backend choice)."""

    def __init__(self, model: torch.nn.Module, *, max_len: int, batch_size: int, device: torch.device | str,
                 pad_id: int = 0, fixed_shape: bool = False, shard: tuple[int, int, object] | None = None,
                 context: Callable[[], contextlib.AbstractContextManager] | None = None, progress: bool = False):
        self.model, self.max_len, self.batch_size = model, int(max_len), max(1, int(batch_size))
        self.device = torch.device(device)
        self.pad_id, self.fixed_shape, self.shard = pad_id, fixed_shape, shard
        self.context = context or contextlib.nullcontext
        self.progress = progress

    def _inputs(self, context: Sequence[int], continuation: Sequence[int]) -> tuple[list[int], int]:
        """(model input, number of continuation tokens scored): the last max_len + 1 tokens, minus the final one
        (nothing predicts after it)."""
        whole = (list(context) + list(continuation))[-(self.max_len + 1):]
        return whole[:-1], min(len(continuation), len(whole) - 1)

    @torch.no_grad()
    def _score_local(self, pairs: list[tuple[Sequence[int], Sequence[int]]]) -> list[tuple[float, bool]]:
        prepared = [self._inputs(c, x) for c, x in pairs]
        # Longest first: batches of similar lengths pad little, and an out-of-memory shows in the first batch.
        order = sorted(range(len(pairs)), key=lambda i: -len(prepared[i][0]))
        out: list[tuple[float, bool] | None] = [None] * len(pairs)
        batches = range(0, len(order), self.batch_size)
        if self.progress:
            from tqdm import tqdm

            batches = tqdm(batches, desc="scoring", unit="batch")
        for start in batches:
            idx = order[start:start + self.batch_size]
            width = max(len(prepared[i][0]) for i in idx)
            if self.fixed_shape:
                width = min(self.max_len, max(64, 1 << (width - 1).bit_length()))
            rows = self.batch_size if self.fixed_shape else len(idx)
            tokens = torch.full((rows, width), self.pad_id, dtype=torch.long)
            for r, i in enumerate(idx):
                inp = prepared[i][0]
                tokens[r, :len(inp)] = torch.tensor(inp, dtype=torch.long)
            with self.context():
                logits = full_logits(self.model(tokens.to(self.device)))
            logp = F.log_softmax(logits, dim=-1)
            for r, i in enumerate(idx):
                inp, n = prepared[i]
                target = torch.tensor(list(pairs[i][1])[len(pairs[i][1]) - n:], dtype=torch.long, device=logp.device)
                rows_lp = logp[r, len(inp) - n:len(inp)]
                total = rows_lp.gather(1, target.unsqueeze(1)).sum().item()
                greedy = bool((rows_lp.argmax(-1) == target).all().item())
                out[i] = (total, greedy)
        return out  # type: ignore[return-value]

    def score(self, pairs: list[tuple[Sequence[int], Sequence[int]]]) -> list[tuple[float, bool]]:
        if self.shard is None or self.shard[1] == 1:
            return self._score_local(pairs)
        rank, degree, group = self.shard
        mine = list(range(rank, len(pairs), degree))
        per_rank = -(-len(pairs) // degree)
        # Padding repeats a pair whose result is thrown away: the same forward count on every rank.
        padded = mine + [mine[-1] if mine else 0] * (per_rank - len(mine))
        local = self._score_local([pairs[i] for i in padded]) if pairs else []
        # (log-likelihood, greedy) of every pair, filled by its owner, summed over the DP ranks. float64: the sum
        # adds exact zeros, so every rank gets its owner's float value unchanged.
        table = torch.zeros(len(pairs), 2, dtype=torch.float64, device=self.device)
        for i, (ll, greedy) in zip(mine, local):
            table[i, 0], table[i, 1] = ll, float(greedy)
        torch.distributed.all_reduce(table, group=group)
        return [(float(ll), bool(g > 0.5)) for ll, g in table.tolist()]
