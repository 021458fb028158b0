"""LLaVA (HF's LlavaForConditionalGeneration): a vision tower, a projector MLP and a decoder language model, the
image features spliced into the token sequence at the placeholder tokens. FQNs:

    tok_embeddings, layers.<i>.*, norm, output       the language model's own (its family's names: its HF adapter
                                                     and plans apply to them unchanged)
    vision.{patch_embed, layers.<j>}                 the vision family's model, without the blocks and final norm
                                                     that never reach the features (hidden_states[layer] of HF)
    projector.{linear_1, linear_2}                   HF LlavaMultiModalProjector: linear -> act -> linear

The language modules sit at the top (not under `language.`) so `layers` is the decoder's blocks, as the trainer,
FSDP grouping, AC and compile expect of every family; the decoder object itself is built by its family's spec and
kept unregistered, for its RoPE table and attention inputs. Plain nn.Module, nothing distributed.
"""
from __future__ import annotations

import dataclasses

import torch
from torch import nn
from torch.nn import functional as F

from models.llava.args import ModelArgs

_ACTS = {"gelu": F.gelu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"), "silu": F.silu,
         "relu": F.relu, "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x)}


class Projector(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        if args.projector_act not in _ACTS:
            raise ValueError(f"projector_act={args.projector_act!r}: choose one of {sorted(_ACTS)}")
        self.act = _ACTS[args.projector_act]
        self.linear_1 = nn.Linear(args.vision.dim, args.dim, bias=args.projector_bias)
        self.linear_2 = nn.Linear(args.dim, args.dim, bias=args.projector_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))

    def init_weights(self, std: float) -> None:
        for lin in (self.linear_1, self.linear_2):
            nn.init.normal_(lin.weight, std=std)  # HF's _init_weights: normal(initializer_range), zero biases
            if lin.bias is not None:
                nn.init.zeros_(lin.bias)


def image_mismatch(n_placeholders: int, n_images: int, per_image: int) -> str:
    return (f"llava: {n_placeholders} image placeholder tokens but {n_images} images x {per_image} patches = "
            f"{n_images * per_image} image features; each image needs exactly {per_image} placeholders")


class Llava(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        from models.llava import families

        self.args = args
        lm = families.language(args.language_family).model_cls(args.text_args)
        # Registered first, so the model's first attention module (and its state-dict order) is the language's.
        self.tok_embeddings, self.layers, self.norm, self.output = lm.tok_embeddings, lm.layers, lm.norm, lm.output
        self.vocab_size, self.n_layers = lm.vocab_size, lm.n_layers
        self.register_buffer("rope_cache", lm.rope_cache, persistent=False)
        self._lm = (lm,)  # a tuple: not a submodule (its modules are ours above)
        self.cp_shard, self.mask_kernel = None, "sdpa"  # as models/common/decoder.py's (the trainer sets them)
        vit = families.vision(args.vision_family).model_cls(dataclasses.replace(args.vision, n_classes=0))
        for j in range(args.vision_layers_used, args.vision.n_layers):
            del vit.layers[str(j)]  # past the feature layer: HF computes them, nothing reads them
        vit.norm = vit.map_head = None  # the final norm and SigLIP's pooling head come after every feature layer
        self.vision = vit
        self.projector = Projector(args)
        for part in args.freeze:
            for p in self.part_parameters(part):
                p.requires_grad_(False)

    def part_parameters(self, part: str) -> list[nn.Parameter]:
        if part == "vision":
            return list(self.vision.parameters())
        if part == "projector":
            return list(self.projector.parameters())
        return [p for m in (self.tok_embeddings, self.layers, self.norm, self.output) for p in m.parameters()]

    @torch.no_grad()
    def init_weights(self, buffer_device: torch.device | str | None = None) -> None:
        lm = self._lm[0]
        device = buffer_device if buffer_device is not None else self.rope_cache.device
        # the decoder's init, on our modules (they are the same objects); its RoPE table built on `device`
        lm.rope_cache = self.rope_cache
        lm.init_weights(device)
        self.rope_cache = lm.rope_cache
        self.vision.init_weights()
        self.projector.init_weights(getattr(self.args.vision, "init_std", 0.02))

    def image_features(self, pixels: torch.Tensor) -> torch.Tensor:
        """pixels [N, C, H, W] -> [N, image_tokens, dim]: HF LlavaModel.get_image_features (one feature layer)."""
        # through the tower's own forward (its kept blocks; no norm, no head): FSDP's hooks sit on that module
        h = self.vision(pixels)
        if self.args.vision_feature_select_strategy == "default":
            h = h[:, 1:]
        return self.projector(h)

    def forward(self, tokens: torch.Tensor, pixels: torch.Tensor | None = None, doc_ids: torch.Tensor | None = None,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        """tokens [B, S] with image_token runs; pixels [N, C, H, W]: the batch's images in order (row by row, left to
        right), normalised as the tower's processor does -> logits [B, S, V]."""
        h = self.tok_embeddings(tokens)
        if pixels is not None:
            is_image = tokens == self.args.image_token
            per = self.args.image_tokens
            n = int(is_image.sum())  # one host sync per step: the counts must agree before any work is wasted
            if n != pixels.shape[0] * per:
                raise ValueError(image_mismatch(n, pixels.shape[0], per))
            # The tower runs even on no images: every rank then takes part in its FSDP collectives each step.
            feats = self.image_features(pixels).to(h.dtype)
            h = h.masked_scatter(is_image.unsqueeze(-1), feats) if n else h + 0 * feats.sum()
        lm = self._lm[0]
        lm.cp_shard, lm.mask_kernel, lm.rope_cache = self.cp_shard, self.mask_kernel, self.rope_cache
        rope, mask = lm._attention_inputs(tokens.shape[1], doc_ids, positions, tokens.device)
        for layer in self.layers.values():
            h = layer(h, rope, mask)
        return self.output(self.norm(h))
