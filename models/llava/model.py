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
        mods = {"vision": (self.vision,), "projector": (self.projector,)}.get(
            part, (self.tok_embeddings, self.layers, self.norm, self.output))
        return [p for m in mods if m is not None for p in m.parameters()]

    @torch.no_grad()
    def init_weights(self, buffer_device: torch.device | str | None = None) -> None:
        lm = self._lm[0]
        device = buffer_device if buffer_device is not None else self.rope_cache.device
        # the decoder's init, on our modules (they are the same objects); its RoPE table built on `device`
        lm.rope_cache = self.rope_cache
        # a pipeline stage sets the modules it does not hold to None on us only: the decoder must skip them too
        lm.tok_embeddings, lm.norm, lm.output = self.tok_embeddings, self.norm, self.output
        lm.init_weights(device)
        self.rope_cache = lm.rope_cache
        if self.vision is not None:  # (the first pipeline stage's, with the projector)
            self.vision.init_weights()
        if self.projector is not None:
            self.projector.init_weights(getattr(self.args.vision, "init_std", 0.02))

    def image_features(self, pixels: torch.Tensor) -> torch.Tensor:
        """pixels [N, C, H, W] -> [N, image_tokens, dim]: HF LlavaModel.get_image_features (one feature layer)."""
        # through the tower's own forward (its kept blocks; no norm, no head): FSDP's hooks sit on that module
        h = self.vision(pixels)
        if self.args.vision_feature_select_strategy == "default":
            h = h[:, 1:]
        return self.projector(h)

    def forward(self, tokens: torch.Tensor, pixels: torch.Tensor | None = None,
                image_pos: torch.Tensor | None = None, doc_ids: torch.Tensor | None = None,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        """tokens [B, S] with image_token runs -> logits [B, S, V]. pixels, normalised as the tower's processor does:
        [N, C, H, W], the batch's images in order (row by row, left to right: HF's layout), or [B, K, C, H, W], K image
        slots per row (the objective's: row b's k-th placeholder run is slot [b, k], unused slots ignored), with
        image_pos [B, S] (image_positions below; computed from the tokens when not given). Slots keep every input
        per row, so a pipeline's micro-batches and context parallel's sequence cut (image_pos is cut with the
        tokens) need no image bookkeeping: models/llava/objective.py gives them.

        Pipeline stages: without tok_embeddings the input is hidden states (the first stage did the splice);
        without output the return value is hidden states."""
        if self.tok_embeddings is None:
            h = tokens
        else:
            h = self.tok_embeddings(tokens)
            if pixels is not None and pixels.dim() == 5:
                h = self._splice_slots(tokens, h, pixels, image_pos)
            elif pixels is not None:
                h = self._splice_in_order(tokens, h, pixels)
        lm = self._lm[0]
        lm.cp_shard, lm.mask_kernel, lm.rope_cache = self.cp_shard, self.mask_kernel, self.rope_cache
        rope, mask = lm._attention_inputs(h.shape[1], doc_ids, positions, h.device)
        for layer in self.layers.values():
            h = layer(h, rope, mask)
        if self.norm is not None:
            h = self.norm(h)
        return self.output(h) if self.output is not None else h

    def _splice_in_order(self, tokens: torch.Tensor, h: torch.Tensor, pixels: torch.Tensor) -> torch.Tensor:
        is_image = tokens == self.args.image_token
        per = self.args.image_tokens
        n = int(is_image.sum())  # one host sync per step: the counts must agree before any work is wasted
        if n != pixels.shape[0] * per:
            raise ValueError(image_mismatch(n, pixels.shape[0], per))
        # The tower runs even on no images: every rank then takes part in its FSDP collectives each step.
        feats = self.image_features(pixels).to(h.dtype)
        return h.masked_scatter(is_image.unsqueeze(-1), feats) if n else h + 0 * feats.sum()

    def _splice_slots(self, tokens: torch.Tensor, h: torch.Tensor, pixels: torch.Tensor,
                      image_pos: torch.Tensor | None) -> torch.Tensor:
        # Every slot goes through the tower (unused ones too: no host sync to select them; their features reach no
        # output, so they add nothing to any gradient), then each placeholder takes its row's feature by index.
        b, k = pixels.shape[:2]
        feats = self.image_features(pixels.flatten(0, 1)).to(h.dtype).reshape(b, k * self.args.image_tokens, -1)
        pos = image_positions(tokens, self.args.image_token) if image_pos is None else image_pos
        picked = feats.gather(1, pos.clamp(min=0).unsqueeze(-1).expand(-1, -1, feats.shape[-1]))
        return torch.where((pos >= 0).unsqueeze(-1), picked, h)


def image_positions(tokens: torch.Tensor, image_token: int) -> torch.Tensor:
    """[B, S]: a placeholder's index among its row's placeholders (= slot k * image_tokens + patch j, the slots'
    features flattened), -1 for text."""
    is_image = tokens == image_token
    return torch.where(is_image, is_image.long().cumsum(1) - 1, -1)
