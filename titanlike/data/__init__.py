"""Data pipeline: corpora, token caches, datasets and the stateful DP-sharded loader."""
from titanlike.data.dataset import DATASETS, MockDataset, TokenWindowDataset, build_dataset
from titanlike.data.loader import build_dataloader
from titanlike.data.sampler import GlobalBatchSampler

__all__ = ["DATASETS", "GlobalBatchSampler", "MockDataset", "TokenWindowDataset", "build_dataloader", "build_dataset"]
