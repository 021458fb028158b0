"""Write WebDataset-style tar shards, and a tiny set of them from the procedural shapes (no download).

`write_shards` takes samples as {extension: bytes} dicts and writes `prefix-000000.tar`, ... with `per_shard` samples
each; every shard is written under a temporary name and renamed when complete, so a reader never sees half a shard.
Members carry a fixed mtime and owner, so the same samples give byte-identical shards.

`write_shapes_shards` draws shapes_captions' images (titanlike/data/image_text.py: a coloured shape at one of 9
places) and writes each sample with every target a family reads: `.png` (lossless: the decoded bytes equal the drawn
ones), `.txt` (the caption), `.json` (a two-turn LLaVA conversation: "what is it" / the shape, "where is it" / the
place) and `.cls` (the colour, 0..3). With images_per_sample K > 1 a sample holds K drawn images as `0.png`, ...
(multi-image rows: data.images_per_row >= K), the caption "a red circle at top left and a blue square at bottom
right", one `<image>` marker per image in the conversation. scripts/make_shape_shards.py runs it; tests and
configs/llava_wds_debug.toml use it.

`write_jpeg_shards` writes the image-classification shapes (titanlike/data/images.py) at any side as JPEG, with a
`.cls` (the class, 0..9) and a `.txt` (the shape's name in image_text.py's words, for llava rows): input whose decode
costs what a real corpus's does, for the benchmarks' data share (scripts/bench/benchmark.py --data jpeg; K images a
sample with images_per_sample, for llava's --images K).
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


def image_members(images: list[bytes], ext: str) -> dict[str, bytes]:
    """One image as `ext` (today's layout), several as `0.ext`, `1.ext`, ... (energon's multi-image samples)."""
    return {ext: images[0]} if len(images) == 1 else {f"{j}.{ext}": b for j, b in enumerate(images)}


def shapes_samples(n: int, seed: int = 0, split: str = "train", images_per_sample: int = 1):
    """(key, {png, txt, json, cls}) for shapes_captions' samples 0..n-1; with images_per_sample K, sample i holds the
    drawn images i*K .. i*K+K-1 (`0.png`, `1.png`, ...), its caption their captions joined by "and", its
    conversation "what is it" / "where is it" about each image in turn (an `<image>` marker in the first question of
    each), its class the first image's colour."""
    from PIL import Image

    from titanlike.data.image_text import COLOURS, PIXELS, ShapesCaptions

    source = ShapesCaptions(PIXELS + 64, 64, seed=seed, split=split)
    k = images_per_sample
    for i in range(n):
        pngs, captions, conversation = [], [], []
        for j in range(k):
            image, caption = source.draw(i * k + j)
            png = io.BytesIO()
            Image.fromarray(image.transpose(1, 2, 0)).save(png, format="PNG")
            pngs.append(png.getvalue())
            captions.append(caption)
            words = caption.split()  # "a red circle at top left"
            conversation += [{"from": "human", "value": "<image>\nwhat is it"},
                             {"from": "gpt", "value": " ".join(words[:3])},
                             {"from": "human", "value": "where is it"},
                             {"from": "gpt", "value": " ".join(words[3:])}]
        colour = str(list(COLOURS).index(captions[0].split()[1])).encode()
        yield f"{i:06d}", {**image_members(pngs, "png"), "txt": " and ".join(captions).encode(),
                           "json": json.dumps(conversation).encode(), "cls": colour}


def write_shapes_shards(folder: str | Path, samples: int = 64, per_shard: int = 16, seed: int = 0,
                        split: str = "train", images_per_sample: int = 1) -> list[str]:
    return write_shards(folder, shapes_samples(samples, seed, split, images_per_sample), per_shard,
                        prefix=f"shapes-{split}")


def jpeg_samples(n: int, side: int, seed: int = 0, split: str = "train", quality: int = 90,
                 images_per_sample: int = 1):
    """(key, {jpg, cls, txt}) for the shapes set's samples 0..n-1 drawn at side x side; with images_per_sample K,
    sample i holds the drawn images i*K .. i*K+K-1 (`0.jpg`, ...), its .txt their names, its .cls the first's."""
    from PIL import Image

    from titanlike.data.image_text import SHAPES
    from titanlike.data.images import CHANNELS, ShapesDataset

    source = ShapesDataset(CHANNELS * side * side, seed=seed, split=split)
    k = images_per_sample
    for i in range(n):
        jpgs, labels = [], []
        for j in range(k):
            image, label = source.draw(i * k + j)
            jpg = io.BytesIO()
            Image.fromarray(image.transpose(1, 2, 0)).save(jpg, format="JPEG", quality=quality)
            jpgs.append(jpg.getvalue())
            labels.append(label)
        text = " and ".join(f"a {SHAPES[label % len(SHAPES)]}" for label in labels)
        yield f"{i:06d}", {**image_members(jpgs, "jpg"), "cls": str(labels[0]).encode(), "txt": text.encode()}


def write_jpeg_shards(folder: str | Path, side: int, samples: int = 1024, per_shard: int = 256, seed: int = 0,
                      split: str = "train", images_per_sample: int = 1) -> list[str]:
    return write_shards(folder, jpeg_samples(samples, side, seed, split, images_per_sample=images_per_sample),
                        per_shard, prefix=f"shapes{side}-{split}")
