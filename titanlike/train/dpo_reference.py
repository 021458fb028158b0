"""DPO's reference log-probs: the sum of log p(label) over each sequence's response under the initial weights.

Two ways (dpo.reference):
- "precompute": before step 1, one pass over the pairs (train, and validation's if any) with the policy itself (at
  step 0 it is the reference), no gradients, each data-parallel rank a share, gathered into a ReferenceTable on
  every rank. The table is keyed by a 64-bit hash of each sequence's (input ids, labels), computed on the device:
  a batch finds its rows with a searchsorted, whatever sampler order, layout or resume brought them. Packed rows
  (data.preference_layout = "pack") key each sequence by its row's hash and its slot in the row
  (titanlike/train/dpo_packed.py). It goes into
  the trainer's checkpointed state, so a resume (whose weights are no longer the initial ones) reloads it.
- "frozen_copy": a second model built through the same path (build_model, the same plan, the same seeded initial
  weights, then checkpoint.initial_load_path's weights when set), every parameter frozen, run under no_grad on each
  micro-batch. Its weights are always the run's initial ones, at the first start and on resume alike.

LoRA (models/common/lora.py): the reference is the base model without its adapters, `adapters_disabled(model)`
(every LoraLinear computes its base alone inside it). With adapters, "frozen_copy" runs the
policy itself inside that context instead of a copy (the base weights are frozen and shared), and "precompute" runs
its pass inside it too.

Pipeline parallel: the pass and the frozen copy's forwards run through the pipeline without gradients
(PipelineRunner.forward_only; the copy is cut into the policy's stages), and the last stage's log-probs are summed
over the pipeline ranks, so every rank holds the same table.
"""
from __future__ import annotations

import logging
import time

import numpy as np
import torch
import torch.distributed as dist

from models.batch import _mix  # splitmix64's finaliser on int64 (MaskedLM's mask hash)

logger = logging.getLogger("titanlike")


def row_keys(ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """A 64-bit key [R] of each row of ids / labels [R, S] (int64, on their device, no host sync): every token, its
    label and its position enter it."""
    pos = torch.arange(ids.shape[1], device=ids.device, dtype=torch.int64)
    per_token = _mix(_mix(ids + (pos << 32)) + labels)
    return _mix(per_token.sum(dim=1))  # (int64 sums wrap around)


class ReferenceTable:
    """Sorted keys [M] and reference log-probs [M] (fp32), on the training device."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, fingerprint: str = ""):
        order = torch.argsort(keys)
        self.keys, self.values, self.fingerprint = keys[order], values[order].float(), fingerprint

    def __len__(self) -> int:
        return self.keys.numel()

    def lookup(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The reference log-probs [R] of these rows; NaN for a row the pass never saw (it cannot happen: the loader
        refuses other data on resume; a NaN loss would be caught by the non-finite guard)."""
        return self.lookup_keys(row_keys(ids, labels))

    def lookup_keys(self, q: torch.Tensor) -> torch.Tensor:
        """The values of keys q (any shape), NaN where a key is not in the table."""
        flat = q.reshape(-1)
        i = torch.searchsorted(self.keys, flat).clamp(max=len(self) - 1)
        found = torch.where(self.keys[i] == flat, self.values[i], torch.full_like(self.values[i], float("nan")))
        return found.view(q.shape)

    def state_dict(self) -> dict:
        return {"keys": self.keys.cpu().numpy(), "values": self.values.cpu().numpy(), "fingerprint": self.fingerprint}

    @classmethod
    def from_state(cls, state: dict, device: torch.device) -> ReferenceTable:
        return cls(torch.from_numpy(np.asarray(state["keys"])).to(device),
                   torch.from_numpy(np.asarray(state["values"])).to(device), state.get("fingerprint", ""))


def _gather(x: torch.Tensor, group) -> torch.Tensor:
    """x [N] of every rank of `group`, concatenated in rank order (N may differ between ranks)."""
    if group is None:
        return x
    n = torch.tensor([x.numel()], device=x.device)
    sizes = [torch.empty_like(n) for _ in range(dist.get_world_size(group))]
    dist.all_gather(sizes, n, group=group)
    most = int(max(s.item() for s in sizes))
    padded = torch.cat([x, x.new_zeros(most - x.numel())])
    parts = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(parts, padded.contiguous(), group=group)
    return torch.cat([p[:int(s.item())] for p, s in zip(parts, sizes)])


def _row_keys(ids: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    keys = row_keys(ids, labels)
    return keys, torch.ones_like(keys, dtype=torch.bool)


@torch.no_grad()
def precompute(datasets: list, forward_logps, *, batch_pairs: int, dp_rank: int, dp_degree: int, group,
               device: torch.device, keys_fn=_row_keys) -> ReferenceTable:
    """One pass over `datasets` (map-style, samples (ids [2, S], labels [2, S]), or packed rows (ids [S],
    labels [S])): `forward_logps(ids [R, S], labels [R, S])` -> the log-probs of each row [R] (of each packed row's
    sequence slots [R, slots]) on this rank's share (samples dp_rank, dp_rank + dp_degree, ...; padded with repeats so
    every rank runs as many forwards, FSDP's collectives need all of them, and to whole batches of `batch_pairs`
    samples), gathered over the data ranks.
    `keys_fn(ids, labels)` -> (the table's keys, shaped as the log-probs; where there is a sequence)."""
    t0 = time.perf_counter()
    keys, values = [], []
    for ds in datasets:
        n = len(ds)
        share = list(range(dp_rank, n, dp_degree))
        share += [share[0] if share else 0] * (-(-n // dp_degree) - len(share))
        # whole batches only: every forward has the training micro-batch's shape (no recompile, and on CPU the
        # same kernels, so the policy's log-probs at step 1 equal the table's bit for bit)
        share += [share[0]] * (-len(share) % batch_pairs)
        for start in range(0, len(share), batch_pairs):
            samples = [ds[i] for i in share[start:start + batch_pairs]]
            ids = torch.stack([s[0] for s in samples]).to(device)
            labels = torch.stack([s[1] for s in samples]).to(device)
            if ids.ndim == 3:  # pairs: rows [c0, r0, c1, r1, ...]
                ids, labels = ids.flatten(0, 1), labels.flatten(0, 1)
            k, there = keys_fn(ids, labels)
            keys.append(k[there])
            values.append(forward_logps(ids, labels).float()[there])
    local_k, local_v = torch.cat(keys), torch.cat(values)
    all_k, all_v = _gather(local_k, group), _gather(local_v, group)
    uniq, inverse = torch.unique(all_k, return_inverse=True)  # repeats (padding, duplicate pairs): one entry each
    vals = torch.empty(uniq.shape, dtype=all_v.dtype, device=all_v.device).scatter_(0, inverse, all_v)
    fp = "|".join(getattr(ds, "fingerprint", "") for ds in datasets)
    logger.info(f"DPO reference: log-probs of {uniq.numel():,} sequences precomputed with the initial weights in "
                f"{time.perf_counter() - t0:.1f} s (kept in checkpoints)")
    return ReferenceTable(uniq, vals, fp)


def build_frozen_copy(trainer, plan, plan_sections):
    """A second model built as the policy was (build_model, the plan, seeded initial weights), with
    checkpoint.initial_load_path's weights when set, every parameter frozen, in eval mode. Under pipeline parallel
    this rank's stages of it, {stage index: module}, cut as the policy's (PipelineRunner.forward_only runs them)."""
    import dataclasses
    import os

    from parallelize.pp import stage_module
    from titanlike.checkpoint import CheckpointManager
    from titanlike.train.construct import BuildSections, build_model, materialise, run_vocab

    cfg = trainer.cfg
    mb = build_model(BuildSections.of(cfg), trainer.dims, trainer.device,
                     run_vocab(cfg.model, trainer.tokenizer.vocab_size), trainer.tokenizer.eod_id,
                     compile_loss_chunk=False)
    if trainer.pp is None:
        parts = {0: plan(mb.model, trainer.dims, plan_sections)}
    else:
        pipe, me = trainer.pp.pipeline, trainer.dims.get_mesh("pp").get_local_rank()
        top_level = (*mb.spec.input_modules, *mb.spec.output_modules)
        parts = {sid: plan(stage_module(mb.model, pipe.layout[sid], top_level), trainer.dims, plan_sections)
                 for sid, owner in enumerate(pipe.owners) if owner == me}
    modules = list(parts.values())
    materialise(modules, trainer.device, cfg.training.seed)
    for m in modules:
        m.requires_grad_(False)
    ckpt = cfg.checkpoint
    if ckpt.initial_load_path:  # the run's initial weights: those the policy started from
        loader = CheckpointManager(dataclasses.replace(ckpt, enable=False, initial_load_model_only=True),
                                   os.path.join(trainer.run_dir, ckpt.folder), model=modules,
                                   strict=trainer.pp is None)  # (a pipeline rank holds only its stages' keys)
        loader.load()
        loader.close()
    for m in modules:
        m.eval()
    logger.info("DPO reference: a frozen copy of the initial model (the same plan), run without gradients on "
                "every micro-batch")
    return parts[0] if trainer.pp is None else parts
