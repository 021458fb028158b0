"""Images for a vision-language model's prompts (models/llava): files read with Pillow, resized and normalised as the
model's tower expects, and the prompts' image placeholders expanded to the tower's feature count.

    prep = image_prep(loaded)                          # size, mean/std, resampling: an HF folder's processor file or
    pixels = load_pixels(["cat.png"], prep)            # the tower's defaults -> [N, C, H, W] float32
    prompts = expand_placeholders(prompts, args.image_token, args.image_tokens, n_images=1)
    generate(loaded.model, prompts, pixels=pixels, max_new_tokens=16)

A prompt marks each image with one placeholder (the image token id; in text, IMAGE_TEXT, as HF's llava processors
do); expansion repeats it once per image feature, and the images fill the placeholders in order, prompt by prompt
(what the model's forward splices: models/llava/model.py). Errors are one line (ValueError) naming the flag and the
fix.
"""
from __future__ import annotations

import dataclasses
import json
import os

import torch

IMAGE_TEXT = "<image>"  # the placeholder in a text prompt (HF llava processors' image_token)
# Pillow's resampling filters by the numbers HF processor files store (PIL.Image.Resampling values)
_RESAMPLE = {0: "NEAREST", 1: "LANCZOS", 2: "BILINEAR", 3: "BICUBIC", 4: "BOX", 5: "HAMMING"}


@dataclasses.dataclass(frozen=True)
class ImagePrep:
    size: int  # the tower's square input side (model.args.vision.image_size)
    channels: int
    mean: tuple[float, ...]  # per channel, after scaling to 0..1
    std: tuple[float, ...]
    resample: int  # a PIL.Image.Resampling value
    source: str  # where the values came from (shown with errors)


def takes_images(args) -> bool:
    """Whether a family's args describe an image-text model (a tower and placeholders per image)."""
    return getattr(args, "vision", None) is not None and hasattr(args, "image_tokens")


def image_prep(loaded) -> ImagePrep:
    """An HF folder's preprocessor_config.json (image_mean / image_std / resample, as its export or the hub wrote
    them), over the tower's own settings: what the family's HF adapter exports (`preprocessor_config(args)`: the
    mean and std training used, model.args.pixel_stats, and the resampling of the tower's HF processor)."""
    args = loaded.args
    if not takes_images(args):
        name = getattr(loaded.spec, "name", type(loaded.model).__name__)
        raise ValueError(f"--image: the {name} model at {loaded.source} takes no images (only an image-text family "
                         f"such as llava does); drop --image")
    v = args.vision
    cfg, source = loaded.spec.hf.preprocessor_config(args), "the tower's defaults"
    path = os.path.join(loaded.source, "preprocessor_config.json")
    if os.path.isfile(path):
        try:
            with open(path) as f:
                cfg, source = {**cfg, **json.load(f)}, path
        except (OSError, ValueError) as e:
            raise ValueError(f"{path} cannot be read ({e}); fix or remove it to use the tower's defaults") from None
    mean, std = tuple(cfg["image_mean"]), tuple(cfg["image_std"])
    if len(mean) != v.channels or len(std) != v.channels:
        raise ValueError(f"{path}: image_mean / image_std have {len(mean)} / {len(std)} values for a tower of "
                         f"{v.channels} channels; fix them or remove the file")
    # the tower's size wins: its position table has one row per patch of image_size (a crop_size / size that differ
    # would only make the forward refuse the images)
    return ImagePrep(v.image_size, v.channels, mean, std, int(cfg["resample"]), source)


def load_pixels(paths: list[str], prep: ImagePrep) -> torch.Tensor:
    """Image files -> [N, C, H, W] float32: RGB (or L for one channel), resized to size x size (an image of that size
    is kept as it is), scaled to 0..1 and normalised by prep's mean / std."""
    try:
        from PIL import Image, UnidentifiedImageError
    except ImportError:
        raise ValueError("--image needs Pillow to read image files: pip install pillow") from None
    mode = {1: "L", 3: "RGB"}.get(prep.channels)
    if mode is None:
        raise ValueError(f"--image: the tower takes {prep.channels} channels; image files give 1 (L) or 3 (RGB)")
    resample = getattr(Image.Resampling, _RESAMPLE.get(prep.resample, "BICUBIC"))
    out = []
    for path in paths:
        if not os.path.isfile(path):
            raise ValueError(f"--image {path}: no such file; give the path of an image file (PNG, JPEG, ...)")
        try:
            with Image.open(path) as im:
                im = im.convert(mode)
                if im.size != (prep.size, prep.size):
                    im = im.resize((prep.size, prep.size), resample=resample)
                data = torch.frombuffer(bytearray(im.tobytes()), dtype=torch.uint8)
        except (UnidentifiedImageError, OSError, SyntaxError) as e:  # Pillow raises these for damaged files
            raise ValueError(f"--image {path}: Pillow cannot read it as an image ({type(e).__name__}); give an "
                             f"undamaged PNG or JPEG file") from None
        out.append(data.reshape(prep.size, prep.size, prep.channels).permute(2, 0, 1).float() / 255)
    pixels = torch.stack(out)
    mean = torch.tensor(prep.mean).view(1, -1, 1, 1)
    std = torch.tensor(prep.std).view(1, -1, 1, 1)
    return (pixels - mean) / std


def split_text(text: str) -> list[str]:
    """A text prompt's pieces around its IMAGE_TEXT placeholders (len = placeholders + 1)."""
    return text.split(IMAGE_TEXT)


def join_pieces(pieces: list[list[int]], image_token: int) -> list[int]:
    """Encoded text pieces joined by one image placeholder each (split_text's inverse, in ids)."""
    out = list(pieces[0])
    for piece in pieces[1:]:
        out += [image_token] + list(piece)
    return out


def expand_placeholders(prompts: list[list[int]], image_token: int, per_image: int, n_images: int,
                        flag: str = "--image") -> list[list[int]]:
    """Each image_token in the prompts becomes per_image of them (one image's features); refuses a count of
    placeholders other than n_images, naming both."""
    found = sum(p.count(image_token) for p in prompts)
    if found != n_images:
        raise ValueError(f"{n_images} {flag} file(s) but {found} image placeholder(s) in the prompts: put one "
                         f"{IMAGE_TEXT} in a text prompt (or the id {image_token} in --tokens) per image, in order")
    return [[t for tok in p for t in ([tok] * per_image if tok == image_token else [tok])] for p in prompts]
