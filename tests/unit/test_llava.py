"""LLaVA (models/llava): counts and logits against transformers' LlavaForConditionalGeneration (ViT tower, Llama
text model), import/export both ways, the image splice's refusals, the objective, training stages (freeze)."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch

import models
from models.batch import IGNORE_INDEX, StepContext, build_objective
from titanlike.distributed.parallel_dims import ParallelDims

torch.set_num_threads(1)
SPEC = models.get_spec("llava")
VOCAB = 128


def tiny(flavor="debugmodel", **kw):
    return dataclasses.replace(SPEC.flavors[flavor], vocab_size=VOCAB, max_seq_len=64, **kw)


def build(args, seed=0):
    torch.manual_seed(seed)
    with torch.device("meta"):
        model = SPEC.model_cls(args)
    model.to_empty(device="cpu")
    model.init_weights()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # larger than the init, norms and biases too, so a mapping bug shows in the logits
        for p in model.parameters():
            p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g) if p.ndim == 1 else 0.08 * torch.randn(p.shape,
                                                                                                      generator=g))
    return model.eval()


def batch(args, images_per_row=(1, 2), seq=48):
    """Rows with the given number of images (placeholder runs at varied places), pixels of all images in order."""
    g = torch.Generator().manual_seed(3)
    tok = torch.randint(0, VOCAB - 1, (len(images_per_row), seq), generator=g)
    per = args.image_tokens
    for r, n in enumerate(images_per_row):
        for k in range(n):
            start = 2 + k * (per + 3)
            tok[r, start:start + per] = args.image_token
    v = args.vision
    pixels = torch.randn(sum(images_per_row), v.channels, v.image_size, v.image_size, generator=g)
    return tok, pixels


def hf_model(args, sd, tmp_path):
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import save_file

    folder = tmp_path / "hf"
    folder.mkdir()
    save_file({k: v.contiguous() for k, v in SPEC.hf.to_hf(sd, args).items()}, str(folder / "model.safetensors"),
              metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(SPEC.hf.hf_config(args, torch.float32)))
    return transformers.AutoModelForImageTextToText.from_pretrained(str(folder), dtype=torch.float32,
                                                                    attn_implementation="eager").eval()


def qwen3_text(args):
    from models.qwen3.flavors import qwen3_flavors

    return dataclasses.replace(args, language_family="qwen3", text=qwen3_flavors["debugmodel"])


# what HF's tower holds that never reaches the logits: the last block here, the final norm, ViT's pooler
UNUSED = {"debugmodel": ("vision_tower.layernorm", "vision_tower.pooler", "vision_tower.layers.2."),
          "debug-siglip": ("vision_tower.post_layernorm", "vision_tower.encoder.layers.2."),
          "debug-clip": ("vision_tower.post_layernorm", "vision_tower.encoder.layers.2.")}
TOWERS = {"debugmodel": "ViTModel", "debug-siglip": "SiglipVisionModel", "debug-clip": "CLIPVisionModel"}


@pytest.mark.parametrize("rows,language,flavor", [((0, 2), "llama3", "debugmodel"), ((1, 2), "llama3", "debugmodel"),
                                                  ((1, 2), "qwen3", "debugmodel"), ((0, 2), "llama3", "debug-siglip"),
                                                  ((1, 2), "qwen3", "debug-siglip"), ((0, 2), "llama3", "debug-clip"),
                                                  ((1, 2), "qwen3", "debug-clip")])
def test_logits_and_state_dict_match_transformers(rows, language, flavor, tmp_path):
    args = tiny(flavor) if language == "llama3" else qwen3_text(tiny(flavor))
    ours = build(args)
    sd = ours.state_dict()
    theirs = hf_model(args, sd, tmp_path)
    assert type(theirs).__name__ == "LlavaForConditionalGeneration"
    tower = type(theirs.model.vision_tower).__name__
    assert tower == TOWERS[flavor], tower
    # counts: HF's minus what never reaches the logits
    unused = sum(p.numel() for n, p in theirs.named_parameters() if any(s in n for s in UNUSED[flavor]))
    assert sum(p.numel() for p in theirs.parameters()) - unused == SPEC.param_counts(args).total
    tokens, pixels = batch(args, rows)
    with torch.no_grad():
        got = ours(tokens, pixels=pixels)
        want = theirs(input_ids=tokens, pixel_values=pixels).logits
    err = (got - want).abs().max().item()
    print(f"{flavor} {language} rows {rows}: max |diff| {err:.2e} at logits up to {want.abs().max():.2f}")
    assert want.abs().max() > 1 and err <= 1e-4
    back = SPEC.hf.from_hf(theirs.state_dict(), args)  # transformers 5.x's own names
    assert back.keys() == sd.keys() and all(torch.equal(back[k], sd[k]) for k in sd)
    again = SPEC.hf.args_from_hf_config(json.loads((tmp_path / "hf" / "config.json").read_text()))
    want = dataclasses.replace(args, image_token_id=VOCAB - 1)
    assert dataclasses.replace(again, max_seq_len=args.max_seq_len) == want


def test_bad_inputs_are_one_line():
    args = tiny()
    model = build(args)
    tokens, pixels = batch(args, (1, 2))
    with pytest.raises(ValueError, match=r"48 image placeholder tokens but 2 images x 16 patches = 32") as e:
        model(tokens, pixels=pixels[:2])
    assert "\n" not in str(e.value)
    problems = SPEC.check(dataclasses.replace(args, vision=dataclasses.replace(args.vision, image_size=36)),
                          ParallelDims(dp_shard=1, world_size=1), "debugmodel")
    assert len(problems) == 1 and "not a multiple of patch_size=8" in problems[0]


def test_objective_splits_images_and_ignores_placeholders():
    args = tiny(images_per_row=2)
    tokens, pixels = batch(args, (0, 2, 1), seq=60)
    bytes_ = torch.randint(0, 256, (3, 2 * args.pixels))
    rows = torch.cat([bytes_, tokens], 1)
    b = build_objective(SPEC.objective, args)(rows[:, :-1], rows[:, 1:], StepContext(0, 0))
    v = args.vision
    assert b.inputs["tokens"].shape == b.inputs["image_pos"].shape == (3, 59)
    assert b.inputs["pixels"].shape == (3, 2, v.channels, v.image_size, v.image_size)  # every slot, per row
    assert b.sequence == ("tokens", "labels", "image_pos")  # context parallel cuts image_pos with the tokens
    first = bytes_[1, :args.pixels].reshape(v.channels, v.image_size, v.image_size).float() / 127.5 - 1
    assert torch.equal(b.inputs["pixels"][1, 0], first)
    assert not (b.labels == args.image_token).any() and (b.labels == IGNORE_INDEX).sum() == 3 * 16
    pos = b.inputs["image_pos"]
    assert (pos >= 0).sum(1).tolist() == [0, 32, 16] and pos[1][pos[1] >= 0].tolist() == list(range(32))
    # The slots' splice (by index, every slot through the tower) equals HF's in-order one on the used images.
    model = build(args)
    used = b.inputs["pixels"][torch.tensor([[False, False], [True, True], [True, False]])]
    with torch.no_grad():
        want = model(b.inputs["tokens"], pixels=used)
        assert torch.allclose(model(**b.inputs), want, atol=1e-6, rtol=0)
    bad = rows.clone()
    bad[0, 2 * args.pixels + 3] = args.image_token  # one stray placeholder
    with pytest.raises(ValueError, match=r"a row holds 1 image placeholders; each image needs exactly 16") as e:
        build_objective(SPEC.objective, args)(bad[:, :-1], bad[:, 1:], StepContext(0, 0))
    assert "\n" not in str(e.value)


def test_objective_normalises_a_clip_tower_with_clips_statistics():
    """A CLIP tower's slots are normalised with CLIP's mean and std (model.args.pixel_stats = "clip"), what
    CLIPImageProcessor gives the pretrained tower, not the ViT/SigLIP 0.5 / 0.5."""
    args = tiny("debug-clip", images_per_row=1)
    v = args.vision
    tokens, _ = batch(args, (1,), seq=40)
    bytes_ = torch.randint(0, 256, (1, args.pixels))
    rows = torch.cat([bytes_, tokens], 1)
    b = build_objective(SPEC.objective, args)(rows[:, :-1], rows[:, 1:], StepContext(0, 0))
    mean, std = (torch.tensor(x).view(3, 1, 1) for x in v.mean_std)
    want = (bytes_[0].reshape(v.channels, v.image_size, v.image_size) / 255.0 - mean) / std
    assert v.pixel_stats == "clip"
    torch.testing.assert_close(b.inputs["pixels"][0, 0], want)


@pytest.mark.parametrize("freeze", [["vision", "language"], ["vision"]])
def test_freeze_stages_train_only_the_rest(freeze):
    from titanlike.config.sections import Optimizer
    from titanlike.optim.adamw import build_optimizer

    args = tiny(freeze=freeze)
    model = build(args).train()
    tokens, pixels = batch(args, (1, 2))
    opt = build_optimizer(model, Optimizer(), torch.device("cpu"))
    in_opt = {id(p) for group in opt.param_groups for p in group["params"]}
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    model(tokens, pixels=pixels).float().logsumexp(-1).mean().backward()
    opt.step()
    for n, p in model.named_parameters():
        frozen = n.split(".")[0] in ("vision",) and "vision" in freeze or \
            n.split(".")[0] in ("tok_embeddings", "layers", "norm", "output") and "language" in freeze
        assert (id(p) in in_opt) != frozen and torch.equal(p, before[n]) == frozen, n


def test_shapes_captions_are_deterministic_resumable_and_caption_only():
    from titanlike.config.sections import Data
    from titanlike.data.image_text import PIXELS, PLACEHOLDERS, WORD_ID, ShapesCaptions
    from titanlike.data.loader import build_dataloader

    ds = ShapesCaptions(PIXELS + 32, 64, seed=3)
    ids, labels = ds[5]
    assert torch.equal(ids, ShapesCaptions(PIXELS + 32, 64, seed=3)[5][0]) and not torch.equal(ids, ds[6][0])
    text = ids[PIXELS:]
    assert (text[:PLACEHOLDERS] == 63).all() and text[PLACEHOLDERS] == WORD_ID["a"]
    targets = labels[labels != IGNORE_INDEX]
    assert targets.tolist() == [63] * (PLACEHOLDERS - 1) + text[PLACEHOLDERS:PLACEHOLDERS + 7].tolist()
    _, caption = ds.draw(5)
    assert len(caption.split()) == 6 and caption.startswith("a ")
    with pytest.raises(ValueError, match=r"set training.seq_len >= "):
        ShapesCaptions(PIXELS + 10, 64)
    cfg = dataclasses.replace(Data(), dataset="shapes_captions")
    kw = dict(dp_rank=0, dp_degree=1, local_batch_size=4, seq_len=PIXELS + 32, seed=3, vocab_size=64)
    loader = build_dataloader(cfg, None, **kw)
    it = iter(loader)
    next(it), next(it)
    state, want = loader.state_dict(), next(it)
    again = build_dataloader(cfg, None, **kw)
    again.load_state_dict(state)
    got = next(iter(again))
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("freeze", [[], ["vision", "language"]])
def test_debug_config_trains(freeze, tmp_path):
    """configs/llava_debug.toml through the Trainer, shortened: the caption loss falls (full training: 4.5 -> ~1.0 in
    10 steps, half the captions naming a drawn digit; projector-only alignment, its 82k parameters the only
    trainable ones: 4.5 -> ~4.1, into a random decoder)."""
    from titanlike.config.load import load_config
    from titanlike.train.trainer import Trainer

    cfg = load_config(["--config", "configs/llava_debug.toml", f"--job.dump_folder={tmp_path}",
                       "--training.steps=10", "--metrics.log_freq=1", "--training.device=cpu"])
    cfg.model.args = {"freeze": freeze} if freeze else cfg.model.args
    trainer = Trainer(cfg)
    try:
        trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
        history = trainer.train()
        val = trainer.last_validation  # [validation] at step 10: 64 held-out images
    finally:
        trainer.close()
    first, last = history[0]["loss"], history[-1]["loss"]
    print(f"llava freeze={freeze}: loss {first:.3f} -> {last:.3f}, trainable {trainable}, validation {val}")
    assert 0 <= val["caption_accuracy"] <= 1 and 0 <= val["caption_token_accuracy"] <= 1
    if not freeze:  # "a", "at", the end word (and "with the digit") are 3 of 7 (6 of 11) targets: learnt in 10 steps
        assert val["caption_token_accuracy"] > 3 / 7, val
    # frozen: only the projector (64*256 + 256 + 256*256 + 256) trains, into a random decoder: it still learns a little
    assert trainable == (82432 if freeze else 3376704)
    assert last < first - (2.0 if not freeze else 0.3), (first, last)


def test_shapes_captions_draw_and_name_digits(tmp_path):
    """data.caption_digits: about that share of the images carry a digit; against the same set without digits, a
    digit image differs exactly at the digit's lit pixels (the glyph, written out here, in DIGIT_INK, centred on the
    shape), its caption adds "with the digit N", and the row's targets hold those words. 0 keeps the old captions;
    out-of-range shares and rows too short for the longer caption are one line."""
    import numpy as np

    from titanlike.config.errors import ConfigError
    from titanlike.config.load import load_config
    from titanlike.data.image_text import DIGIT_INK, PIXELS, PLACEHOLDERS, WORD_ID, ShapesCaptions

    on, off = ShapesCaptions(PIXELS + 32, 64, seed=3, digits=0.5), ShapesCaptions(PIXELS + 32, 64, seed=3)
    nine = ["###", "#.#", "###", "..#", "###"]  # 3 wide, 5 tall
    zero = ["###", "#.#", "#.#", "#.#", "###"]
    for i, caption, glyph, top, left in ((1, "a green triangle at bottom center with the digit 9", nine, 25, 15),
                                         (7, "a yellow square at middle right with the digit 0", zero, 15, 26)):
        (image, got), (plain, old) = on.draw(i), off.draw(i)
        assert (got, old) == (caption, caption[:caption.index(" with")])
        want = np.zeros((32, 32), dtype=bool)
        want[top:top + 5, left:left + 3] = np.array([[c == "#" for c in row] for row in glyph])
        assert np.array_equal((image != plain).any(0), want)  # nothing else moved: the digit has its own stream
        assert (image[:, want] == np.array(DIGIT_INK)[:, None]).all()
        ids, labels = on[i]
        words = [WORD_ID[w] for w in caption.split()] + [WORD_ID["<end>"]]
        assert ids[PIXELS + PLACEHOLDERS:PIXELS + PLACEHOLDERS + 11].tolist() == words
        assert labels[labels != IGNORE_INDEX].tolist()[PLACEHOLDERS - 1:] == words
    assert not on.draw(2)[1].count("digit") and np.array_equal(on.draw(2)[0], off.draw(2)[0])
    captions = [on.draw(i)[1] for i in range(300)]
    with_digit = [c for c in captions if " with the digit " in c]
    assert 0.4 < len(with_digit) / 300 < 0.6 and {c[-1] for c in with_digit} == set("0123456789")
    assert all("digit" not in off.draw(i)[1] for i in range(50))
    with pytest.raises(ValueError, match=rf"up to 11 tokens; set training.seq_len >= {PIXELS + PLACEHOLDERS + 11}"):
        ShapesCaptions(PIXELS + 26, 64, digits=0.5)
    assert ShapesCaptions(PIXELS + 26, 64, digits=0)[0][0].shape == (PIXELS + 26,)
    base = ["--config", "configs/llava_debug.toml", f"--job.dump_folder={tmp_path}"]
    assert load_config(base).data.caption_digits == 0.5
    with pytest.raises(ConfigError, match=r"data.caption_digits=1.5 must be in \[0, 1\]"):
        load_config(base + ["--data.caption_digits=1.5"])


def test_caption_accuracy_is_greedy_exact_match():
    """eval_metrics' caption_accuracy on a tiny random model: rows whose targets are the model's own greedy captions
    of their images (titanlike.infer.generate, 7 tokens) count as exact, a row with one target changed does not: 2 of
    3 rows, 20 of 21 tokens, by hand."""
    from titanlike.data.image_text import ShapesCaptions
    from titanlike.infer import generate

    args = tiny()
    model = build(args)
    objective = build_objective(SPEC.objective, args)
    data = ShapesCaptions(args.pixels + 32, VOCAB, seed=0, split="valid")
    per, n = args.image_tokens, 7
    bytes_ = torch.stack([torch.from_numpy(data.draw(i)[0].astype("int64").reshape(-1)) for i in range(3)])
    prompt = torch.full((3, per), args.image_token)
    pixels = objective(torch.cat([bytes_, prompt], 1), torch.cat([bytes_, prompt], 1), StepContext(0, 0)).inputs
    captions = generate(model, prompt.tolist(), max_new_tokens=n, pixels=pixels["pixels"])  # greedy, no EOS
    text = torch.cat([prompt, torch.tensor(captions)], 1)
    labels = torch.full_like(text, IGNORE_INDEX)
    labels[:, per - 1:per - 1 + n] = torch.tensor(captions)  # the last placeholder predicts the first word
    labels[2, per + 2] = (captions[2][3] + 1) % (VOCAB - 1)  # row 2: one word is not what greedy decoding says
    full = torch.full((3, args.pixels), IGNORE_INDEX)
    b = objective(torch.cat([bytes_, text], 1), torch.cat([full, labels], 1), StepContext(0, 0))
    with torch.no_grad():
        got = objective.eval_metrics(model(*b.args(), **b.kwargs()), b)
    print(f"greedy captions {captions}")
    assert len({tuple(c) for c in captions}) > 1  # the images matter
    assert [int(x) for x in got["caption_accuracy"]] == [2, 3]
    assert [int(x) for x in got["caption_token_accuracy"]] == [20, 21]


def test_parallel_checks_name_the_key():
    """TP, PP and CP pass the check (parallelize/llava.py runs them); the tower's and the decoder's TP limits and EP
    are one line each naming the key."""
    args = SPEC.flavors["debugmodel"]
    for kw in ({"tp": 2}, {"pp": 2}, {"cp": 2}, {"dp_shard": 2, "tp": 2}):
        dims = ParallelDims(**kw, world_size=int(torch.tensor(list(kw.values())).prod()))
        assert SPEC.check(args, dims, "debugmodel") == [], kw
    bad = SPEC.check(args, ParallelDims(tp=3, world_size=3), "debugmodel")
    assert bad and all(p.count("parallelism.tp") and "\n" not in p for p in bad), bad
    assert any(p.startswith("vision tower: parallelism.tp=3") for p in bad), bad
    ep = SPEC.check(args, type("Par", (), {"tp": 1, "pp": 1, "cp": 1, "ep": 2})(), "debugmodel")
    assert ep[0] == "parallelism.ep=2: llava has no routed experts; set parallelism.ep=1", ep


def test_memory_estimate_rows_fill_every_slot():
    """The planner traces the objective on llava's loader layout: every slot used, no stray placeholder."""
    from titanlike.planner.loader_batch import loader_batch

    args = tiny(images_per_row=2)
    seq = 2 * args.pixels + 48
    inputs, labels = loader_batch(None, 3, seq, args.vocab_size, torch.Generator().manual_seed(0), args)
    b = build_objective(SPEC.objective, args)(inputs, labels, StepContext(0, 0))
    assert (b.inputs["image_pos"] >= 0).sum(1).tolist() == [32] * 3 and b.inputs["pixels"].shape[:2] == (3, 2)


def test_mock_image_text_rows_train_and_flops_take_the_text_length():
    """data.dataset = "mock_image_text" (throughput rows at any tower size, K images a row): K slots of pixel bytes,
    then random text with K placeholder runs that the objective accepts; a mismatch with the model is one line
    naming the keys. FLOPs per loader value: the decoder's attention at the text's length, not the row's."""
    from types import SimpleNamespace

    from titanlike.data.image_text import MockImageText

    args = tiny("debug-siglip", images_per_row=2)
    seq = 2 * args.pixels + 48
    ds = MockImageText(seq, VOCAB, args.vision.image_size, args.image_tokens, 2, seed=1)
    ids, labels = ds[5]
    assert torch.equal(ids, ds[5][0]) and not torch.equal(ids, ds[6][0])  # a function of (seed, split, i)
    assert ids[:2 * args.pixels].max() < 256 and (ids[2 * args.pixels:] == args.image_token).sum() == 32
    rows = torch.stack([ids, ds[6][0]])
    b = build_objective(SPEC.objective, args)(rows, torch.stack([labels, ds[6][1]]), StepContext(0, 0))
    assert b.inputs["pixels"].shape == (2, 2, 3, 32, 32) and (b.inputs["image_pos"] >= 0).sum() == 64
    data = SimpleNamespace(dataset="mock_image_text", image_size=32, image_tokens=16, images_per_row=1)
    assert "data.images_per_row=2" in SPEC.objective(args).data_problem(data)
    with pytest.raises(ValueError, match="training.seq_len >= "):
        MockImageText(2 * args.pixels + 20, VOCAB, 32, 16, 2)

    llama = models.get_spec("llama3")
    image = models.llava.flops_per_image(args)
    assert SPEC.flops_per_token(args, seq) == pytest.approx(
        (48 * llama.flops_per_token(args.text_args, 48) + 2 * image) / seq)
    costs = SPEC.pp_costs(args, seq)
    assert sum(costs.layers.values()) + costs.embedding + costs.output == pytest.approx(  # (but the final norm's
        SPEC.flops_per_token(args, seq), rel=1e-3)  # 1-D parameters, as every family's)


def test_llava_1_5_config_reads_as_the_clip_tower():
    """llava-hf/llava-1.5-7b-hf's config.json (its vision_config lists only what differs from CLIPVisionConfig's
    defaults: quick_gelu, eps 1e-5 come from them) reads as models/vit's L/14-336-clip tower, feature layer -2,
    strategy "default": 576 image tokens; our 1B-clip flavor has the same tower."""
    transformers = pytest.importorskip("transformers")
    vision = {"hidden_size": 1024, "image_size": 336, "intermediate_size": 4096, "model_type": "clip_vision_model",
              "num_attention_heads": 16, "num_hidden_layers": 24, "patch_size": 14, "projection_dim": 768,
              "vocab_size": 32000}
    text = {"model_type": "llama", "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "vocab_size": 32064}
    config = transformers.LlavaConfig(vision_config=vision, text_config=text, image_token_index=32000).to_dict()
    args = SPEC.hf.args_from_hf_config(config)
    assert args.vision == models.get_spec("vit").flavors["L/14-336-clip"]
    assert (args.vision_feature_layer, args.vision_feature_select_strategy, args.image_tokens) == (-2, "default", 576)
    assert args.vision_layers_used == 23 and SPEC.flavors["1B-clip"].vision == args.vision
    assert SPEC.hf.hf_config(SPEC.flavors["1B-clip"], torch.bfloat16)["vision_config"]["model_type"] == \
        "clip_vision_model"
