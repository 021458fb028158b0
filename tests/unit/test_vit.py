"""ViT (models/vit): the published sizes against transformers' own models, FLOPs per image against torch's FLOP
counter, the objective's images, the refusals, and logits against ViTForImageClassification in fp32. The shared
checks (counts on meta, plans on fake ranks, HF export round trip) are tests/unit/test_model_contract.py's."""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

import models
from models.batch import StepContext, build_objective
from models.vit import flops_per_image, flops_per_patch_token

torch.set_num_threads(1)
SPEC = models.get_spec("vit")


def build(args, seed: int = 0):
    torch.manual_seed(seed)
    with torch.device("meta"):
        model = SPEC.model_cls(args)
    model.to_empty(device="cpu")
    model.init_weights()
    return model


@pytest.mark.parametrize("flavor", sorted(SPEC.flavors))
def test_param_counts_equal_transformers_models(flavor):
    """Every flavor: our count = transformers' ViTForImageClassification of hf_config (built on meta), and the
    published sizes of google/vit-{base,large}-patch16-224: 86.6M, 304.3M (H/14 with 1000 classes: 632.0M)."""
    transformers = pytest.importorskip("transformers")
    args = SPEC.flavors[flavor]
    config = transformers.ViTConfig(**{k: v for k, v in SPEC.hf.hf_config(args, torch.float32).items()
                                       if k not in ("architectures", "model_type", "torch_dtype")})
    with torch.device("meta"):
        theirs = transformers.ViTForImageClassification(config)
    assert SPEC.param_counts(args).total == sum(p.numel() for p in theirs.parameters())
    published = {"B/16": 86_567_656, "L/16": 304_326_632}
    if flavor in published:
        assert SPEC.param_counts(args).total == published[flavor]


def test_flops_per_image_match_the_flop_counter():
    """One forward + backward of a batch of images on the math SDPA backend: torch's counter sees exactly our
    matmul FLOPs per image (blocks over 17 tokens, the patch conv's forward and weight gradient, the classifier on
    the class token)."""
    args = SPEC.flavors["debugmodel"]
    model = build(args).train()
    pixels = torch.randn(3, args.channels, args.image_size, args.image_size)
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        F.cross_entropy(model(pixels), torch.tensor([0, 1, 2])).backward()
    assert counter.get_total_flops() == 3 * flops_per_image(args)
    assert SPEC.flops_per_token(args, args.pixels) * args.pixels == flops_per_image(args)
    assert flops_per_patch_token(args) * args.n_tokens == flops_per_image(args)
    # B/16 at 224: 197 tokens; the published 17.6 G multiply-adds forward per image (timm's "GMACs"), x2 FLOPs
    # each, x3 for training
    assert flops_per_image(SPEC.flavors["B/16"]) / 3 / 2 == pytest.approx(17.56e9, rel=0.01)


def test_objective_makes_normalised_images_and_one_label_each():
    args = SPEC.flavors["debugmodel"]
    objective = build_objective(SPEC.objective, args)
    ids = torch.randint(0, 256, (2, args.pixels))
    labels = torch.tensor([[3] * args.pixels, [7] * args.pixels])
    batch = objective(ids, labels, StepContext(step=5, seed=1))
    assert batch.primary == "pixels" and batch.sequence == ()
    assert batch.inputs["pixels"].shape == (2, 3, 32, 32)
    assert torch.equal(batch.inputs["pixels"][1, 2, 4, 5], ids[1, 2 * 1024 + 4 * 32 + 5] / 127.5 - 1)
    assert batch.labels.tolist() == [3, 7] and int(batch.target_count()) == 2
    with pytest.raises(ValueError, match=r"training.seq_len=100: .* set training.seq_len=3072"):
        objective(ids[:, :100], labels[:, :100], StepContext(step=0, seed=0))
    assert "data.dataset='stdlib'" in objective.data_problem(dataclasses.make_dataclass("D", ["dataset"])("stdlib"))
    assert objective.data_problem(dataclasses.make_dataclass("D", ["dataset"])("shapes")) is None


def test_bad_image_size_and_tp_are_refused_in_one_line():
    from titanlike.distributed.parallel_dims import ParallelDims

    args = dataclasses.replace(SPEC.flavors["debugmodel"], image_size=30)
    (problem,) = SPEC.check(args, ParallelDims(dp_shard=1, world_size=1), "debugmodel")
    assert "model.args.image_size=30" in problem and "multiple of 8" in problem and "\n" not in problem
    problem = SPEC.check(SPEC.flavors["debugmodel"], ParallelDims(dp_shard=1, tp=3, world_size=3), "debugmodel")[0]
    assert problem.startswith("parallelism.tp=3") and "n_heads=4" in problem
    par = type("Par", (), {"tp": 2, "pp": 1, "cp": 1, "ep": 1, "enable_sequence_parallel": True})()
    (problem,) = SPEC.check(SPEC.flavors["debugmodel"], par, "debugmodel")  # 17 tokens over 2 ranks
    assert problem.startswith("parallelism.enable_sequence_parallel=true") and "17 tokens" in problem
    assert SPEC.check(dataclasses.replace(SPEC.flavors["debugmodel"], image_size=24), par, "debugmodel") == []
    (problem,) = SPEC.check(SPEC.flavors["debugmodel"], ParallelDims(dp_shard=1, cp=2, world_size=2), "debugmodel")
    assert problem.startswith("parallelism.cp=2")
    model = build(SPEC.flavors["debugmodel"])
    with pytest.raises(ValueError, match="model.args.image_size"):
        model(torch.zeros(1, 3, 24, 24))


def test_logits_equal_transformers_and_import_round_trips():
    """Random weights loaded into transformers' ViTForImageClassification (through from_hf of its own in-memory
    names, transformers 5.x's) give our logits within 1e-4 in fp32 (measured: ~1e-6 at logits of ~5); export as
    files is test_model_contract's."""
    transformers = pytest.importorskip("transformers")
    args = SPEC.flavors["debugmodel"]
    ours = build(args).eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in ours.parameters():
            p.copy_(0.1 * torch.randn(p.shape, generator=g) + (1.0 if p.ndim == 1 else 0.0))
    cfg = {k: v for k, v in SPEC.hf.hf_config(args, torch.float32).items()
           if k not in ("architectures", "model_type", "torch_dtype")}
    theirs = transformers.ViTForImageClassification(transformers.ViTConfig(**cfg, attn_implementation="eager"))
    sd = ours.state_dict()
    names = {n: next(iter(SPEC.hf.from_hf({n: t}, args))) for n, t in theirs.state_dict().items()}
    assert sorted(names.values()) == sorted(sd)  # every tensor, once
    theirs.load_state_dict({n: sd[k] for n, k in names.items()})
    pixels = torch.randn(2, 3, 32, 32, generator=g)
    with torch.no_grad():
        got, want = ours(pixels), theirs.eval()(pixel_values=pixels).logits
    assert want.abs().max() > 1
    err = (got - want).abs().max().item()
    print(f"vit debug logits vs transformers: max abs error {err:.2e} at max |logit| {want.abs().max():.2f}")
    assert err < 1e-4


# ------------------------------------------------------------------------------------------------ data
def _data_cfg(**kw):
    from titanlike.config.sections import Data

    return dataclasses.replace(Data(), **kw)


def test_shapes_are_deterministic_resumable_and_refuse_a_bad_row_length():
    from titanlike.data.images import ShapesDataset
    from titanlike.data.loader import build_dataloader

    ds = ShapesDataset(3072, seed=3)
    ids, labels = ds[12]
    assert ids.shape == labels.shape == (3072,) and 0 <= int(ids.min()) and int(ids.max()) <= 255
    assert torch.equal(ids, ShapesDataset(3072, seed=3)[12][0]) and not torch.equal(ids, ds[13][0])
    assert not torch.equal(ids, ShapesDataset(3072, seed=3, split="valid")[12][0])
    assert sorted({int(ds[i][1][0]) for i in range(200)}) == list(range(10))
    with pytest.raises(ValueError, match=r"training.seq_len=3000: .*set training.seq_len = 3 \* image_size\*\*2"):
        ShapesDataset(3000)

    kw = dict(dp_rank=0, dp_degree=1, local_batch_size=4, seq_len=3072, seed=3, vocab_size=256)
    loader = build_dataloader(_data_cfg(dataset="shapes"), None, **kw)
    it = iter(loader)
    next(it), next(it)
    state = loader.state_dict()
    want = next(it)
    again = build_dataloader(_data_cfg(dataset="shapes"), None, **kw)
    again.load_state_dict(state)
    got = next(iter(again))
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_image_folder_reads_imagenet_layout(tmp_path):
    Image = pytest.importorskip("PIL.Image")
    from titanlike.data.dataset import build_dataset

    for split in ("train", "val"):
        for c, colour in (("n01_cat", (255, 0, 0)), ("n02_dog", (0, 0, 255))):
            (tmp_path / split / c).mkdir(parents=True)
            Image.new("RGB", (40, 20), colour).save(tmp_path / split / c / "a.png")
    ds = build_dataset(_data_cfg(dataset="image_folder", paths=[str(tmp_path)]), None, seq_len=3 * 16 * 16)
    assert ds.classes == ["n01_cat", "n02_dog"] and len(ds) == 2
    ids, labels = ds[1]
    assert labels.unique().tolist() == [1]
    assert ids.view(3, 16, 16)[:, 8, 8].tolist() == [0, 0, 255]  # resized, cropped, channel-major
    with pytest.raises(ValueError, match="needs data.paths"):
        build_dataset(_data_cfg(dataset="image_folder"), None, seq_len=768)


def test_debug_model_learns_the_shapes():
    """30 AdamW steps of 32 images (the debug config's run, as a plain loop): the held-out accuracy rises well
    above chance (10 classes) and the loss falls."""
    from titanlike.data.images import ShapesDataset

    args = SPEC.flavors["debugmodel"]
    model = build(args).train()
    objective = build_objective(SPEC.objective, args)
    train, valid = ShapesDataset(args.pixels, seed=0), ShapesDataset(args.pixels, seed=0, split="valid")

    def batch(ds, lo, n):
        ids, labels = zip(*(ds[i] for i in range(lo, lo + n)))
        return objective(torch.stack(ids), torch.stack(labels), StepContext(step=0, seed=0))

    held = batch(valid, 0, 256)

    def accuracy():
        with torch.no_grad():
            return (model.eval()(held.inputs["pixels"]).argmax(-1) == held.labels).float().mean().item()

    before = accuracy()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for step in range(30):
        b = batch(train, 32 * step, 32)
        loss = F.cross_entropy(model.train()(b.inputs["pixels"]), b.labels)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    after = accuracy()
    print(f"vit shapes: loss {losses[0]:.3f} -> {sum(losses[-5:]) / 5:.3f}, held-out accuracy {before:.3f} -> "
          f"{after:.3f}")
    assert sum(losses[-5:]) / 5 < losses[0] - 0.4 and after > before + 0.15 and after > 0.3
