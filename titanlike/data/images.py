"""Image-classification datasets for vision families (models/vit): a row of pixel bytes and its class.

Every sample is `(input_ids [S], labels [S])` int64 like a token window, so the loader, the global-order sampler,
resume and resharding are the token datasets' (docs/data.md): input_ids holds one image's bytes (0..255) channel-
major, [C, H, W] flattened, with S = training.seq_len = C * H * W; every label is the image's class. The family's
objective (models/vit/objective.py) makes them pixels and one label per image.

- "shapes": a synthetic set drawn procedurally, no files: 10 classes = 5 shapes (square, disc, triangle, horizontal
  bar, vertical bar) x 2 colour families (warm, cool), at a random place and size, with colour jitter and background
  noise. Sample i is drawn from (seed, split, i) alone: deterministic, endless, any layout sees the same images.
- "image_folder": ImageNet's layout, data.paths = [ROOT]: ROOT/<split>/<class>/<image> (split "train" / "val";
  validation reads "val"), classes numbered in sorted order; each image resized (shorter side) and centre-cropped to
  the square side, RGB (decode_square, shared with WebDataset shards: titanlike/data/webdataset.py). Needs Pillow.
  An image Pillow cannot decode stops the run naming the file, or with data.bad_samples = "skip" is replaced by the
  next one (logged with a count).
"""
from __future__ import annotations

import logging
import math
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from titanlike.config.errors import ConfigError

logger = logging.getLogger(__name__)

CHANNELS = 3
N_SHAPES, N_COLOURS = 5, 2
SHAPES_CLASSES = N_SHAPES * N_COLOURS
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".webp", ".gif", ".tif", ".tiff")


def image_side(seq_len: int, dataset: str) -> int:
    """The square side whose RGB bytes fill a row of seq_len values; ValueError naming training.seq_len."""
    side = math.isqrt(seq_len // CHANNELS)
    if CHANNELS * side * side != seq_len:
        raise ValueError(f"training.seq_len={seq_len}: data.dataset={dataset!r} rows hold one {CHANNELS}-channel "
                         f"square image; set training.seq_len = 3 * image_size**2 (3072 for 32x32, 150528 for 224)")
    return side


def _row(image: np.ndarray, label: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.from_numpy(np.ascontiguousarray(image, dtype=np.int64).reshape(-1))
    return ids, torch.full_like(ids, label)


class ShapesDataset(Dataset):
    """Procedural shapes; its length is nominal (the sampler wraps), samples are a function of (seed, split, i)."""

    def __init__(self, seq_len: int, seed: int = 0, split: str = "train", num_samples: int = 1 << 30):
        self.side = image_side(seq_len, "shapes")
        self.seed, self.split_id = int(seed), ("train", "valid", "test").index(split)
        self.num_samples = int(num_samples)
        self.n_classes = SHAPES_CLASSES

    def __len__(self) -> int:
        return self.num_samples

    def draw(self, i: int) -> tuple[np.ndarray, int]:
        """(image uint8 [C, H, W], class)."""
        rng = np.random.default_rng([self.seed & 0xFFFFFFFF, self.split_id, int(i), 0x5A17E5])
        s = self.side
        label = int(rng.integers(SHAPES_CLASSES))
        shape, colour = divmod(label, N_COLOURS)
        image = rng.normal(90, 25, (CHANNELS, s, s))  # grey noisy background
        yy, xx = np.mgrid[0:s, 0:s].astype(np.float64)
        r = rng.uniform(0.18, 0.32) * s  # half size
        cy, cx = rng.uniform(r, s - r, 2)
        if shape == 0:
            mask = (np.abs(yy - cy) <= r) & (np.abs(xx - cx) <= r)
        elif shape == 1:
            mask = (yy - cy) ** 2 + (xx - cx) ** 2 <= r * r
        elif shape == 2:  # apex up: the width grows linearly from the top
            mask = (yy >= cy - r) & (yy <= cy + r) & (np.abs(xx - cx) <= (yy - (cy - r)) / 2)
        elif shape == 3:
            mask = (np.abs(yy - cy) <= r / 3) & (np.abs(xx - cx) <= r)
        else:
            mask = (np.abs(yy - cy) <= r) & (np.abs(xx - cx) <= r / 3)
        warm = np.array([220.0, rng.uniform(40, 160), 40.0])
        rgb = warm if colour == 0 else warm[::-1].copy()  # cool: blue-dominant
        rgb = rgb + rng.normal(0, 15, 3)
        image[:, mask] = rgb[:, None]
        return np.clip(image, 0, 255).astype(np.uint8), label

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        image, label = self.draw(i)
        return _row(image, label)


class ImageFolderDataset(Dataset):
    """ROOT/<split>/<class>/<image> files, decoded with Pillow on access (in the loader's workers)."""

    def __init__(self, root: str, seq_len: int, split: str = "train", bad_samples: str = "error"):
        self.side = image_side(seq_len, "image_folder")
        self.bad_samples, self.skipped = bad_samples, 0
        folder = Path(root) / ("train" if split == "train" else "val")
        if not folder.is_dir():
            raise ValueError(f"data.paths={root!r}: no {folder.name}/ folder of class folders (ImageNet's layout "
                             f"ROOT/train/<class>/*.JPEG, ROOT/val/<class>/*.JPEG)")
        self.classes = sorted(p.name for p in folder.iterdir() if p.is_dir())
        self.images = [(str(f), c) for c, name in enumerate(self.classes) for f in sorted((folder / name).iterdir())
                      if f.suffix.lower() in IMAGE_EXTENSIONS]
        if not self.images:
            raise ValueError(f"data.paths={root!r}: no images under {folder}/<class>/ (extensions "
                             f"{', '.join(IMAGE_EXTENSIONS)})")
        self.n_classes, self.folder = len(self.classes), folder

    def __len__(self) -> int:
        return len(self.images)

    # (`images`, not `files`: the data summary and the loader's resume identity take a `files` attribute for a
    # streaming text dataset's list of paths)
    def sources(self) -> list[list]:
        """The loader's resume identity: the folder, by what it holds (a resume over another image count or other
        classes is refused; a moved folder still resumes)."""
        return [[str(self.folder), f"{len(self)} images in classes {','.join(self.classes)}"]]

    def summary_lines(self, label: str, samples: int | None, whose: str) -> list[str]:
        run = f"; {whose} samples: {samples:,} ({samples / len(self):.2f} epochs)" if samples else ""
        return [f"{label}: image folder {self.folder}, {len(self):,} images in {self.n_classes:,} classes, as "
                f"{self.side}x{self.side} RGB{run}"]

    def _load(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        path, label = self.images[i]
        try:
            with open(path, "rb") as f:
                return _row(decode_square(f, self.side), label)
        except BadImage as e:
            raise BadImage(f"{path}: {e}") from None

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return first_good(self, i, self._load, "remove the file")


class BadImage(ValueError):
    """A sample that cannot become a row (an image Pillow cannot decode, a bad label); its message names where."""


class BadSampleError(ConfigError):
    """A bad sample with data.bad_samples = "error": one line naming the file (and member) and the fix.

    Raised in a loader worker, torch re-raises it in the main process as `type(e)(msg)` with msg = "Caught ... in
    DataLoader worker process N.\nOriginal Traceback ...": the constructor keeps the original last line, so the run
    still stops with the one line (scripts/train.py prints a ConfigError without a traceback)."""

    def __init__(self, message: str):
        if "Original Traceback" in message:
            last = message.rstrip().splitlines()[-1]
            message = last.split(": ", 1)[1] if last.startswith(("BadSampleError", "titanlike.")) else last
        super().__init__(message)


MAX_BAD_IN_A_ROW = 100  # skipping more than this many consecutive samples: the data, not a sample, is broken


def first_good(dataset, i: int, load, fix: str):
    """load(i), or with dataset.bad_samples == "skip" the first of i+1, i+2, ... (wrapping) that loads: the same
    sample for any layout, worker count or resume, so skipping keeps the resumed run equal to the uninterrupted one.
    Each skip is logged with this process's count (dataset.skipped)."""
    n = len(dataset)
    for k in range(min(n, MAX_BAD_IN_A_ROW + 1)):
        try:
            return load((i + k) % n)
        except BadImage as e:
            if dataset.bad_samples != "skip":
                raise BadSampleError(f"{e}; set data.bad_samples=\"skip\" to skip bad samples, or {fix}") from None
            dataset.skipped += 1
            logger.warning(f"data.bad_samples='skip': skipped {e} ({dataset.skipped} skipped in this process)")
    raise BadSampleError(f"{min(n, MAX_BAD_IN_A_ROW + 1)} bad samples in a row from sample {i} (the last: see the "
                         "warnings above): check data.paths; the data, not a sample, is broken")


def decode_square(fileobj, side: int) -> np.ndarray:
    """Encoded image bytes -> uint8 [3, side, side]: RGB, resized on the shorter side (bilinear), centre-cropped.
    Any decoding failure is BadImage with Pillow's reason (the caller names the file and the key)."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(fileobj) as im:
            im = im.convert("RGB")  # decodes everything: a truncated file fails here, not later
            scale = side / min(im.size)
            w, h = max(side, round(im.size[0] * scale)), max(side, round(im.size[1] * scale))
            if (w, h) != im.size:
                im = im.resize((w, h), Image.BILINEAR)
            left, top = (w - side) // 2, (h - side) // 2
            im = im.crop((left, top, left + side, top + side))
            return np.asarray(im, dtype=np.uint8).transpose(2, 0, 1).copy()  # HWC -> CHW
    except UnidentifiedImageError:  # (its message names a BytesIO object: nothing to read in it)
        raise BadImage("cannot decode the image (not a format Pillow reads)") from None
    except (OSError, SyntaxError, ValueError, ZeroDivisionError) as e:
        # (OSError: "image file is truncated"; SyntaxError: some of Pillow's plugins on bad headers)
        raise BadImage(f"cannot decode the image ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
                       ) from None


def build_shapes(data_cfg, tokenizer, *, seq_len, split, seed, **_):
    return ShapesDataset(seq_len, seed=seed, split=split)


def build_image_folder(data_cfg, tokenizer, *, seq_len, split, paths_key="data.paths", **_):
    try:
        import PIL  # noqa: F401
    except ImportError:
        raise ValueError("data.dataset='image_folder' decodes images with Pillow, which is not installed: "
                         "pip install pillow, or use data.dataset='shapes'") from None
    if len(data_cfg.paths) != 1:
        raise ValueError(f"{paths_key}={data_cfg.paths}: image_folder reads one root folder (ROOT/train/<class>/..)")
    return ImageFolderDataset(data_cfg.paths[0], seq_len, split=split, bad_samples=data_cfg.bad_samples)
