"""A toy image classifier: a model whose input is not token ids, with a frozen part.

The family's own objective (a factory in its ModelSpec, models/batch.py's Objective) makes each loader batch into
images: pixels [B, C, H, W] synthesised deterministically from the row's tokens (sines of the token ids), and one
label per image (the row's first token modulo n_classes, which the pixels encode). The Batch's primary input is
"pixels" and nothing in it is a sequence context parallel could cut; labels are [B], so the loss is normalised by
the global count of images.

The patch projection is frozen (requires_grad=False, as a pretrained vision tower or a LoRA base would be) and shares
its FSDP group with the trainable patch position table: the optimizer, the clip and the memory estimate must leave
it out, the checkpoint must keep it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from models.batch import Batch, StepContext
from models.spec import ModelShape, ModelSpec, ParamCounts, PipelineCosts
from toy_models import ToyArgs, ToyBlock, _block_matmul_params, _block_params


@dataclass
class ToyVisionArgs(ToyArgs):
    channels: int = 3
    image_size: int = 8
    patch_size: int = 4
    n_classes: int = 8

    @property
    def n_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def patch_dim(self) -> int:
        return self.channels * self.patch_size ** 2


class PatchEmbed(nn.Module):
    """pixels [B, C, H, W] -> [B, N, dim]: a frozen linear projection of each patch plus a trainable position row."""

    def __init__(self, args: ToyVisionArgs):
        super().__init__()
        self.p = args.patch_size
        self.proj = nn.Linear(args.patch_dim, args.dim)
        self.proj.requires_grad_(False)  # frozen: set at build, on meta; FSDP and to_empty keep the flag
        self.pos = nn.Parameter(torch.empty(args.n_patches, args.dim))

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        patches = F.unfold(pixels, kernel_size=self.p, stride=self.p).transpose(1, 2)  # [B, N, C*p*p]
        return self.proj(patches) + self.pos


class ToyVision(nn.Module):
    """pixels [B, C, H, W] -> class logits [B, n_classes]: patches -> bidirectional blocks -> mean -> head."""

    def __init__(self, args: ToyVisionArgs):
        super().__init__()
        self.args = args
        self.patch_embed = PatchEmbed(args)
        self.layers = nn.ModuleDict({str(i): ToyBlock(args, causal=False) for i in range(args.n_layers)})
        self.ln_f = nn.LayerNorm(args.dim, eps=args.norm_eps)
        self.head = nn.Linear(args.dim, args.n_classes, bias=False)

    @torch.no_grad()
    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        std, resid = 0.02, 0.02 / math.sqrt(2 * self.args.n_layers)
        nn.init.normal_(self.patch_embed.proj.weight, std=1 / math.sqrt(self.args.patch_dim))
        nn.init.zeros_(self.patch_embed.proj.bias)
        nn.init.normal_(self.patch_embed.pos, std=std)
        for block in self.layers.values():
            block.init_weights(std, resid)
        nn.init.ones_(self.ln_f.weight)
        nn.init.zeros_(self.ln_f.bias)
        nn.init.normal_(self.head.weight, std=std)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        h = self.patch_embed(pixels)
        for block in self.layers.values():
            h = block(h)
        return self.head(self.ln_f(h).mean(dim=1))


@dataclass(frozen=True)
class TokenImages:
    """The family's objective: loader tokens -> (pixels, a class per image); no randomness, so any layout and a
    resumed run see the same images."""
    args: ToyVisionArgs
    loss: str = "cross_entropy"

    def __call__(self, input_ids: torch.Tensor, labels: torch.Tensor, ctx: StepContext) -> Batch:
        a = self.args
        values = a.channels * a.image_size ** 2
        per_token = -(-values // input_ids.shape[1])
        freqs = 0.5 ** torch.arange(per_token, device=input_ids.device, dtype=torch.float32)
        waves = torch.sin(input_ids.float()[:, :, None] * freqs)  # [B, S, per_token]
        pixels = waves.flatten(1)[:, :values].reshape(-1, a.channels, a.image_size, a.image_size)
        return Batch(inputs={"pixels": pixels}, labels=input_ids[:, 0] % a.n_classes, primary="pixels", sequence=())


# ------------------------------------------------------------------------------------ counts, from the args alone
def param_counts(args: ToyVisionArgs) -> ParamCounts:
    d = args.dim
    embed = args.patch_dim * d + d + args.n_patches * d
    total = embed + args.n_layers * _block_params(args) + 2 * d + d * args.n_classes
    return ParamCounts(total=total, active=total, embedding=0)  # the patch projection is a matmul, not a lookup


def flops_per_token(args: ToyVisionArgs, seq_len: int) -> int:
    """Per loader token (the trainer's unit): one image per row of seq_len tokens. Trainable matmuls 6 FLOPs per
    weight and patch; the frozen projection 2 (forward only: neither its weight nor its input wants a gradient)."""
    n = args.n_patches
    per_image = (6 * n * args.n_layers * _block_matmul_params(args) + 12 * args.n_layers * args.dim * n * n
                 + 2 * n * args.patch_dim * args.dim + 6 * args.dim * args.n_classes)
    return per_image // seq_len


def pp_costs(args: ToyVisionArgs, seq_len: int) -> PipelineCosts:
    block = 6.0 * _block_matmul_params(args) + 12.0 * args.dim * args.n_patches
    return PipelineCosts(layers={str(i): block for i in range(args.n_layers)}, embedding=0.0, output=0.0)


def shape(args: ToyVisionArgs) -> ModelShape:
    return ModelShape(dim=args.dim, n_layers=args.n_layers, kv_dim=2 * args.dim)


def check(args: ToyVisionArgs, par, flavor: str) -> list[str]:
    problems = [f"parallelism.{n}={getattr(par, n, 1)}: the toy vision family implements FSDP only; set "
                f"parallelism.{n}=1" for n in ("tp", "pp", "cp", "ep") if getattr(par, n, 1) > 1]
    if args.image_size % args.patch_size:
        problems.append(f"model.flavor={flavor!r}: image_size {args.image_size} is not a multiple of patch_size "
                        f"{args.patch_size}")
    return problems


SPEC = ModelSpec(
    name="toy_vision",
    model_cls=ToyVision,
    args_cls=ToyVisionArgs,
    flavors={"tiny": ToyVisionArgs(dim=64, n_layers=2, n_heads=4, mlp_ratio=4, vocab_size=2048, max_seq_len=64)},
    plans="toy_plans",
    param_counts=param_counts,
    flops_per_token=flops_per_token,
    pp_costs=pp_costs,
    shape=shape,
    check=check,
    input_modules=("patch_embed",),
    output_modules=("ln_f", "head"),
    objective=TokenImages,
)
