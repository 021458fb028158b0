"""The ViT objective: a loader row of pixel bytes becomes one image and its class.

Image datasets (titanlike/data/images.py: data.dataset = "shapes" or "image_folder") yield `(input_ids [B, S],
labels [B, S])` int64 like every loader, so the sampler, resume and resharding are the token loaders': a row's first
C * H * W values are the image's bytes (0..255, channel-major: [C, H, W] flattened), the rest zero; every label of
the row is its class. The objective reshapes the bytes to pixels normalised by model.args.pixel_stats ((x/255 -
mean) / std per channel; ViT's 0.5 / 0.5 by default, CLIP's statistics for CLIP towers) and keeps one label per
image, so the loss is a mean over the step's images on any layout. Nothing is drawn: a resumed run and any layout
see the same batch. Nothing in the Batch is a sequence context parallel could cut.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from models.batch import Batch, StepContext
from models.vit.args import ModelArgs

IMAGE_DATASETS = ("shapes", "image_folder", "webdataset", "mock")  # mock: random bytes and classes (throughput)


@dataclass(frozen=True)
class Images:
    args: ModelArgs
    loss: str = "cross_entropy"

    def __call__(self, input_ids: torch.Tensor, labels: torch.Tensor, ctx: StepContext) -> Batch:
        a = self.args
        if input_ids.shape[-1] < a.pixels:
            raise ValueError(f"training.seq_len={input_ids.shape[-1]}: a vit row holds one {a.channels}x"
                             f"{a.image_size}x{a.image_size} image; set training.seq_len={a.pixels}")
        pixels = input_ids[:, :a.pixels].reshape(-1, a.channels, a.image_size, a.image_size)
        pixels = a.normalise(pixels)
        return Batch(inputs={"pixels": pixels}, labels=labels[:, 0] % max(a.n_classes, 1), primary="pixels",
                     sequence=())

    def dataset_problem(self, dataset: Any) -> str | None:
        """A dataset with more classes than the head has (an image folder's sorted class folders) would have its
        labels folded onto the head (modulo n_classes, which the procedural and mock sets rely on) unannounced."""
        n = getattr(dataset, "n_classes", 0)
        if n and self.args.n_classes and n > self.args.n_classes:
            return (f"model.args.n_classes={self.args.n_classes} but the training data has {n} classes; set "
                    f"model.args.n_classes={n}")
        return None

    def data_problem(self, data: Any) -> str | None:
        if data.dataset not in IMAGE_DATASETS:
            return (f"data.dataset={data.dataset!r}: vit trains on images; set data.dataset to one of "
                    f"{list(IMAGE_DATASETS)}")
        if data.dataset == "webdataset" and data.wds_target != "cls":  # tar shards: the class is the .cls member
            return (f"data.wds_target={data.wds_target!r}: vit trains on classes; set data.wds_target=\"cls\" "
                    "(the shards' .cls members)")
        if data.dataset == "webdataset" and data.image_size not in (0, self.args.image_size):
            return (f"data.image_size={data.image_size} but the model's image_size is {self.args.image_size}; set "
                    f"data.image_size={self.args.image_size} (or 0: from training.seq_len)")
        return None
