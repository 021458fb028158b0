"""`build_dataloader`: dataset + DP-sharded global-order sampler -> torchdata StatefulDataLoader.

The loader is endless (epochs roll over inside the sampler or the dataset) and `loader.state_dict()` /
`load_state_dict()` resume exactly at the next batch, with or without worker processes. Iterating a *fresh* loader
(or calling iter() again without loading state) restarts from the first batch, which is what a validation pass wants.

Map-style datasets (stdlib, mock, indexed) go through GlobalBatchSampler, whose state ({epoch, batch} + what the
sample order depends on) is the same on every rank and independent of the data-parallel degree: a checkpoint taken
under D ranks resumes under D' ranks at the same global sample, as long as the global batch size is unchanged.
Endless indexed datasets shuffle inside themselves, so their sampler walks them in order. The streaming text dataset
shards and batches itself; its state differs per rank, so `state_dict()` gathers every DP rank's into one dict
(a collective: call it on all ranks together, as a checkpoint save does) and each rank loads its own part.

Every state also records what the loader was built with (titanlike/data/loader_state.py), so a resume with other
data, seq_len or global batch is refused at load_state_dict in one line; and every loader logs the data summary
(titanlike/data/summary.py) when it is built.
"""
from __future__ import annotations

import dataclasses
import warnings

import torch
import torch.distributed as dist
from torch.utils.data import IterableDataset
from torchdata.stateful_dataloader import StatefulDataLoader

from titanlike.config.errors import ConfigError
from titanlike.data import loader_state, summary
from titanlike.data.dataset import build_dataset
from titanlike.data.gpt_dataset import ENDLESS, dataset_fingerprint
from titanlike.data.sampler import GlobalBatchSampler
from titanlike.data.stdlib_corpus import STDLIB_CORPUS_MAX_BYTES


def collate_pair(samples: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """[(inputs[S], labels[S])] * B -> (inputs[B,S], labels[B,S]); a tuple, unlike default_collate's list."""
    inputs, labels = zip(*samples)
    return torch.stack(inputs), torch.stack(labels)


def _saved_workers(state: dict) -> int:
    snap = state.get("_snapshot")
    return int(snap["_main_snapshot"]["_num_workers"]) if snap else 0


def _sampler_state(state: dict) -> dict | None:
    main = state["_snapshot"]["_main_snapshot"] if state.get("_snapshot") else state
    return main.get("_sampler_iter_state")


def _gather_per_rank(state: dict, dp_rank: int) -> dict:
    """Streaming state differs per DP rank, but a checkpoint stores one copy: collect every rank's into it.

    A collective over the default group when one exists: every rank must call state_dict() together, as a
    checkpoint save does.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return {"per_dp_rank": {dp_rank: state}}
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (dp_rank, state))
    return {"per_dp_rank": dict(gathered)}


class DataLoader(StatefulDataLoader):
    """StatefulDataLoader whose state also survives a change of data.num_workers, and refuses other data at once.

    torchdata's state is shaped by the worker count and refuses another; for map-style datasets the only thing that
    matters is the global sampler position, so it is kept beside torchdata's state ("global_sampler") and used
    alone when the worker count differs. Same worker count: torchdata's own exact path. What the loader was built
    with (data, seq_len, global batch: titanlike/data/loader_state.py) is kept too ("built_with") and compared
    on load, before anything is restored.
    """

    dp_rank = 0  # set by build_dataloader
    built_with: dict | None = None  # set by build_dataloader

    def __iter__(self):
        # A new iterator draws its workers' base seed from torch's global RNG. A resumed run makes its iterator after
        # the checkpoint restored that RNG (an uninterrupted run made its own before step 1), so the draw would shift
        # every later random op of the forward (LoRA's dropout) off the uninterrupted run's: it leaves the RNG as is.
        with torch.random.fork_rng(devices=[]):
            return super().__iter__()

    def state_dict(self) -> dict:
        state = super().state_dict()
        if isinstance(self.dataset, IterableDataset):
            state = _gather_per_rank(state, self.dp_rank)
        elif (sampler := _sampler_state(state)) is not None:
            state = {**state, "global_sampler": dict(sampler)}
        return {**state, loader_state.KEY: self.built_with} if self.built_with else state

    def load_state_dict(self, state: dict) -> None:
        state = dict(state)
        saved = state.pop(loader_state.KEY, None)
        if self.built_with:
            loader_state.check(saved, self.built_with)
        if isinstance(self.batch_sampler, GlobalBatchSampler) and "per_dp_rank" not in state:
            sampler = state.get("global_sampler") or _sampler_state(state)
            if sampler:  # old states (no record) are still refused here in one line, not at the first batch
                self.batch_sampler.check_state(sampler)
        if "per_dp_rank" in state:
            if self.dp_rank not in state["per_dp_rank"]:
                raise ConfigError(f"the streaming data state holds data-parallel ranks {sorted(state['per_dp_rank'])}, "
                                  f"not this rank's {self.dp_rank}: resume streaming data with the same DP degree "
                                  "(or preprocess it to .bin/.idx, whose position reshards)")
            state = dict(state["per_dp_rank"][self.dp_rank])
        sampler = state.pop("global_sampler", None)
        if _saved_workers(state) == self.num_workers:
            return super().load_state_dict(state)
        if sampler is None or not isinstance(self.batch_sampler, GlobalBatchSampler):
            raise ConfigError(f"data loader state was saved with data.num_workers={_saved_workers(state)}, this "
                              f"run has {self.num_workers}: resume this dataset with the same number of workers")
        self.batch_sampler.resume_state = sampler


def build_dataloader(data_cfg, tokenizer, *, dp_rank: int, dp_degree: int, local_batch_size: int, seq_len: int,
                     seed: int, split: str = "train", vocab_size: int | None = None,
                     max_corpus_bytes: int | None = STDLIB_CORPUS_MAX_BYTES, paths_key: str = "data.paths",
                     global_batch_size: int | None = None, steps: int | None = None) -> StatefulDataLoader:
    """This DP rank's endless loader of `(input_ids[B,S], labels[B,S])` int64 batches.

    `tokenizer` may be None for `data.dataset="mock"` when `vocab_size` is given. `max_corpus_bytes` caps the stdlib
    corpus (tests use a small slice). With pinned memory, torch may hand the pair back as a list; unpack it either way.
    `paths_key` names data_cfg.paths in error messages. `global_batch_size` (samples per optimizer step, all ranks)
    is recorded in the state and a resume with another one is refused; None = not checked (the micro-batch layout,
    local_batch_size x dp_degree, may change on resume: that is resharding). `steps` (with the global batch, or
    local_batch_size x dp_degree without one) gives the samples the run reads, for the epochs in the data summary.
    """
    dataset = build_dataset(data_cfg, tokenizer, seq_len=seq_len, split=split, seed=seed, vocab_size=vocab_size,
                            max_corpus_bytes=max_corpus_bytes, dp_rank=dp_rank, dp_degree=dp_degree,
                            paths_key=paths_key)
    num_workers = int(data_cfg.num_workers)
    if hasattr(dataset, "check_usable"):  # streaming: data with no usable document would spin before step 1
        dataset.check_usable(num_workers)
    common = dict(
        collate_fn=collate_pair,
        num_workers=num_workers,
        pin_memory=bool(data_cfg.pin_memory) and torch.cuda.is_available(),
        # workers only slice a memory-mapped array; 2 batches ahead per worker hides that easily
        prefetch_factor=2 if num_workers > 0 else None,
    )
    with warnings.catch_warnings():  # torchdata 0.11 calls an API newer torch deprecates; not actionable here
        warnings.filterwarnings("ignore", message=".*set_vital.*")
        if isinstance(dataset, IterableDataset):
            loader = DataLoader(dataset, batch_size=local_batch_size, drop_last=True, **common)
        else:
            endless = len(dataset) >= ENDLESS
            sampler = GlobalBatchSampler(
                len(dataset), dp_rank=dp_rank, dp_degree=dp_degree, local_batch_size=local_batch_size, seed=seed,
                # mock and shapes samples are already random (and nominally 2^30 long: a permutation of that would
                # take minutes and gigabytes); endless indexed datasets shuffle themselves (Megatron-style)
                shuffle=(split == "train" and data_cfg.dataset not in ("mock", "shapes", "shapes_captions",
                                                                          "mock_image_text")
                         and not endless),
                fingerprint=dataset_fingerprint(dataset),
            )
            loader = DataLoader(dataset, batch_sampler=sampler, **common)
    per_step = global_batch_size or local_batch_size * dp_degree
    summary.log_summary(dataset, split=split, seq_len=seq_len, samples=steps * per_step if steps else None,
                        data_cfg=data_cfg, paths_key=paths_key)
    loader.dp_rank = dp_rank
    loader.built_with = loader_state.identity(
        data_cfg, dataset, split=split, seq_len=seq_len, seed=seed, global_batch_size=global_batch_size,
        dp_degree=dp_degree, num_workers=num_workers, paths_key=paths_key)
    return loader


def validation_data_config(data_cfg, val_cfg):
    """(data config, split) that validation reads: validation.dataset/paths replace data's; with its own paths the
    whole of each prefix (or file list) is scored, else validation.split of data.split."""
    dataset = val_cfg.dataset or data_cfg.dataset
    paths = list(val_cfg.paths)
    split = val_cfg.split
    if not paths:
        return dataclasses.replace(data_cfg, dataset=dataset), split
    whole = {"train": "100,0,0", "valid": "0,100,0", "test": "0,0,100"}.get(split, data_cfg.split)
    return dataclasses.replace(data_cfg, dataset=dataset, paths=paths, split=whole), split


def build_validation_dataloader(data_cfg, val_cfg, tokenizer, **kw) -> StatefulDataLoader:
    """The validation loader (build it once at start-up so bad validation data fails there, not mid-run)."""
    cfg, split = validation_data_config(data_cfg, val_cfg)
    return build_dataloader(cfg, tokenizer, split=split, paths_key="validation.paths" if val_cfg.paths else
                            "data.paths", **kw)
