"""The LLaVA objective: a loader row = images_per_row image slots of pixel bytes (C*H*W values each, channel-major,
0..255, as the ViT rows of titanlike/data/images.py), then the token sequence with one run of image_tokens
placeholders per image. The k-th run of a row is its k-th slot's image; unused slots are ignored (a row may hold 0
to images_per_row images). The Batch keeps every slot ([B, K, C, H, W]: rows stay rows for a pipeline's
micro-batches) and each placeholder's feature index (image_pos, cut with the tokens by context parallel). The
pixels are normalised by the tower's model.args.pixel_stats (models/vit/args.py: (x/255 - mean) / std).

Packed rows (data.wds_layout = "pack"): several samples end to end, their images in the slots in order, each
sample's token count in the labels of the pixel part; `documents` numbers the samples, which the trainer hands the
model as doc_ids / positions under data.document_masking / data.reset_position_ids (titanlike/train/batch.py).

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
from models.llava.model import image_positions

LLAVA_DATASETS = ("shapes_captions", "webdataset", "mock_image_text")  # mock_image_text: throughput rows


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
        tokens, labels, docs = input_ids[:, head:], labels[:, head:], self.documents(labels, input_ids.shape[1] - head)
        v = a.vision
        slots = input_ids[:, :head].reshape(input_ids.shape[0], a.images_per_row, v.channels, v.image_size,
                                            v.image_size)
        counts = (tokens == a.image_token).sum(1)
        bad = (counts % a.image_tokens != 0) | (counts > a.images_per_row * a.image_tokens)
        if bool(bad.any()):  # one host sync per batch: a wrong row is refused before any work is wasted
            n = int(counts[bad][0])
            raise ValueError(f"llava: a row holds {n} image placeholders; each image needs exactly {a.image_tokens} "
                             f"and a row has at most model.args.images_per_row={a.images_per_row} images: fix the "
                             f"data or raise model.args.images_per_row")
        labels = labels.masked_fill(labels == a.image_token, IGNORE_INDEX)
        # Every slot, per row (the model ignores unused ones), and each placeholder's feature index: both follow the
        # rows through a pipeline's micro-batches, and image_pos is cut with the tokens under context parallel.
        inputs = {"tokens": tokens, "pixels": v.normalise(slots),
                  "image_pos": image_positions(tokens, a.image_token)}
        return Batch(inputs=inputs, labels=labels, sequence=("tokens", "labels", "image_pos"), documents=docs)

    def documents(self, labels: torch.Tensor, length: int) -> torch.Tensor:
        """[B, length] document numbers of the token part. A packed row (titanlike/data/webdataset_pack.py) holds each
        sample's token count in labels[:n] (every sample has an image, so n <= images_per_row); other rows hold
        IGNORE_INDEX there, so the row is one document. Positions past the last sample (padding) are one more."""
        ends = labels[:, :self.args.images_per_row].clamp(min=0).cumsum(1)  # [B, K]
        pos = torch.arange(length, device=labels.device)
        return (pos[None, :, None] >= ends[:, None, :]).sum(-1)

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
        if data.dataset == "mock_image_text":
            return self._mock_problem(data)
        return None

    def _mock_problem(self, data: Any) -> str | None:
        a = self.args
        want = (a.vision.image_size, a.image_tokens, a.images_per_row)
        if (data.image_size, data.image_tokens, data.images_per_row) != want:
            return (f"data.image_size={data.image_size}, data.image_tokens={data.image_tokens}, data.images_per_row="
                    f"{data.images_per_row}: the model takes {a.images_per_row} slot(s) of {want[0]}x{want[0]} images "
                    f"as {want[1]} tokens; set data.image_size={want[0]}, data.image_tokens={want[1]} and "
                    f"data.images_per_row={want[2]}")
        return None

    def _shards_problem(self, data: Any) -> str | None:
        a = self.args
        if data.wds_target == "cls":
            return "data.wds_target='cls': llava trains on text; set data.wds_target to \"txt\" or \"json\""
        if data.images_per_row != a.images_per_row:  # a sample's images fill the row's slots, up to this many
            return (f"data.images_per_row={data.images_per_row}: the model takes {a.images_per_row} image slot(s) per "
                    f"row (model.args.images_per_row); set data.images_per_row={a.images_per_row}")
        if (data.image_size, data.image_tokens) != (a.vision.image_size, a.image_tokens):
            return (f"data.image_size={data.image_size}, data.image_tokens={data.image_tokens}: the model takes "
                    f"{a.vision.image_size}x{a.vision.image_size} images as {a.image_tokens} tokens; set "
                    f"data.image_size={a.vision.image_size} and data.image_tokens={a.image_tokens}")
        return None
