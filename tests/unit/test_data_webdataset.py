"""WebDataset tar shards (titanlike/data/webdataset.py): rows for llava (captions, conversations) and vit (classes),
exact resume, disjoint data-parallel shares, bad input in one line (data.bad_samples), training from shards."""
from __future__ import annotations

import dataclasses
import logging
import tarfile

import pytest
import torch

from models.batch import IGNORE_INDEX
from titanlike.config.errors import ConfigError
from titanlike.config.sections import Data
from titanlike.data.image_text import COLOURS, PIXELS, WORD_ID, ShapesCaptions
from titanlike.data.loader import build_dataloader

pytest.importorskip("PIL")
from titanlike.data.dataset import build_dataset  # noqa: E402
from titanlike.data.webdataset_write import write_shards, write_shapes_shards  # noqa: E402

torch.set_num_threads(1)
SEQ = PIXELS + 32
N, PER_SHARD = 24, 8  # 3 shards


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    folder = tmp_path_factory.mktemp("wds")
    return folder, write_shapes_shards(folder, N, PER_SHARD)


def cfg(paths, **kw):
    base = dict(dataset="webdataset", paths=[str(p) for p in paths], image_size=32, image_tokens=16)
    return dataclasses.replace(Data(), **{**base, **kw})


def one_line(e) -> str:
    msg = str(e.value)
    assert "\n" not in msg and "Traceback" not in msg, msg
    return msg


def test_rows_are_the_drawn_samples_for_every_target(shards):
    folder, paths = shards
    assert [p.rsplit("/", 1)[1] for p in paths] == [f"shapes-train-00000{i}.tar" for i in range(3)]
    assert not list(folder.glob("*.tmp"))  # written under temporary names, renamed whole
    again = write_shapes_shards(folder / "again", N, PER_SHARD)
    assert all(open(a, "rb").read() == open(b, "rb").read() for a, b in zip(paths, again))  # byte-identical
    brace = cfg([f"{folder}/shapes-train-{{000000..000002}}.tar"])
    ds = build_dataset(brace, None, seq_len=SEQ, vocab_size=64)
    for other in ([folder / "shapes-train-*.tar"], [folder]):  # glob, folder (again/ holds the same 24 once more)
        assert len(build_dataset(cfg(other), None, seq_len=SEQ, vocab_size=64)) in (N, 2 * N)
    assert len(ds) == N and ds.sources()[0][1] == f"{tarfile.os.path.getsize(paths[0])} bytes"

    # captions: the exact shapes_captions row (PNG is lossless); its labels but for the placeholders' own targets,
    # which the objective ignores anyway
    ref = ShapesCaptions(SEQ, 64)
    for i in (0, 9, 23):
        ids, labels = ds[i]
        want_ids, want_labels = ref[i]
        assert torch.equal(ids, want_ids)
        assert torch.equal(labels, want_labels.masked_fill(want_labels == 63, IGNORE_INDEX))
    assert int((ds[0][1] != IGNORE_INDEX).sum()) == 7  # 6 words + <end>, the first predicted by the last placeholder

    # conversations: loss on the two answers (and their ends) only
    conv = build_dataset(cfg(paths, wds_target="json"), None, seq_len=SEQ, vocab_size=64)
    ids, labels = conv[0]
    text = ids[PIXELS:].tolist()
    q1 = [WORD_ID[w] for w in ("what", "is", "it")]
    assert text[16:19] == q1 and text[:16] == [63] * 16
    _, caption = ref.draw(0)
    a1 = [WORD_ID[w] for w in caption.split()[:3]] + [WORD_ID["<end>"]]
    q2 = [WORD_ID[w] for w in ("where", "is", "it")]
    a2 = [WORD_ID[w] for w in caption.split()[3:]] + [WORD_ID["<end>"]]
    assert text[:16 + 3 + 4 + 3 + 4] == [63] * 16 + q1 + a1 + q2 + a2
    targets = labels[PIXELS:].tolist()
    assert [t for t in targets if t != IGNORE_INDEX] == a1 + a2  # the questions are never targets
    assert targets[18] == a1[0] and targets[16 + 3 + 4 + 3 - 1] == a2[0]

    # classes: the image's bytes, every label its colour
    cls = build_dataset(cfg(paths, wds_target="cls", image_size=0), None, seq_len=PIXELS)
    ids, labels = cls[9]
    assert torch.equal(ids, ref[9][0][:PIXELS])
    assert labels.unique().tolist() == [list(COLOURS).index(ref.draw(9)[1].split()[1])]


def test_resume_is_exact_and_ranks_read_disjoint_samples(shards):
    _, paths = shards
    data = cfg(paths)
    kw = dict(local_batch_size=4, seq_len=SEQ, seed=3, vocab_size=64)
    loader = build_dataloader(data, None, dp_rank=0, dp_degree=1, **kw)
    it = iter(loader)
    next(it), next(it)
    state = loader.state_dict()
    want = [next(it) for _ in range(5)]  # across the epoch boundary (24 samples = 6 batches)
    again = build_dataloader(data, None, dp_rank=0, dp_degree=1, **kw)
    again.load_state_dict(state)
    got_it = iter(again)
    got = [next(got_it) for _ in range(5)]
    assert all(torch.equal(g[0], w[0]) and torch.equal(g[1], w[1]) for g, w in zip(got, want))
    # decoded in a worker, resumed with another worker count: the same rows
    workers = build_dataloader(dataclasses.replace(data, num_workers=1), None, dp_rank=0, dp_degree=1, **kw)
    workers.load_state_dict(state)
    first = next(iter(workers))
    assert torch.equal(first[0], want[0][0])
    other = build_dataloader(dataclasses.replace(data, wds_target="json"), None, dp_rank=0, dp_degree=1, **kw)
    with pytest.raises(ConfigError, match=r"data.wds_target 'txt' -> 'json'"):
        other.load_state_dict(state)

    # two data-parallel ranks, no process group: one epoch (3 global batches of 2 x 4) is split with no overlap
    ds = build_dataset(data, None, seq_len=SEQ, vocab_size=64)
    index = {ds[i][0][:PIXELS].numpy().tobytes(): i for i in range(N)}
    seen = []
    for rank in (0, 1):
        rank_loader = iter(build_dataloader(data, None, dp_rank=rank, dp_degree=2, **kw))
        seen.append({index[row[:PIXELS].numpy().tobytes()] for _ in range(3) for row in next(rank_loader)[0]})
    assert len(seen[0]) == len(seen[1]) == 12 and not seen[0] & seen[1] and seen[0] | seen[1] == set(range(N))


def _rewrite(src: str, dst, change):
    """A copy of shard src with change(key, members) applied to every sample."""
    samples = {}
    with tarfile.open(src) as tar:
        for m in tar:
            key, ext = m.name.split(".", 1)
            samples.setdefault(key, {})[ext] = tar.extractfile(m).read()
    return write_shards(dst, [(k, change(k, dict(v))) for k, v in samples.items()], per_shard=100, prefix="bad")[0]


def test_bad_samples_error_in_one_line_or_skip_with_a_count(shards, tmp_path, caplog):
    _, paths = shards

    def corrupt(key, members):
        if key == "000005":
            members["png"] = members["png"][:60]  # truncated PNG
        if key == "000006":
            members["cls"] = b"cat"
        return members

    bad = _rewrite(paths[0], tmp_path, corrupt)
    with pytest.raises(ConfigError) as e:
        build_dataset(cfg([bad]), None, seq_len=SEQ, vocab_size=64)[5]
    msg = one_line(e)
    assert bad in msg and "member '000005.png'" in msg and 'data.bad_samples="skip"' in msg
    # the same one line out of a loader worker (torch re-raises with the worker's traceback)
    loader = build_dataloader(cfg([bad], num_workers=1), None, dp_rank=0, dp_degree=1, local_batch_size=8,
                              seq_len=SEQ, seed=0, vocab_size=64, split="valid")
    with pytest.raises(ConfigError) as e:
        next(iter(loader))
    assert "member '000005.png'" in one_line(e)

    skip = build_dataset(cfg([bad], bad_samples="skip"), None, seq_len=SEQ, vocab_size=64)
    good = build_dataset(cfg([paths[0]]), None, seq_len=SEQ, vocab_size=64)
    with caplog.at_level(logging.WARNING, logger="titanlike.data.images"):
        assert torch.equal(skip[5][0], good[6][0]) and torch.equal(skip[4][0], good[4][0])
    assert skip.skipped == 1 and "1 skipped in this process" in caplog.text and "000005.png" in caplog.text
    classes = build_dataset(cfg([bad], wds_target="cls", image_size=0), None, seq_len=PIXELS)
    with pytest.raises(ConfigError, match=r"member 000006.'cls'|not a class id") as e:
        classes[6]
    one_line(e)

    # truncated shard: found while indexing
    cut = tmp_path / "cut.tar"
    cut.write_bytes(open(paths[1], "rb").read()[:40_000])
    with pytest.raises(ConfigError, match=r"shard .*cut.tar: truncated") as e:
        build_dataset(cfg([cut]), None, seq_len=SEQ, vocab_size=64)
    one_line(e)
    kept = build_dataset(cfg([cut], bad_samples="skip"), None, seq_len=SEQ, vocab_size=64)
    assert 0 < len(kept) < PER_SHARD and kept.left_out
    whole = build_dataset(cfg([paths[1]]), None, seq_len=SEQ, vocab_size=64)
    assert all(torch.equal(kept[i][0], whole[i][0]) for i in range(len(kept)))
    # a sample without its target member
    no_txt = _rewrite(paths[0], tmp_path / "no_txt", lambda k, m: {e: v for e, v in m.items()
                                                                   if not (k == "000002" and e == "txt")})
    with pytest.raises(ConfigError, match=r"sample '000002' has no a .txt member") as e:
        build_dataset(cfg([no_txt]), None, seq_len=SEQ, vocab_size=64)
    one_line(e)
    assert len(build_dataset(cfg([no_txt], bad_samples="skip"), None, seq_len=SEQ, vocab_size=64)) == PER_SHARD - 1


def test_bad_paths_and_sizes_are_one_line(shards, tmp_path):
    folder, paths = shards
    cases = [
        ([f"{folder}/shapes-train-{{000000..000004}}.tar"], r"shard .*shapes-train-000003.tar' does not exist \(from "
                                                            r"the pattern"),
        ([f"{folder}/nothing-*.tar"], r"matches no file"),
        ([str(tmp_path / "empty")], r"holds no \*.tar shard"),
    ]
    (tmp_path / "empty").mkdir()
    gz = tmp_path / "x.tar"
    import gzip

    gz.write_bytes(gzip.compress(open(paths[0], "rb").read()))
    cases.append(([str(gz)], r"not a readable tar file .*decompress it"))
    for p, pattern in cases:
        with pytest.raises(ConfigError, match=pattern) as e:
            build_dataset(cfg(p), None, seq_len=SEQ, vocab_size=64)
        assert "data.paths" in one_line(e)
    with pytest.raises(ConfigError, match=r"data.image_size=0, data.image_tokens=0: .* need both") as e:
        build_dataset(cfg(paths, image_size=0, image_tokens=0), None, seq_len=SEQ, vocab_size=64)
    one_line(e)
    with pytest.raises(ValueError, match=r"training.seq_len=3000: .*set training.seq_len = 3 \* image_size"):
        build_dataset(cfg(paths, wds_target="cls", image_size=0), None, seq_len=3000)


def _load(config, *overrides):
    from titanlike.config.load import load_config

    return load_config(["--config", config, "--training.device=cpu", *overrides])


def test_config_refusals_name_the_key(shards):
    _, paths = shards
    brace = f"--data.paths={paths[0]}"
    for overrides, pattern in (
        (["--data.wds_target=png"], r"data.wds_target='png' is not one of txt, json, cls"),
        (["--data.bad_samples=ignore"], r"data.bad_samples='ignore' is not one of error, skip"),
        (["--data.wds_layout=packed"], r"data.wds_layout='packed' is not one of pad, pack"),
        (["--data.image_tokens=9"], r"set data.image_size=32 and data.image_tokens=16"),
        (["--data.wds_target=cls"], r"llava trains on text"),
        (["--data.images_per_row=2"], r"the model takes 1 image slot\(s\) per row .*set data.images_per_row=1"),
        (["--validation.enable=true"], r"needs validation.paths \(held-out shards\)"),
    ):
        with pytest.raises(ConfigError, match=pattern):
            _load("configs/llava_wds_debug.toml", brace, *overrides)
    vit = ["--data.dataset=webdataset", brace]
    with pytest.raises(ConfigError, match=r'set data.wds_target="cls"'):
        _load("configs/vit_debug.toml", *vit)
    with pytest.raises(ConfigError, match=r"data.image_size=48 but the model's image_size is 32"):
        _load("configs/vit_debug.toml", *vit, "--data.wds_target=cls", "--data.image_size=48")


@pytest.mark.parametrize("config,extra", [
    ("configs/llava_wds_debug.toml", ["--data.wds_target=json"]),
    ("configs/llava_wds_debug.toml", []),
    ("configs/vit_debug.toml", ["--data.dataset=webdataset", "--data.wds_target=cls", "--optimizer.lr=2e-3"]),
])
def test_trains_a_few_steps_from_shards(config, extra, shards, tmp_path):
    folder, _ = shards
    c = _load(config, f"--job.dump_folder={tmp_path}", "--training.steps=8", "--metrics.log_freq=1",
              f"--data.paths={folder}/shapes-train-{{000000..000002}}.tar", "--training.local_batch_size=8", *extra)
    first, last = _first_and_last_loss(c)
    print(f"{config} {extra}: loss {first:.3f} -> {last:.3f}")
    assert last < first - 0.5, (first, last)


def _first_and_last_loss(cfg) -> tuple[float, float]:
    from titanlike.train.trainer import Trainer

    trainer = Trainer(cfg)
    try:
        history = trainer.train()
    finally:
        trainer.close()
    return history[0]["loss"], history[-1]["loss"]


SEQ2 = 2 * PIXELS + 64  # two slots, two runs of 16 and a 2-image conversation (60 tokens)


@pytest.fixture(scope="module")
def shards2(tmp_path_factory):
    folder = tmp_path_factory.mktemp("wds2")
    return folder, write_shapes_shards(folder, 12, 4, images_per_sample=2)


def words(text: str) -> list[int]:
    return [WORD_ID[w] for w in text.split()]


def test_multi_image_rows_are_the_drawn_samples(shards, shards2):
    _, paths = shards2
    with tarfile.open(paths[0]) as tar:
        assert tar.getnames()[:5] == ["000000.0.png", "000000.1.png", "000000.txt", "000000.json", "000000.cls"]
    ref = ShapesCaptions(SEQ, 64)
    caps = build_dataset(cfg(paths, images_per_row=2), None, seq_len=SEQ2, vocab_size=64)
    conv = build_dataset(cfg(paths, images_per_row=2, wds_target="json"), None, seq_len=SEQ2, vocab_size=64)
    assert len(caps) == 12
    for i in (0, 5, 11):
        c0, c1 = ref.draw(2 * i)[1], ref.draw(2 * i + 1)[1]
        ids, labels = caps[i]
        assert torch.equal(ids[:PIXELS], ref[2 * i][0][:PIXELS]) and torch.equal(ids[PIXELS:2 * PIXELS],
                                                                                  ref[2 * i + 1][0][:PIXELS])
        text = [63] * 32 + words(f"{c0} and {c1}") + [WORD_ID["<end>"]]  # both runs first, then the caption
        assert ids[2 * PIXELS:2 * PIXELS + len(text)].tolist() == text and not ids[2 * PIXELS + len(text):].any()
        assert [t for t in labels.tolist() if t != IGNORE_INDEX] == text[32:]
        # a conversation: each image's run where its <image> marker stands, loss on the answers only
        ids, labels = conv[i]
        assert torch.equal(ids[:2 * PIXELS], caps[i][0][:2 * PIXELS])
        turns = [(words(c[:c.index(" at ")]) + [WORD_ID["<end>"]], words(c[c.index(" at ") + 1:]) +
                  [WORD_ID["<end>"]]) for c in (c0, c1)]
        want = [t for a1, a2 in turns for t in [63] * 16 + words("what is it") + a1 + words("where is it") + a2]
        assert ids[2 * PIXELS:2 * PIXELS + len(want)].tolist() == want
        assert [t for t in labels.tolist() if t != IGNORE_INDEX] == [t for a1, a2 in turns for t in a1 + a2]

    # one-image samples in 2-slot rows: the second slot stays empty (the objective ignores it)
    one = build_dataset(cfg(shards[1], images_per_row=2), None, seq_len=SEQ2, vocab_size=64)
    ids, _ = one[3]
    assert torch.equal(ids[:PIXELS], ref[3][0][:PIXELS]) and not ids[PIXELS:2 * PIXELS].any()
    assert (ids[2 * PIXELS:] == 63).sum() == 16
    # too long: cut before the second run, never inside it, and its image's slot left empty
    cut = build_dataset(cfg(paths, images_per_row=2, wds_target="json"), None, seq_len=2 * PIXELS + 40,
                        vocab_size=64)
    ids, _ = cut[0]
    assert (ids[2 * PIXELS:] == 63).sum() == 16 and not ids[PIXELS:2 * PIXELS].any()

    # exact resume over 2-image rows
    kw = dict(local_batch_size=4, seq_len=SEQ2, seed=1, vocab_size=64, dp_rank=0, dp_degree=1)
    loader = build_dataloader(cfg(paths, images_per_row=2), None, **kw)
    it = iter(loader)
    next(it)
    state, want = loader.state_dict(), [next(it) for _ in range(3)]  # across the epoch boundary (3 batches)
    again = build_dataloader(cfg(paths, images_per_row=2, num_workers=1), None, **kw)
    again.load_state_dict(state)
    got = iter(again)
    assert all(torch.equal(next(got)[0], w[0]) for w in want)


def test_multi_image_refusals_error_in_one_line_or_skip(shards, shards2, tmp_path, caplog):
    _, paths = shards

    def add(key, members):  # 000003 gains a second image (a copy of its first)
        if key == "000003":
            png = members.pop("png")
            members.update({"0.png": png, "1.png": png})
        return members

    more = _rewrite(paths[0], tmp_path / "more", add)
    with pytest.raises(ConfigError) as e:
        build_dataset(cfg([more]), None, seq_len=SEQ, vocab_size=64)
    msg = one_line(e)
    assert more in msg and "sample '000003' holds 2 images, member '000003.1.png' past data.images_per_row=1" in msg
    skip = build_dataset(cfg([more], bad_samples="skip"), None, seq_len=SEQ, vocab_size=64)
    assert len(skip) == PER_SHARD - 1 and skip.left_out == {"with too many images": 1}
    assert len(build_dataset(cfg([more], images_per_row=2), None, seq_len=SEQ2, vocab_size=64)) == PER_SHARD
    gap = _rewrite(paths[0], tmp_path / "gap", lambda k, m: {("2.png" if e == "1.png" else e): v for e, v in
                                                             add(k, m).items()})
    with pytest.raises(ConfigError, match=r"sample '000003' numbers its images \[0, 2\]") as e:
        build_dataset(cfg([gap], images_per_row=2), None, seq_len=SEQ2, vocab_size=64)
    one_line(e)

    # a conversation with one <image> marker for two images: found when read
    def one_marker(key, members):
        if key == "000001":
            members["json"] = members["json"].replace(b"<image>", b"", 1)
        return members

    bad = _rewrite(shards2[1][0], tmp_path / "marker", one_marker)
    data = cfg([bad], images_per_row=2, wds_target="json")
    with pytest.raises(ConfigError) as e:
        build_dataset(data, None, seq_len=SEQ2, vocab_size=64)[1]
    msg = one_line(e)
    assert bad in msg and "member '000001.json' of sample '000001'" in msg and "1 <image> marker(s)" in msg
    skip = build_dataset(dataclasses.replace(data, bad_samples="skip"), None, seq_len=SEQ2, vocab_size=64)
    good = build_dataset(cfg([shards2[1][0]], images_per_row=2, wds_target="json"), None, seq_len=SEQ2,
                         vocab_size=64)
    with caplog.at_level(logging.WARNING, logger="titanlike.data.images"):
        assert torch.equal(skip[1][0], good[2][0])
    assert skip.skipped == 1 and "000001.json" in caplog.text


def test_trains_a_few_steps_from_two_image_shards(shards2, tmp_path):
    folder, _ = shards2
    c = _load("configs/llava_wds_debug.toml", f"--job.dump_folder={tmp_path}", "--training.steps=8",
              "--metrics.log_freq=1", f"--data.paths={folder}", "--training.local_batch_size=8",
              f"--training.seq_len={SEQ2}", "--data.images_per_row=2", "--model.args={images_per_row = 2}")
    first, last = _first_and_last_loss(c)
    print(f"2-image shards: loss {first:.3f} -> {last:.3f}")
    assert last < first - 0.5, (first, last)


def test_image_folder_bad_images_error_or_skip(tmp_path):
    from PIL import Image

    for name, colour in (("a.png", (255, 0, 0)), ("c.png", (0, 255, 0))):
        (tmp_path / "train" / "cat").mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (16, 16), colour).save(tmp_path / "train" / "cat" / name)
    (tmp_path / "train" / "cat" / "b.png").write_bytes(b"\x89PNG\r\n\x1a\n not really")
    data = dataclasses.replace(Data(), dataset="image_folder", paths=[str(tmp_path)])
    ds = build_dataset(data, None, seq_len=3 * 16 * 16)
    with pytest.raises(ConfigError, match=r"b.png: cannot decode the image .*data.bad_samples=\"skip\"") as e:
        ds[1]
    one_line(e)
    skip = build_dataset(dataclasses.replace(data, bad_samples="skip"), None, seq_len=3 * 16 * 16)
    assert skip[1][0].view(3, 16, 16)[:, 8, 8].tolist() == [0, 255, 0] and skip.skipped == 1  # c.png instead
