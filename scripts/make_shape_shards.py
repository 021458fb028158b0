"""Write a tiny WebDataset shard set of procedural shapes (image + caption + conversation + class), no download:

    python scripts/make_shape_shards.py shapes_wds              # 256 train + 64 valid samples
    python scripts/train.py --config configs/llava_wds_debug.toml
    python scripts/make_shape_shards.py /tmp/jpeg224 --jpeg-side 224 --samples 2048   # JPEG, for speed runs
    python scripts/make_shape_shards.py /tmp/shapes2 --images-per-sample 2   # 2 images a sample (.0.png, .1.png)

Shards are shapes-train-000000.tar ... and shapes-valid-000000.tar ...; titanlike/data/webdataset_write.py says what
each sample holds.
"""
from __future__ import annotations

import argparse
import sys

from titanlike.data.webdataset_write import write_jpeg_shards, write_shapes_shards


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("folder")
    p.add_argument("--samples", type=int, default=256, help="training samples (validation: a quarter)")
    p.add_argument("--per-shard", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--jpeg-side", type=int, default=0, help="N > 0: the classification shapes at NxN as JPEG "
                   "(shapesN-*.tar: .jpg, .cls, .txt), whose decode costs what a real corpus's does")
    p.add_argument("--images-per-sample", type=int, default=1, help="K > 1: K images a sample (KEY.0.png, ...; "
                   "train with data.images_per_row >= K)")
    a = p.parse_args(argv)
    if a.images_per_sample < 1:
        p.error(f"--images-per-sample={a.images_per_sample} must be >= 1")
    for split, n in (("train", a.samples), ("valid", max(1, a.samples // 4))):
        k = a.images_per_sample
        paths = (write_jpeg_shards(a.folder, a.jpeg_side, n, a.per_shard, a.seed, split, k) if a.jpeg_side > 0
                 else write_shapes_shards(a.folder, n, a.per_shard, a.seed, split, k))
        print(f"{split}: {n} samples in {len(paths)} shard(s): {paths[0]} ...")
    return 0


if __name__ == "__main__":
    sys.exit(main())
