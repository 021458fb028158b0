"""WebDataset-style tar shards of images and their captions, conversations or classes (data.dataset = "webdataset").

The layout megatron-energon and the `webdataset` library read: plain (uncompressed) `.tar` files whose members are
grouped into samples by key, the member name up to the first dot of its base name: `000123.jpg` + `000123.txt` (a
caption), `000123.json` (a conversation) or `000123.cls` (a class id). A sample may hold several images, numbered as
energon's multi-image samples are: `000123.0.jpg`, `000123.1.jpg`, ... (slot order), up to data.images_per_row.
data.paths gives the shards: files, globs, brace patterns (`/data/shards-{000000..000099}.tar`, `{a,b}` lists too)
or folders (every `*.tar` under them).

Read with the stdlib's tarfile and Pillow, no new dependency. At build time every shard's headers are scanned (not
its data: tarfile seeks past it) into an index of (shard, member offsets); sample i then reads its members by
offset, so the dataset is map-style and the loader's global-order sampler gives it everything the token data has:
a seeded shuffle over all samples, each data-parallel rank a disjoint share of every batch, and an exact resume
under any DP degree or worker count. Images are decoded in the loader's workers (data.num_workers).

Rows (what data.wds_target picks; each family's objective checks the choice against its model), made by
titanlike/data/webdataset_rows.py:
- "cls": ViT rows as titanlike/data/images.py: the image's bytes (side from training.seq_len = 3 * side**2), every
  label its class. One image per sample.
- "txt" / "json": LLaVA rows as models/llava/objective.py reads them: data.images_per_row slots of the images' bytes
  (data.image_size; unused slots stay empty), then the text with a run of data.image_tokens placeholders (the
  vocabulary's last id) per image: a caption's runs first, a conversation's where its `<image>` markers stand (one
  per image); labels are the next token on the text only (a caption: all of it; a conversation: the assistant's
  turns and their end tokens, loss on answers only). Text is encoded by the run's tokenizer (its EOS ends a caption),
  a conversation rendered through a chat template (data.chat_template, else the tokenizer folder's, else LLaVA-1.5's
  "USER: ... ASSISTANT: ..."), or with NullTokenizer by image_text.py's word list, turn by turn, as shapes_captions
  is (the shards scripts/make_shape_shards.py writes). data.wds_layout = "pack" puts several samples in one row
  (titanlike/data/webdataset_pack.py).

Bad input (data.bad_samples): a sample whose image does not decode, whose class is not an integer, whose JSON is
not a conversation or whose `<image>` markers do not match its images stops the run in one line naming shard,
member and key ("error"), or is replaced by the next good sample, logged with a count ("skip"). Shards that are
truncated, not tar files, or hold incomplete samples, and samples with more images than data.images_per_row or
misnumbered ones, are found while indexing: "error" names the shard (and sample), "skip" keeps what is readable and
says how much was left out.
"""
from __future__ import annotations

import glob
import hashlib
import io
import logging
import os
import re
import tarfile

import torch
from torch.utils.data import Dataset

from titanlike.config.errors import ConfigError
from titanlike.data.images import BadImage, decode_square, first_good
from titanlike.data.tokenizers.null import NullTokenizer
from titanlike.data.webdataset_rows import ClassRows, TextRows, conversation_template

logger = logging.getLogger(__name__)

IMAGE_EXTS = ("jpg", "jpeg", "png", "webp", "bmp", "ppm", "gif", "tif", "tiff")  # first present wins
TARGETS = ("txt", "json", "cls")  # data.wds_target


def expand_braces(pattern: str) -> list[str]:
    """webdataset's brace notation: "a-{000..002}.tar" -> a-000, a-001, a-002 (zero padding kept), "{x,y}" lists."""
    m = re.search(r"\{([^{}]*)\}", pattern)
    if not m:
        return [pattern]
    head, tail, body = pattern[:m.start()], pattern[m.end():], m.group(1)
    if (r := re.fullmatch(r"(\d+)\.\.(\d+)", body)) is not None:
        lo, hi = r.groups()
        items = [str(k).zfill(len(lo)) for k in range(int(lo), int(hi) + 1)]
    else:
        items = body.split(",")
    return [p for item in items for p in expand_braces(head + item + tail)]


def expand_shards(patterns: list[str], key: str = "data.paths") -> list[str]:
    """data.paths -> the shard files, in order (each pattern's matches sorted); one line naming the pattern when a
    path is missing or a pattern matches nothing."""
    out: list[str] = []
    for pattern in " ".join(patterns).split():
        pattern = os.path.expanduser(pattern)
        for path in expand_braces(pattern):
            if os.path.isdir(path):
                found = sorted(glob.glob(os.path.join(path, "**", "*.tar"), recursive=True))
                what = f"folder {path!r} holds no *.tar shard"
            elif glob.has_magic(path):
                found = sorted(p for p in glob.glob(path, recursive=True) if os.path.isfile(p))
                what = f"{path!r} matches no file"
            else:
                found = [path] if os.path.isfile(path) else []
                what = f"shard {path!r} does not exist" + (f" (from the pattern {pattern!r})" if path != pattern
                                                           else "")
            if not found:
                raise ConfigError(f"{key}: {what}; give .tar shards as files, a brace pattern "
                                  "(\"/data/shards-{000000..000099}.tar\"), a glob or a folder")
            out += found
    return list(dict.fromkeys(out))


def _split_name(name: str) -> tuple[str, str]:
    """"dir/000123.seg.png" -> ("dir/000123", "seg.png"): the key ends at the base name's first dot (webdataset's)."""
    folder, _, base = name.rpartition("/")
    stem, dot, ext = base.partition(".")
    return (f"{folder}/{stem}" if folder else stem), ext.lower() if dot else ""


def sample_images(parts: dict) -> tuple[list[str], str | None]:
    """A sample's image members (extensions) in slot order: `jpg` alone, or `0.jpg`, `1.jpg`, ... (energon's multi-
    image samples), the first of IMAGE_EXTS where one slot has several; and a problem, when both forms or a gap in
    the numbers appear (which image goes to which <image> marker would be a guess)."""
    plain = next((e for e in IMAGE_EXTS if e in parts), None)
    numbers = {int(n) for n, dot, kind in (e.partition(".") for e in parts) if dot and n.isdigit()
               and kind in IMAGE_EXTS}
    if not numbers:
        return ([plain] if plain else []), None
    if plain is not None:
        return [], f"holds both an unnumbered image (.{plain}) and numbered ones (.0.<ext>, ...)"
    found = [next((f"{n}.{e}" for e in IMAGE_EXTS if f"{n}.{e}" in parts), None) for n in range(len(numbers))]
    if None in found:
        return [], f"numbers its images {sorted(numbers)}: want 0, 1, ... with no gap"
    return found, None


def index_shard(path: str, target: str, bad_samples: str, key: str = "data.paths", max_images: int = 1
                ) -> tuple[list[tuple], dict[str, int]]:
    """[(key, ((image name, offset, size), ...), target offset, size)] of one shard, and what was left out by
    reason; a sample with more than max_images images is bad (data.images_per_row: a row's slots)."""
    size = os.path.getsize(path)
    members: dict[str, dict[str, tuple[int, int]]] = {}
    problem = None
    try:
        with tarfile.open(path, "r:") as tar:  # "r:": uncompressed only; the samples are read by offset
            for m in tar:
                if not m.isfile():
                    continue
                if m.offset_data + m.size > size:
                    problem = f"truncated: member {m.name!r} ends past the file's {size} bytes"
                    break
                name, ext = _split_name(m.name)
                members.setdefault(name, {})[ext] = (m.offset_data, m.size)
            # tarfile ends silently at a short header: a file cut between members reads as a smaller archive.
            # Every tar writer ends with two zero blocks (the end-of-archive marker): without them it was cut.
            if problem is None:
                f = tar.fileobj
                f.seek(tar.offset)
                if f.read(1024) != bytes(1024):
                    problem = (f"truncated: no end-of-archive marker after its {len(members)} samples (the file ends "
                               f"at {size} bytes)")
    except (tarfile.ReadError, EOFError) as e:
        if str(e).startswith(("file could not be opened", "not a gzip", "invalid header")) and not members:
            problem = (f"not a readable tar file ({e}); shards are plain uncompressed .tar (a .tar.gz cannot be read "
                       "by offset: decompress it)")
        else:
            problem = f"truncated or corrupt after {len(members)} samples ({e})"
    if problem and bad_samples != "skip":
        raise ConfigError(f"{key}: shard {path}: {problem}; set data.bad_samples=\"skip\" to leave out what "
                          "cannot be read, or rewrite the shard")
    samples, left_out = [], {}
    if problem:
        left_out["in a truncated or unreadable shard (the rest of it)"] = 1
        logger.warning(f"data.bad_samples='skip': shard {path}: {problem}; kept its {len(members)} samples before")
    for name, parts in members.items():
        images, problem = sample_images(parts)
        missing = "an image" if not images and problem is None else None if target in parts else f"a .{target}"
        too_many = problem is None and missing is None and len(images) > max_images
        if too_many:
            extra = f"{name}.{images[max_images]}"
            vit = " (a vit row is one image)" if target == "cls" else ""
            problem = f"holds {len(images)} images, member {extra!r} past data.images_per_row={max_images}{vit}"
        if missing is not None or problem is not None:
            why = f"has no {missing} member (it has {sorted(parts)})" if missing else problem
            if bad_samples != "skip":
                fix = ("data.wds_target to the member that holds the target (txt, json, cls)" if missing else
                       "data.images_per_row to the most images a sample holds" if too_many and not vit else
                       "rewrite the shard")
                raise ConfigError(f"{key}: shard {path}: sample {name!r} {why}; set data.bad_samples=\"skip\" to "
                                  f"leave such samples out, or {fix}")
            reason = (f"without {missing}" if missing else "with too many images" if too_many else
                      "with misnumbered images")
            left_out[reason] = left_out.get(reason, 0) + 1
            continue
        samples.append((name, tuple((f"{name}.{e}", *parts[e]) for e in images), *parts[target]))
    return samples, left_out


class WebDatasetShards(Dataset):
    """The samples of a set of shards as map-style rows (see the module docstring); file handles are per process."""

    def __init__(self, shards: list[str], rows, *, target: str, bad_samples: str = "error",
                 paths_key: str = "data.paths"):
        self.shards, self.rows, self.target, self.bad_samples = list(shards), rows, target, bad_samples
        self.samples: list[tuple] = []
        self.left_out: dict[str, int] = {}
        for s, path in enumerate(self.shards):
            found, left_out = index_shard(path, target, bad_samples, paths_key, rows.images_per_row)
            self.samples += [(s, *sample) for sample in found]
            for why, n in left_out.items():
                self.left_out[why] = self.left_out.get(why, 0) + n
        if not self.samples:
            raise ConfigError(f"{paths_key}: {len(self.shards)} shard(s) hold no sample with an image and a "
                              f".{target} member; check data.wds_target (txt, json or cls) and the shards' names "
                              "(000123.jpg + 000123.txt)")
        sizes = [os.path.getsize(p) for p in self.shards]
        self.fingerprint = hashlib.sha256(f"wds|{target}|{sizes}|{len(self.samples)}|{rows.layout}".encode()
                                          ).hexdigest()[:16]
        self.skipped = 0  # samples replaced under bad_samples = "skip" (in this process)
        self._files: dict[int, object] = {}

    def __len__(self) -> int:
        return len(self.samples)

    def __getstate__(self):
        return {**self.__dict__, "_files": {}}  # each worker opens its own handles

    def _read(self, shard: int, offset: int, size: int) -> bytes:
        f = self._files.get(shard)
        if f is None:
            f = self._files[shard] = open(self.shards[shard], "rb")
        f.seek(offset)
        return f.read(size)

    def target_text(self, i: int) -> bytes:
        shard, _, _, tgt_off, tgt_size = self.samples[i]
        return self._read(shard, tgt_off, tgt_size)

    def naming(self, i: int, e: BadImage) -> BadImage:
        """A problem of sample i's target member, naming its shard, member and key."""
        shard, key = self.samples[i][:2]
        return BadImage(f"shard {self.shards[shard]} member {f'{key}.{self.target}'!r} of sample {key!r}: {e}")

    def images(self, i: int) -> list:
        shard, _, members = self.samples[i][:3]
        images = []
        for name, offset, size in members:
            try:
                images.append(decode_square(io.BytesIO(self._read(shard, offset, size)), self.rows.side))
            except BadImage as e:
                raise BadImage(f"shard {self.shards[shard]} member {name!r}: {e}") from None
        return images

    def _load(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        images = self.images(i)
        try:
            return self.rows(images, self.target_text(i))
        except BadImage as e:
            raise self.naming(i, e) from None

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return first_good(self, i, self._load, "rewrite the shard")

    def sources(self) -> list[list]:
        return [[p, f"{os.path.getsize(p)} bytes"] for p in self.shards]

    def summary_lines(self, label: str, samples: int | None, whose: str) -> list[str]:
        out = f"; left out: {self.left_out}" if self.left_out else ""
        run = f"; {whose} samples: {samples:,} ({samples / len(self):.2f} epochs)" if samples else ""
        return [f"{label}: webdataset, {len(self.shards)} shard(s), {len(self):,} samples (image + .{self.target}), "
                f"{self.rows.layout}{run}{out}"]


def build_webdataset(data_cfg, tokenizer, *, seq_len, split, vocab_size=None, paths_key="data.paths", seed=0, **_):
    try:
        import PIL  # noqa: F401
    except ImportError:
        raise ConfigError("data.dataset='webdataset' decodes images with Pillow, which is not installed: "
                          "pip install pillow") from None
    target = data_cfg.wds_target
    if target == "cls":
        rows = ClassRows(seq_len)
        if data_cfg.image_size and data_cfg.image_size != rows.side:
            raise ConfigError(f"data.image_size={data_cfg.image_size} but training.seq_len={seq_len} holds "
                              f"{rows.side}x{rows.side} images; set data.image_size={rows.side} (or 0)")
    else:
        if data_cfg.image_size < 1 or data_cfg.image_tokens < 1:
            raise ConfigError(f"data.image_size={data_cfg.image_size}, data.image_tokens={data_cfg.image_tokens}: "
                              f"caption / conversation rows need both (the llava tower's image size and "
                              "placeholders per image, e.g. 32 and 16 for the debug flavor)")
        vocab = vocab_size if vocab_size is not None else tokenizer.vocab_size
        words = tokenizer is None or isinstance(tokenizer, NullTokenizer)  # shapes shards: word ids, no template
        template = conversation_template(data_cfg, tokenizer) if target == "json" and not words else None
        rows = TextRows(seq_len, data_cfg.image_size, data_cfg.image_tokens, vocab, tokenizer, data_cfg.messages_key,
                        data_cfg.images_per_row, template)
    # no split: training and validation read their own shards (validation.paths), as streaming text does
    shards = WebDatasetShards(expand_shards(data_cfg.paths, paths_key), rows, target=target,
                              bad_samples=data_cfg.bad_samples, paths_key=paths_key)
    if data_cfg.wds_layout != "pack":
        return shards
    if target == "cls":
        raise ConfigError("data.wds_layout='pack' packs caption / conversation rows (llava); a vit row is one image: "
                          "set data.wds_layout=\"pad\"")
    from titanlike.data.webdataset_pack import PackedShards

    return PackedShards(shards, seed=seed)
