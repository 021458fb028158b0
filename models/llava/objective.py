"""The LLaVA objective: a loader row = images_per_row image slots of pixel bytes (C*H*W values each, channel-major,
0..255, as the ViT rows of titanlike/data/images.py), then the token sequence with one run of image_tokens
placeholders per image. The k-th run of a row is its k-th slot's image; unused slots are ignored (a row may hold 0
to images_per_row images). The pixels are normalised as HF's ViTImageProcessor does ((x/255 - 0.5) / 0.5).

Targets: the loader's next-token labels of the token part (already IGNORE_INDEX where an SFT loader masks prompts:
loss only on answers), with every target that is a placeholder ignored too: text tokens are the only targets.

Validation metrics (eval_metrics, logged as validation/<name> by titanlike/train/evaluate.py):
  caption_accuracy        rows whose every target is the logits' argmax, over rows with targets. On shapes_captions
                          (a row's targets are its caption and the end word after the image) this is the exact-match
                          rate of greedy captioning: a greedy decode from the image emits the caption and stops iff
                          each step's argmax, given the caption so far, is the caption's next word, which is what the
                          teacher-forced logits show. So one validation forward measures it, no decode loop
                          (tests/unit/test_llava.py holds it to titanlike.infer.generate, image by image).
  caption_token_accuracy  targets that are the argmax, over targets."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from models.batch import IGNORE_INDEX, Batch, StepContext
from models.llava.args import ModelArgs

LLAVA_DATASETS = ("shapes_captions", "webdataset")


@dataclass(frozen=True)
class ImageText:
    args: ModelArgs
    loss: str = "cross_entropy"

    def __call__(self, input_ids: torch.Tensor, labels: torch.Tensor, ctx: StepContext) -> Batch:
        a = self.args
        head = a.images_per_row * a.pixels
        if input_ids.shape[1] <= head:
            raise ValueError(f"training.seq_len={input_ids.shape[1]}: a llava row starts with {a.images_per_row} "
                             f"image slots of {a.pixels} values; set training.seq_len above {head}")
        tokens, labels = input_ids[:, head:], labels[:, head:]
        v = a.vision
        slots = input_ids[:, :head].reshape(input_ids.shape[0], a.images_per_row, v.channels, v.image_size,
                                            v.image_size)
        # images per row from its placeholders (a wrong count is the model's one-line error, naming both counts)
        used = ((tokens == a.image_token).sum(1) + a.image_tokens - 1) // a.image_tokens
        take = torch.arange(a.images_per_row, device=tokens.device)[None, :] < used.clamp(max=a.images_per_row)[:, None]
        pixels = slots[take].to(torch.float32) / 127.5 - 1.0
        labels = labels.masked_fill(labels == a.image_token, IGNORE_INDEX)
        return Batch(inputs={"tokens": tokens, "pixels": pixels}, labels=labels)

    @staticmethod
    def eval_metrics(output: torch.Tensor, batch: Batch) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        labels = batch.labels
        target = labels != IGNORE_INDEX
        hit = (output.argmax(-1) == labels) & target
        rows = target.any(1)
        exact = rows & (hit.sum(1) == target.sum(1))
        return {"caption_accuracy": (exact.sum(), rows.sum()), "caption_token_accuracy": (hit.sum(), target.sum())}

    def data_problem(self, data: Any) -> str | None:
        if data.dataset not in LLAVA_DATASETS:
            return (f"data.dataset={data.dataset!r}: llava trains on image + text rows; set data.dataset to one "
                    f"of {list(LLAVA_DATASETS)}")
        if data.dataset == "webdataset":  # tar shards (titanlike/data/webdataset.py): their rows need the geometry
            return self._shards_problem(data)
        return None

    def _shards_problem(self, data: Any) -> str | None:
        a = self.args
        if data.wds_target == "cls":
            return "data.wds_target='cls': llava trains on text; set data.wds_target to \"txt\" or \"json\""
        if a.images_per_row != 1:
            return (f"model.args.images_per_row={a.images_per_row}: a webdataset sample holds one image; set "
                    "model.args.images_per_row=1")
        if (data.image_size, data.image_tokens) != (a.vision.image_size, a.image_tokens):
            return (f"data.image_size={data.image_size}, data.image_tokens={data.image_tokens}: the model takes "
                    f"{a.vision.image_size}x{a.vision.image_size} images as {a.image_tokens} tokens; set "
                    f"data.image_size={a.vision.image_size} and data.image_tokens={a.image_tokens}")
        return None
