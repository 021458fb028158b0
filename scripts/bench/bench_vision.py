"""benchmark.py's image families: ViT against timm (--peer timm, scripts/bench/peer_timm.py) and LLaVA against
transformers' LlavaForConditionalGeneration (--peer hf, scripts/bench/peer_hf_vlm.py).

Units, the same for both sides of a case:
- vit: images. A titanlike loader row is one image's 3 x side x side bytes (training.seq_len = that), so its logged
  tok/s counts pixel values; the benchmark divides it by the row length and reports images/s in the tok/s columns
  ("tps" in the JSON). FLOPs per image: models.vit.flops_per_image at the flavor's shape, for both. --seq is unused.
- llava: decoder tokens, --seq of them per row (text + each image's placeholders, 4096 in issue 39's case). A
  titanlike row is `images` slots of pixel bytes and then those tokens, so its tok/s is scaled by seq / row length.
  FLOPs per decoder token: titanlike's flops_per_token over the whole row (text at its own length + every slot's
  image FLOPs) x row length / seq, for both.
MFU: titanlike's own log line (its FLOPs over its loader values: the same ratio) and the peer's from the same FLOPs.

Data (--data): mock (the default for these families, also for --data stdlib): random pixel bytes and classes (vit:
data.dataset=mock) or random images + tokens with `images` placeholder runs spread over the text (llava:
data.dataset=mock_image_text); shapes (vit): procedural images drawn on the CPU; jpeg: WebDataset shards of JPEG
images at the tower's side, written once under --image-data (titanlike/data/webdataset_write.py), decoded in the
loader's workers: the decode cost is in the step (llava: `images` JPEGs a sample, KEY.0.jpg ..., one per slot).
titanlike's log line carries the share of the wall time its loop waited for the loader ("data N%", `data_pct` in the
JSON). The peers draw random tensors on the device: no loader.
"""
from __future__ import annotations

import dataclasses
import os

VISION_MODELS = ("vit", "llava")


def _args(case: dict, vocab: int):
    import models

    spec = models.get_spec(case["model"])
    args = spec.flavors[case["flavor"]]
    if case["model"] == "llava":
        args = dataclasses.replace(args, images_per_row=case["images"], vocab_size=vocab,
                                   max_seq_len=case["seq"])
    return spec, args


def row_len(case: dict) -> int:
    """titanlike's training.seq_len: one image's bytes (vit); the slots' bytes + seq tokens (llava)."""
    _, args = _args(case, 2)
    return args.pixels if case["model"] == "vit" else case["images"] * args.pixels + case["seq"]


def units_per_row(case: dict) -> int:
    """Images (vit) or decoder tokens (llava) in one row."""
    return 1 if case["model"] == "vit" else case["seq"]


def flops_per_unit(case: dict, vocab: int) -> float:
    spec, args = _args(case, vocab)
    if case["model"] == "vit":
        from models.vit import flops_per_image

        return float(flops_per_image(args))
    n = row_len(case)
    return spec.flops_per_token(args, n) * n / case["seq"]


def scale_ours(rows: list[dict], case: dict) -> list[dict]:
    """titanlike's parsed step lines with tok/s in the case's unit (images/s, decoder tokens/s)."""
    f = units_per_row(case) / row_len(case)
    return [{**r, "tps": r["tps"] * f} for r in rows]


def check_case(case: dict) -> None:
    if case["images"] < 1:
        raise ValueError(f"images={case['images']}: llava's images per row must be >= 1")
    if case["images"] != 1 and case["model"] != "llava":
        raise ValueError(f"images={case['images']} is llava's images per row; model={case['model']!r} reads one "
                         "image (vit) or none")


def jpeg_folder(opts, side: int, images: int = 1) -> str:
    """The JPEG shards at this side (images per sample: llava's --images) under --image-data, written when missing
    (2048 training samples)."""
    folder = os.path.join(opts.image_data, f"jpeg{side}" + (f"x{images}" if images > 1 else ""))
    if not os.path.isfile(os.path.join(folder, "done")):
        from titanlike.data.webdataset_write import write_jpeg_shards

        write_jpeg_shards(folder, side, samples=2048, per_shard=256, images_per_sample=images)
        open(os.path.join(folder, "done"), "w").close()
    return folder


def data_flags(case: dict, opts) -> list[str]:
    """titanlike's data and shape flags for an image case (after the generic ones: these win)."""
    _, args = _args(case, 2)
    side = args.image_size if case["model"] == "vit" else args.vision.image_size
    data = "mock" if opts.data == "stdlib" else opts.data
    flags = ["--validation.enable=false"]  # (training.seq_len: row_len, set by titanlike_cmd)
    if data not in ("mock", "shapes", "jpeg") or (data == "shapes" and case["model"] == "llava"):
        raise ValueError(f"--data {opts.data}: image families read mock, jpeg or (vit) shapes")
    k = case["images"]
    if data == "jpeg":  # llava: K images a sample (KEY.0.jpg, ...), filling the row's K slots
        folder = jpeg_folder(opts, side, k if case["model"] == "llava" else 1)
        flags += ["--data.dataset=webdataset", f"--data.paths={folder}/shapes{side}-train-*.tar"]
    if case["model"] == "vit":
        if data != "jpeg":
            flags.append(f"--data.dataset={data}")
        return flags + (["--data.wds_target=cls"] if data == "jpeg" else [])
    if data == "mock":
        flags.append("--data.dataset=mock_image_text")
    flags.append(f"--data.images_per_row={k}")
    return flags + [f"--data.image_size={side}", f"--data.image_tokens={args.image_tokens}",
                    *(["--data.wds_target=txt"] if data == "jpeg" else []),
                    f"--model.args={{images_per_row = {k}}}"]


def default_config(model: str, flavor: str) -> str:
    if flavor.startswith("debug"):
        return f"configs/{model}_debug.toml"
    return "configs/vit_l16.toml" if model == "vit" else "configs/llava_1b.toml"


def peer_args(case: dict, opts, vocab: int) -> list[str] | None:
    """The peer's own leading arguments for an image case; None where the peer does not run it."""
    import sys

    timm = os.path.basename(opts.peer) == "peer_timm.py"
    hf = os.path.basename(opts.peer) == "peer_hf.py"
    if case["model"] == "vit" and timm:
        return [sys.executable, opts.peer]
    if case["model"] == "llava" and hf:
        return [sys.executable, opts.peer, "--vocab", str(vocab), "--model", "llava", "--images", str(case["images"])]
    return None
