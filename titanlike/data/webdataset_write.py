"""Write WebDataset-style tar shards, and a tiny set of them from the procedural shapes (no download).

`write_shards` takes samples as {extension: bytes} dicts and writes `prefix-000000.tar`, ... with `per_shard` samples
each; every shard is written under a temporary name and renamed when complete, so a reader never sees half a shard.
Members carry a fixed mtime and owner, so the same samples give byte-identical shards.

`write_shapes_shards` draws shapes_captions' images (titanlike/data/image_text.py: a coloured shape at one of 9
places) and writes each sample with every target a family reads: `.png` (lossless: the decoded bytes equal the drawn
ones), `.txt` (the caption), `.json` (a two-turn LLaVA conversation: "what is it" / the shape, "where is it" / the
place) and `.cls` (the colour, 0..3). scripts/make_shape_shards.py runs it; tests and configs/llava_wds_debug.toml
use it.

`write_jpeg_shards` writes the image-classification shapes (titanlike/data/images.py) at any side as JPEG, with a
`.cls` (the class, 0..9) and a `.txt` (the shape's name in image_text.py's words, for llava rows): input whose decode
costs what a real corpus's does, for the benchmarks' data share (scripts/bench/benchmark.py --data jpeg).
"""
from __future__ import annotations

import io
import json
import os
import tarfile
from pathlib import Path


def write_shards(folder: str | Path, samples, per_shard: int, prefix: str = "shard") -> list[str]:
    """samples: iterable of (key, {ext: bytes}); returns the shard paths written."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    paths, tar, tmp, count = [], None, None, 0

    def close():
        tar.close()
        os.replace(tmp, paths[-1])  # atomic: the shard appears whole or not at all

    for key, members in samples:
        if tar is None or count == per_shard:
            if tar is not None:
                close()
            paths.append(str(folder / f"{prefix}-{len(paths):06d}.tar"))
            tmp = paths[-1] + ".tmp"
            tar, count = tarfile.open(tmp, "w", format=tarfile.USTAR_FORMAT), 0
        for ext, data in members.items():
            info = tarfile.TarInfo(f"{key}.{ext}")
            info.size, info.mtime, info.mode, info.uname, info.gname = len(data), 0, 0o644, "", ""
            tar.addfile(info, io.BytesIO(data))
        count += 1
    if tar is not None:
        close()
    return paths


def shapes_samples(n: int, seed: int = 0, split: str = "train"):
    """(key, {png, txt, json, cls}) for shapes_captions' samples 0..n-1."""
    from PIL import Image

    from titanlike.data.image_text import COLOURS, PIXELS, ShapesCaptions

    source = ShapesCaptions(PIXELS + 64, 64, seed=seed, split=split)
    for i in range(n):
        image, caption = source.draw(i)
        png = io.BytesIO()
        Image.fromarray(image.transpose(1, 2, 0)).save(png, format="PNG")
        words = caption.split()  # "a red circle at top left"
        conversation = [{"from": "human", "value": "<image>\nwhat is it"},
                        {"from": "gpt", "value": " ".join(words[:3])},
                        {"from": "human", "value": "where is it"},
                        {"from": "gpt", "value": " ".join(words[3:])}]
        yield f"{i:06d}", {"png": png.getvalue(), "txt": caption.encode(), "json": json.dumps(conversation).encode(),
                           "cls": str(list(COLOURS).index(words[1])).encode()}


def write_shapes_shards(folder: str | Path, samples: int = 64, per_shard: int = 16, seed: int = 0,
                        split: str = "train") -> list[str]:
    return write_shards(folder, shapes_samples(samples, seed, split), per_shard, prefix=f"shapes-{split}")


def jpeg_samples(n: int, side: int, seed: int = 0, split: str = "train", quality: int = 90):
    """(key, {jpg, cls, txt}) for the shapes set's samples 0..n-1 drawn at side x side."""
    from PIL import Image

    from titanlike.data.image_text import SHAPES
    from titanlike.data.images import CHANNELS, ShapesDataset

    source = ShapesDataset(CHANNELS * side * side, seed=seed, split=split)
    for i in range(n):
        image, label = source.draw(i)
        jpg = io.BytesIO()
        Image.fromarray(image.transpose(1, 2, 0)).save(jpg, format="JPEG", quality=quality)
        yield f"{i:06d}", {"jpg": jpg.getvalue(), "cls": str(label).encode(),
                           "txt": f"a {SHAPES[label % len(SHAPES)]}".encode()}


def write_jpeg_shards(folder: str | Path, side: int, samples: int = 1024, per_shard: int = 256, seed: int = 0,
                      split: str = "train") -> list[str]:
    return write_shards(folder, jpeg_samples(samples, side, seed, split), per_shard, prefix=f"shapes{side}-{split}")
