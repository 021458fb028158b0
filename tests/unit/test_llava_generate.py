"""Generation with images (titanlike/infer: pixels at the prefill, the K/V cache after; titanlike/infer/images.py;
scripts/generate.py --image) for llava with a ViT and a SigLIP tower: greedy tokens equal transformers'
LlavaForConditionalGeneration.generate (tiny random model, fp32, CPU), image preprocessing equals transformers'
image processors, and the script's one-line refusals."""
from __future__ import annotations

import json
import types

import numpy as np
import pytest
import torch

from tests.unit.test_llava import SPEC, VOCAB, build, hf_model, tiny
from titanlike.infer import generate, load_for_inference
from titanlike.infer.images import ImagePrep, expand_placeholders, image_prep, load_pixels

transformers = pytest.importorskip("transformers")
Image = pytest.importorskip("PIL.Image")
NEW = 10


def prompts(args):
    """One row with one image, one with two (placeholders already expanded), text around them."""
    img = [args.image_token] * args.image_tokens
    return [[5, 6] + img + [7, 8, 9], [10] + img + [11, 12] + img + [13]]


def export(args, tmp_path, seed=0):
    model = build(args, seed)
    return model, hf_model(args, model.state_dict(), tmp_path), tmp_path / "hf"


@pytest.mark.parametrize("flavor", ["debugmodel", "debug-siglip", "debug-clip"])
def test_greedy_tokens_equal_transformers_generate(flavor, tmp_path):
    args = tiny(flavor)
    ours, theirs, folder = export(args, tmp_path)
    rows = prompts(args)
    v = args.vision
    pixels = torch.randn(3, v.channels, v.image_size, v.image_size, generator=torch.Generator().manual_seed(1))
    want = []
    for row, px in zip(rows, (pixels[:1], pixels[1:])):
        ids = torch.tensor([row])
        out = theirs.generate(input_ids=ids, pixel_values=px, attention_mask=torch.ones_like(ids),
                              max_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=0)
        want.append(out[0, len(row):].tolist())
    print(f"{flavor}: transformers {want}")
    assert all(len(w) == NEW for w in want) and len(set(want[0])) > 1  # not one repeated token
    # alone, and as one left-padded batch (the images in order over the rows), from our model and the HF folder
    assert [generate(ours, [r], max_new_tokens=NEW, pixels=p)[0] for r, p in zip(rows, (pixels[:1], pixels[1:]))] \
        == want
    assert generate(ours, rows, max_new_tokens=NEW, pixels=pixels) == want
    loaded = load_for_inference(str(folder))
    assert loaded.spec is SPEC and generate(loaded.model, rows, max_new_tokens=NEW, pixels=pixels) == want
    with pytest.raises(ValueError, match=r"32 image placeholder tokens but 1 images x 16 patches = 16"):
        generate(ours, rows[1:], max_new_tokens=2, pixels=pixels[:1])


def write_png(path, size, seed):
    rng = np.random.default_rng(seed)
    Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)).save(path)
    return str(path)


@pytest.mark.parametrize("processor,resample", [("ViTImageProcessor", 2), ("SiglipImageProcessor", 3)])
def test_pixels_equal_transformers_image_processor(processor, resample, tmp_path):
    """A 45x45 PNG resized to 32 and normalised with CLIP's mean/std: HF's processor gives the same pixels (its resize
    is Pillow's too; then float32 rescale and normalise), to float rounding."""
    mean, std = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)
    path = write_png(tmp_path / "x.png", 45, 0)
    got = load_pixels([path], ImagePrep(32, 3, mean, std, resample, "test"))
    proc = getattr(transformers, processor)(size={"height": 32, "width": 32}, image_mean=mean, image_std=std,
                                            resample=resample)
    want = proc(images=[Image.open(path).convert("RGB")], return_tensors="pt")["pixel_values"]
    err = (got - want).abs().max().item()
    print(f"{processor}: max |diff| {err:.1e} at values up to {want.abs().max():.2f}")
    assert got.shape == want.shape == (1, 3, 32, 32) and err <= 1e-5


def test_clip_preprocessor_config_loads_as_clip_image_processor(tmp_path):
    """A CLIP tower's export writes a CLIPImageProcessor config without its default center crop (which would cut a
    224 crop out of any size) and with CLIP's statistics, the ones the tower trains with: transformers'
    AutoImageProcessor reads it and gives the pixels generate's default loading gives (bicubic) and the training
    objective makes from the same bytes."""
    args = tiny("debug-clip")
    assert args.vision.pixel_stats == "clip"
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(SPEC.hf.preprocessor_config(args)))
    proc = transformers.AutoImageProcessor.from_pretrained(str(tmp_path))
    assert "CLIPImageProcessor" in type(proc).__name__
    assert tuple(proc.image_mean) == args.vision.mean_std[0] and tuple(proc.image_std) == args.vision.mean_std[1]
    path = write_png(tmp_path / "x.png", 32, 0)  # at the tower's size: no resize, so the bytes are the image's
    loaded = types.SimpleNamespace(args=args, source=str(tmp_path / "none"), spec=SPEC, model=None)
    got = load_pixels([path], image_prep(loaded))
    want = proc(images=[Image.open(path).convert("RGB")], return_tensors="pt")["pixel_values"]
    assert got.shape == want.shape == (1, 3, 32, 32) and (got - want).abs().max().item() <= 1e-5
    raw = torch.from_numpy(np.array(Image.open(path).convert("RGB"))).permute(2, 0, 1)
    assert (args.vision.normalise(raw) - want[0]).abs().max().item() <= 1e-5


def test_expand_placeholders():
    assert expand_placeholders([[1, 9, 2], [9, 9]], 9, 3, 3) == [[1, 9, 9, 9, 2], [9] * 6]
    with pytest.raises(ValueError, match=r"^2 --image file\(s\) but 3 image placeholder\(s\)"):
        expand_placeholders([[1, 9, 2], [9, 9]], 9, 3, 2)


def _script():
    from tests.unit.test_generate import _load_script

    return _load_script()


def test_script_generates_with_images_and_refuses_bad_input(tmp_path, capsys):
    """scripts/generate.py on an HF llava folder (with the preprocessor_config.json export writes): its tokens equal
    generate() on the same pixels computed here by hand from the PNGs; then each bad input is one line."""
    args = tiny("debug-siglip")
    model, _, folder = export(args, tmp_path)
    (folder / "preprocessor_config.json").write_text(json.dumps(SPEC.hf.preprocessor_config(args)))
    pngs = [write_png(tmp_path / f"{i}.png", 32, i) for i in range(2)]
    img = args.image_token
    script = _script()
    argv = [str(folder), "--tokens", f"5,{img},7", "--tokens", f"10,{img},11,{img}", "--image", pngs[0],
            "--image", pngs[1], "--image", pngs[0], "--max-new-tokens", "6"]
    assert script.main(argv) == 0
    out = capsys.readouterr().out
    by_hand = torch.stack([torch.from_numpy(np.array(Image.open(p))).permute(2, 0, 1).float() / 127.5 - 1
                           for p in (pngs[0], pngs[1], pngs[0])])
    rows = expand_placeholders([[5, img, 7], [10, img, 11, img]], img, args.image_tokens, 3)
    new = generate(model, rows, max_new_tokens=6, pixels=by_hand)
    assert out == (f"=== prompt 1\n5 {img} 7 -> {' '.join(map(str, new[0]))}\n\n"
                   f"=== prompt 2\n10 {img} 11 {img} -> {' '.join(map(str, new[1]))}\n"), out
    bad = tmp_path / "bad.png"
    bad.write_bytes(b"\x89PNG\r\n\x1a\n not really")
    llama = tmp_path / "llama"
    _llama_folder(llama)
    cases = [([str(folder), "--tokens", f"5,{img}", "--image", str(tmp_path / "nope.png")], "no such file"),
             ([str(folder), "--tokens", f"5,{img}", "--image", str(bad)], "Pillow cannot read it"),
             ([str(folder), "--tokens", f"5,{img},{img}", "--image", pngs[0]], "1 --image file(s) but 2 image"),
             ([str(folder), "--tokens", "5,6"], None),
             ([str(llama), "--tokens", "5,6", "--image", pngs[0]], "takes no images")]
    for argv, expect in cases:
        code = script.main([*argv, "--max-new-tokens", "2"])
        captured = capsys.readouterr()
        if expect is None:  # a llava prompt without images is plain text generation
            assert code == 0 and captured.out.startswith("5 6 -> "), captured
            continue
        lines = captured.err.strip().splitlines()
        assert code == 2 and len(lines) == 1 and expect in lines[0] and "--image" in lines[0], (argv, lines)


def _llama_folder(path):
    """A tiny Llama HF folder: a model with no vision tower."""
    import dataclasses

    from safetensors.torch import save_file

    import models
    from titanlike.infer.load import build_model

    spec = models.get_spec("llama3")
    args = dataclasses.replace(spec.flavors["debugmodel"], dim=64, n_layers=1, vocab_size=VOCAB, max_seq_len=32)
    model = build_model(spec, args, torch.device("cpu"), torch.float32)
    path.mkdir()
    save_file({k: v.contiguous() for k, v in spec.hf.to_hf(model.state_dict(), args).items()},
              str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(spec.hf.hf_config(args, torch.float32)))


def test_titanlike_checkpoint_and_its_export_generate_alike(tmp_path, capsys):
    """A titanlike step folder and its HF export (whose preprocessor_config.json transformers' AutoImageProcessor
    reads into the pixels we compute) print the same tokens for the same --image."""
    from titanlike.checkpoint.hf import export_hf, write_model_step

    args = tiny()
    model = build(args)
    step = write_model_step(str(tmp_path / "ck"), "llava", args, model.state_dict(), {}, "test", "test", "test")
    out = export_hf(step, str(tmp_path / "hf"), dtype="float32", progress=False, with_tokenizer=False)
    png = write_png(tmp_path / "x.png", 40, 3)  # resized to 32
    proc = transformers.AutoImageProcessor.from_pretrained(out)
    want = proc(images=[Image.open(png).convert("RGB")], return_tensors="pt")["pixel_values"]
    loaded = load_for_inference(out)
    from titanlike.infer.images import image_prep

    assert image_prep(loaded).source.endswith("preprocessor_config.json")
    assert (load_pixels([png], image_prep(loaded)) - want).abs().max() <= 1e-5
    script, printed = _script(), []
    for source in (step, out):
        assert script.main([source, "--tokens", f"3,{args.image_token},4", "--image", png,
                            "--max-new-tokens", "6"]) == 0
        printed.append(capsys.readouterr().out)
    new = generate(model, expand_placeholders([[3, args.image_token, 4]], args.image_token, args.image_tokens, 1),
                   max_new_tokens=6, pixels=want)[0]
    assert printed[0] == printed[1] == f"3 {args.image_token} 4 -> {' '.join(map(str, new))} \n", printed


def test_text_prompt_placeholders_split_the_encoding():
    """--prompt text: each <image> is one image id, the pieces around it encoded alone, BOS on the first only."""
    from types import SimpleNamespace

    args = tiny()
    loaded = SimpleNamespace(args=args)
    encode = lambda piece, first: ([1] if first else []) + [10 + len(piece)]  # noqa: E731 (a stand-in tokenizer)
    got = _script()._encode_pieces(encode, loaded, "ab<image>cde<image>")
    assert got == [1, 12, args.image_token, 13, args.image_token, 10]


def _word_tokenizer(path, more=0):
    """A tiny word-level tokenizer.json (ids 0..8, and `more` words after them) for a model of VOCAB rows: the export
    adds <image> at the model's placeholder id (the last row) and fills the rows between."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["<unk>", "<s>", "</s>", "describe", "the", "cat", "on", "mat", ":"] + [f"w{i}" for i in range(more)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    tok.save(str(path))
    return str(path)


@pytest.mark.parametrize("flavor", ["debugmodel", "debug-siglip"])
def test_export_with_tokenizer_loads_as_llava_processor(flavor, tmp_path):
    """An export with the run's tokenizer loads with transformers' AutoProcessor (LlavaProcessor): a prompt with
    <image> and an image gives titanlike's own ids (placeholders expanded to the tower's features: with and without
    a class token) and the pixels image_prep + load_pixels give."""
    from titanlike.checkpoint.hf import export_hf, write_model_step

    args = tiny(flavor)
    step = write_model_step(str(tmp_path / "ck"), "llava", args, build(args).state_dict(), {}, "t", "t", "t")
    out = export_hf(step, str(tmp_path / "hf"), dtype="float32", progress=False,
                    tokenizer=_word_tokenizer(tmp_path / "tokenizer.json"))
    proc = transformers.AutoProcessor.from_pretrained(out)
    assert type(proc).__name__ == "LlavaProcessor" and proc.image_token_id == args.image_token == VOCAB - 1
    png = write_png(tmp_path / "x.png", 40, 5)  # resized to the tower's 32
    text = "describe the cat <image> on the mat :"
    got = proc(text=text, images=[Image.open(png).convert("RGB")], return_tensors="pt")
    loaded = load_for_inference(out)
    ours = expand_placeholders([_script()._encode_pieces(lambda p, first: loaded.encode(p), loaded, text)],
                               args.image_token, args.image_tokens, 1)[0]
    ids = got["input_ids"][0].tolist()
    assert ids.count(args.image_token) == args.image_tokens == 16 and ids == ours
    assert ours[:5] == [3, 4, 5, *[args.image_token] * 2] and ours[-4:] == [6, 4, 7, 8]
    pixels = load_pixels([png], image_prep(loaded))
    assert got["pixel_values"].shape == pixels.shape == (1, 3, 32, 32)
    assert (got["pixel_values"] - pixels).abs().max().item() <= 1e-5
    if flavor == "debugmodel":  # the placeholder's row is a word of this tokenizer: no tokenizer, no processor files
        again = export_hf(step, str(tmp_path / "hf2"), dtype="float32", progress=False,
                          tokenizer=_word_tokenizer(tmp_path / "full.json", more=VOCAB - 9))
        files = sorted(p.name for p in (tmp_path / "hf2").iterdir())
        assert "tokenizer.json" not in files and "processor_config.json" not in files
        assert "preprocessor_config.json" in files and again == str(tmp_path / "hf2")
