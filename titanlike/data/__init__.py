"""Data pipeline: corpora, indexed (.bin/.idx) data, GPT sample index and blends, streaming text, the stateful
DP-sharded loader. See docs/data.md."""
from titanlike.data.dataset import DATASETS, MockDataset, TokenWindowDataset, build_dataset
from titanlike.data.gpt_dataset import BlendedDataset, GPTDataset, build_indexed_dataset, parse_blend, parse_split
from titanlike.data.indexed import IndexedDataset, IndexedDatasetWriter
from titanlike.data.loader import build_dataloader, build_validation_dataloader, validation_data_config
from titanlike.data.sampler import GlobalBatchSampler
from titanlike.data.streaming import StreamingTextDataset

__all__ = ["DATASETS", "BlendedDataset", "GPTDataset", "GlobalBatchSampler", "IndexedDataset",
           "IndexedDatasetWriter", "MockDataset", "StreamingTextDataset", "TokenWindowDataset", "build_dataloader",
           "build_dataset", "build_indexed_dataset", "build_validation_dataloader", "parse_blend", "parse_split",
           "validation_data_config"]
