"""Image + text rows for image-text families (models/llava): "shapes_captions", a procedural set that needs no
download. Sample i (a function of (seed, split, i) alone: deterministic, endless, resumable like the other sets) is
one 32x32 RGB image of a coloured shape on a noisy background and its caption, e.g. "a red circle at top left".
With data.caption_digits = p > 0, that share of the images also carry a dark digit 0-9 drawn on the shape from
DIGIT_FONT (3x5 pixels, centred on the shape) and the caption names it: "a red circle at top left with the digit 7".
The digit is drawn from its own random stream, so every image is the same as without it apart from the digit's lit
pixels (and a set without digits is unchanged).

Row layout (models/llava/objective.py reads it): the image's bytes (3 * 32 * 32 values, channel-major), then
PLACEHOLDERS copies of the image token (the last id of the vocabulary: model.args.image_token_id = -1), the caption's
word ids and an end id, zero-padded to training.seq_len. Labels are the next token of the text part; everything
else (pixels, the padding) is IGNORE_INDEX, and the objective ignores targets that are placeholders, so the loss is
on the caption alone. Words are ids of a fixed list (WORDS: id = index + 1; 0 pads), so any tokenizer with a
vocabulary above len(WORDS) + 2 (NullTokenizer, builtin_vocab_size) works and none is read."""
from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import Dataset

from models.batch import IGNORE_INDEX

SIDE, CHANNELS, PATCH = 32, 3, 8
PIXELS = CHANNELS * SIDE * SIDE
PLACEHOLDERS = (SIDE // PATCH) ** 2  # the llava debug flavor's patches per image
COLOURS = {"red": (220, 40, 40), "green": (40, 200, 60), "blue": (40, 70, 220), "yellow": (220, 210, 40)}
SHAPES = ("square", "circle", "triangle")
ROWS, COLS = ("top", "middle", "bottom"), ("left", "center", "right")
DIGITS = tuple(str(d) for d in range(10))
# (the question words last, for the conversations of scripts/make_shape_shards.py, then "and" for its multi-image
# captions, then the digit captions' words: appended, so earlier ids never move)
WORDS = ("a", "at", "<end>", *COLOURS, *SHAPES, *ROWS, *COLS, "what", "where", "is", "it", "and", "with", "the",
         "digit", *DIGITS)
WORD_ID = {w: i + 1 for i, w in enumerate(WORDS)}
# 0-9 as 3 wide x 5 tall bitmaps, one string a row ("#": ink): small enough to sit inside the smallest shape
DIGIT_FONT = np.array([[[c == "#" for c in row] for row in glyph.split()] for glyph in (
    "### #.# #.# #.# ###", ".#. ##. .#. .#. ###", "### ..# ### #.. ###", "### ..# ### ..# ###", "#.# #.# ### ..# ..#",
    "### #.. ### ..# ###", "### #.. ### #.# ###", "### ..# .#. .#. .#.", "### #.# ### #.# ###", "### #.# ### ..# ###")])
DIGIT_INK = (20, 20, 20)
CAPTION_WORDS = 11  # the longest caption, "a red circle at top left with the digit 7", and its end word


class ShapesCaptions(Dataset):
    def __init__(self, seq_len: int, vocab_size: int, seed: int = 0, split: str = "train",
                 num_samples: int = 1 << 30, digits: float = 0.0):
        text, words = seq_len - PIXELS, (CAPTION_WORDS if digits > 0 else 8)  # (with the end word)
        if text < PLACEHOLDERS + words:
            raise ValueError(f"training.seq_len={seq_len}: a shapes_captions row holds {PIXELS} pixel values, "
                             f"{PLACEHOLDERS} image tokens and a caption of up to {words} tokens; set "
                             f"training.seq_len >= {PIXELS + PLACEHOLDERS + words}")
        if not 0 <= digits <= 1:
            raise ValueError(f"data.caption_digits={digits}: the share of images carrying a digit must be in [0, 1]")
        if vocab_size < len(WORDS) + 2:
            raise ValueError(f"model.vocab_size={vocab_size}: shapes_captions needs {len(WORDS) + 2} ids (its words, "
                             f"padding and the image token); set data.builtin_vocab_size >= {len(WORDS) + 2}")
        self.seq_len, self.image_token = seq_len, vocab_size - 1
        self.seed, self.split_id = int(seed), ("train", "valid", "test").index(split)
        self.num_samples, self.digits = int(num_samples), float(digits)

    def __len__(self) -> int:
        return self.num_samples

    def digit(self, i: int) -> int | None:
        """Sample i's digit, or None: its own stream, so the shape's draws stay those of a set without digits."""
        if self.digits <= 0:
            return None
        rng = np.random.default_rng([self.seed & 0xFFFFFFFF, self.split_id, int(i), 0xD1617])
        present, d = rng.random() < self.digits, int(rng.integers(10))
        return d if present else None

    def draw(self, i: int) -> tuple[np.ndarray, str]:
        """(image uint8 [C, H, W], caption)."""
        rng = np.random.default_rng([self.seed & 0xFFFFFFFF, self.split_id, int(i), 0xCA9710])
        colour, shape = rng.integers(len(COLOURS)), rng.integers(len(SHAPES))
        row, col = rng.integers(3), rng.integers(3)
        image = rng.normal(110, 20, (CHANNELS, SIDE, SIDE))
        yy, xx = np.mgrid[0:SIDE, 0:SIDE].astype(np.float64)
        r = rng.uniform(3.5, 5.0)
        cy, cx = (row + 0.5) * SIDE / 3 + rng.uniform(-1, 1), (col + 0.5) * SIDE / 3 + rng.uniform(-1, 1)
        if shape == 0:
            mask = (np.abs(yy - cy) <= r) & (np.abs(xx - cx) <= r)
        elif shape == 1:
            mask = (yy - cy) ** 2 + (xx - cx) ** 2 <= r * r
        else:  # apex up
            mask = (yy >= cy - r) & (yy <= cy + r) & (np.abs(xx - cx) <= (yy - (cy - r)) / 2)
        name = list(COLOURS)[colour]
        image[:, mask] = (np.array(COLOURS[name]) + rng.normal(0, 12, 3))[:, None]
        caption = f"a {name} {SHAPES[shape]} at {ROWS[row]} {COLS[col]}"
        d = self.digit(i)
        if d is not None:
            top, left = digit_corner(cy, cx)
            image[:, top:top + 5, left:left + 3][:, DIGIT_FONT[d]] = np.array(DIGIT_INK, dtype=np.float64)[:, None]
            caption += f" with the digit {d}"
        return np.clip(image, 0, 255).astype(np.uint8), caption

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        image, caption = self.draw(i)
        words = [WORD_ID[w] for w in caption.split()] + [WORD_ID["<end>"]]
        text = [self.image_token] * PLACEHOLDERS + words
        ids = torch.zeros(self.seq_len, dtype=torch.int64)
        ids[:PIXELS] = torch.from_numpy(image.astype(np.int64).reshape(-1))
        ids[PIXELS:PIXELS + len(text)] = torch.tensor(text)
        labels = torch.full_like(ids, IGNORE_INDEX)
        labels[PIXELS:PIXELS + len(text) - 1] = torch.tensor(text[1:])  # next token; the end predicts nothing
        return ids, labels


def digit_corner(cy: float, cx: float) -> tuple[int, int]:
    """Top-left pixel of the 3x5 digit centred on the shape's centre (always inside the 32x32 image: the centre is
    at least 4.3 pixels from an edge)."""
    return int(round(cy)) - 2, int(round(cx)) - 1


class MockImageText(Dataset):
    """Throughput rows for llava at any tower size (data.dataset = "mock_image_text"): images_per_row slots of random
    pixel bytes (side x side), then seq_len - slots tokens of random text below the image token with one run of
    image_tokens placeholders per slot, the runs spread evenly over the text (run k starts at k x text / K), as an
    interleaved document with K images. Labels: the next token of the text (placeholders then ignored by the
    objective). Sample i from (seed, split, i) alone. Nothing to learn: for speed, like "mock" for text."""

    def __init__(self, seq_len: int, vocab_size: int, side: int, image_tokens: int, images_per_row: int,
                 seed: int = 0, split: str = "train", num_samples: int = 1 << 30):
        self.head = images_per_row * CHANNELS * side * side
        self.text = seq_len - self.head
        if side < 1 or image_tokens < 1 or images_per_row < 1:
            raise ValueError(f"data.image_size={side}, data.image_tokens={image_tokens}, data.images_per_row="
                             f"{images_per_row}: mock_image_text needs all three >= 1 (the tower's side, its tokens "
                             "per image, the slots per row: model.args.images_per_row)")
        if self.text < images_per_row * image_tokens + 1:
            raise ValueError(f"training.seq_len={seq_len}: {images_per_row} slots of {side}x{side} pixels and "
                             f"{images_per_row} x {image_tokens} image tokens need training.seq_len >= "
                             f"{self.head + images_per_row * image_tokens + 1}")
        self.seq_len, self.side, self.image_tokens, self.k = seq_len, side, image_tokens, images_per_row
        self.vocab_size, self.image_token = vocab_size, vocab_size - 1
        self.seed, self.split_id = int(seed), ("train", "valid", "test").index(split)
        self.num_samples = int(num_samples)

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        rng = np.random.default_rng([self.seed & 0xFFFFFFFF, self.split_id, int(i), 0x3A6E])
        ids = torch.empty(self.seq_len, dtype=torch.int64)
        ids[:self.head] = torch.from_numpy(rng.integers(0, 256, self.head, dtype=np.int64))
        text = rng.integers(0, max(self.image_token, 1), self.text, dtype=np.int64)
        for k in range(self.k):
            start = k * self.text // self.k
            text[start:start + self.image_tokens] = self.image_token
        ids[self.head:] = torch.from_numpy(text)
        labels = torch.full_like(ids, IGNORE_INDEX)
        labels[self.head:-1] = ids[self.head + 1:]
        return ids, labels


def build_mock_image_text(data_cfg, tokenizer, *, seq_len, split, seed, vocab_size=None, **_):
    vocab = vocab_size if vocab_size is not None else tokenizer.vocab_size
    return MockImageText(seq_len, vocab, data_cfg.image_size, data_cfg.image_tokens, data_cfg.images_per_row,
                         seed=seed, split=split)


def build_shapes_captions(data_cfg, tokenizer, *, seq_len, split, seed, vocab_size=None, **_):
    vocab = vocab_size if vocab_size is not None else tokenizer.vocab_size
    return ShapesCaptions(seq_len, vocab, seed=seed, split=split, digits=data_cfg.caption_digits)
