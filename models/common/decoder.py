"""The decoder skeleton every family shares, with Llama-style FQNs (public API: plans, checkpoints and HF adapters key
on them):

    tok_embeddings, layers.<i>.{attention_norm, attention, ffn_norm, feed_forward | moe}, norm, output

A family subclasses DecoderBlock (it builds the block's attention and FFN) and Decoder (it names its block and builds
its RoPE table). What attention, FFN and RoPE compute stays in the family; the order of the parts, the pipeline-stage
conventions and the initialisation order live here once, so the families cannot drift apart on them.

Built on the meta device, parallelized from outside, then materialised with `model.to_empty(device=...)` +
`model.init_weights()`, which (re)sets every parameter and buffer, so nothing relies on constructors' initialisation.
"""
from __future__ import annotations

import math
from typing import Any, Callable

import torch
from torch import nn

from models.common.masks import AttnMask, forward_mask
from models.common.mtp import MTP
from models.common.norms import RMSNorm

# The top-level modules before and after `layers` (ModelSpec.input_modules / output_modules of a Decoder family).
INPUT_MODULES = ("tok_embeddings",)
OUTPUT_MODULES = ("norm", "output")


class DecoderBlock(nn.Module):
    """Pre-norm residual block: h = x + attention(attention_norm(x), rope_cache); h + ffn(ffn_norm(h)).

    The FFN is stored as `moe` (moe=True) or `feed_forward`, never both: only the real one exists, so FQNs, state dicts
    and plans (parallelize/qwen3.py asks hasattr) see which kind the block is. `attention` and `ffn` each provide
    init_weights(init_std)."""

    def __init__(self, layer_id: int, dim: int, norm_eps: float, attention: nn.Module, ffn: nn.Module,
                 moe: bool) -> None:
        super().__init__()
        # Kept on the block so pipeline stages (which delete other layers) still init with the right depth.
        self.layer_id = layer_id
        self.moe_enabled = moe
        # Registration order is the state-dict and parameter order, which checkpoints and the optimizer follow.
        self.attention_norm = RMSNorm(dim, eps=norm_eps)
        self.attention = attention
        self.ffn_norm = RMSNorm(dim, eps=norm_eps)
        if moe:
            self.moe = ffn
        else:
            self.feed_forward = ffn
        # For the projections writing into the residual stream (wo, w2): depth-scaled, so its variance stays bounded.
        self.weight_init_std = 0.02 / math.sqrt(2 * (layer_id + 1))

    def forward(self, x: torch.Tensor, rope_cache: torch.Tensor, attn_mask: AttnMask | None = None) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), rope_cache, attn_mask=attn_mask)
        ffn = self.moe if self.moe_enabled else self.feed_forward
        return h + ffn(self.ffn_norm(h))

    def init_weights(self) -> None:
        # Under the trainer each parameter draws from its own generator, seeded by its name (seeded_init), so the
        # order of these calls does not change the weights; called bare, they draw from the global RNG in order.
        self.attention_norm.reset_parameters()
        self.ffn_norm.reset_parameters()
        self.attention.init_weights(self.weight_init_std)
        (self.moe if self.moe_enabled else self.feed_forward).init_weights(self.weight_init_std)


class Decoder(nn.Module):
    """tok_embeddings -> layers (blocks "0".."L-1") -> norm -> output, with the RoPE table as the `rope_cache` buffer.

    `args` needs vocab_size, dim, n_layers, norm_eps (and whatever the family's block and RoPE read); `block(i, args)`
    builds block i. Subclasses implement `_rope_cache(device)`."""

    def __init__(self, args: Any, block: Callable[[int, Any], nn.Module]) -> None:
        super().__init__()
        self.args = args
        self.vocab_size = args.vocab_size
        self.n_layers = args.n_layers
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        # ModuleDict with string keys: pipeline splitting deletes entries without renumbering, so FQNs (and
        # checkpoints) stay identical across layouts.
        self.layers = nn.ModuleDict({str(i): block(i, args) for i in range(args.n_layers)})
        self.norm = RMSNorm(args.dim, eps=args.norm_eps)
        # Never tied to tok_embeddings, even where the upstream model ties them: the HF adapters untie on import.
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        # Multi-token prediction (models/common/mtp.py), for families whose args have mtp_num_layers > 0: built from
        # the family's own block. Absent (no attribute value, no FQNs) when off, so such models are unchanged.
        self.mtp = MTP(args, block) if getattr(args, "mtp_num_layers", 0) > 0 else None
        # Pipeline stages (parallelize/pp.py): top-level modules that run on the output head's stage, beside
        # ModelSpec.output_modules, with the other top-level modules they read there. MTP embeds the next tokens, so
        # the last stage holds a copy of tok_embeddings (same FQN), whose gradient parallelize/tied.py sums with the
        # first stage's, as Megatron does for its MTP layers' embedding.
        self.last_stage_modules: dict[str, tuple[str, ...]] = {"mtp": ("tok_embeddings",)} if self.mtp else {}
        # Non-persistent: derived from args, so checkpoints do not carry it and any seq_len can load them.
        self.register_buffer("rope_cache", self._rope_cache(device=None), persistent=False)
        # models.common.masks.CPShard (rank, degree, method) when context parallel holds this rank's share of every
        # sequence (parallelize/cp.py sets it; the chunks are masks.load_balanced_chunks); None: the whole sequence.
        self.cp_shard: tuple | None = None
        # The kernel for masked attention (documents, context parallel): models.common.masks.MASK_KERNELS.
        self.mask_kernel = "sdpa"

    def _rope_cache(self, device: torch.device | str | None) -> torch.Tensor:
        """The family's RoPE table [max_seq_len, rotary dim] (cos | sin), built on `device`."""
        raise NotImplementedError(f"{type(self).__name__} must implement _rope_cache(device)")

    @torch.no_grad()
    def init_weights(self, buffer_device: torch.device | str | None = None) -> None:
        """(Re)initialise every parameter and buffer (nn.init: safe on DTensors). buffer_device: where to build the
        RoPE table (e.g. the GPU when parameters were materialised on CPU); defaults to where the buffer is.

        Modules set to None (another pipeline stage holds them) are skipped."""
        buffer_device = buffer_device if buffer_device is not None else self.rope_cache.device
        self.rope_cache = self._rope_cache(device=buffer_device)
        if self.tok_embeddings is not None:
            nn.init.normal_(self.tok_embeddings.weight, mean=0.0, std=1.0)
        for layer in self.layers.values():
            if layer is not None:
                layer.init_weights()
        if self.norm is not None:
            self.norm.reset_parameters()
        if self.output is not None:
            std = self.args.dim**-0.5
            nn.init.trunc_normal_(self.output.weight, mean=0.0, std=std, a=-3 * std, b=3 * std)
        if self.mtp is not None:
            self.mtp.init_weights()

    def forward(self, tokens: torch.Tensor, doc_ids: torch.Tensor | None = None,
                positions: torch.Tensor | None = None, mtp_labels: torch.Tensor | None = None,
                mtp_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """tokens [B, S] int64 -> logits [B, S, V] in the parameters' dtype.

        doc_ids [B, S_full]: the document of every token of the whole sequence (models.common.masks.document_ids);
        attention then stays within documents. positions [B, S_full]: RoPE positions (restarting per document). Under
        context parallel, tokens are this rank's chunks of sequences of S_full = S * cp tokens.

        Pipeline stages: a floating-point input is hidden states [B, S, dim] (a later stage's; the last stage holds
        tok_embeddings too when MTP reads it there, so its presence does not say "first stage"), token ids are
        embedded; without output the return value is hidden states.

        mtp_labels, mtp_tokens [B, S_full]: the loader's labels and input ids of the whole sequences (not cut by CP),
        from which the MTP modules (if any) take their targets and embedding inputs (mtp_tokens defaults to
        `tokens`); their losses join the gradient, not the output (models/common/mtp.py)."""
        rope, mask = self._attention_inputs(tokens.shape[1], doc_ids, positions, tokens.device)
        embed = self.tok_embeddings is not None and not tokens.is_floating_point()
        h = self.tok_embeddings(tokens) if embed else tokens
        for layer in self.layers.values():
            h = layer(h, rope, mask)
        if self.norm is not None:
            h = self.norm(h)
        if self.mtp is not None and mtp_labels is not None and torch.is_grad_enabled():
            h = self.mtp(h, tokens if mtp_tokens is None else mtp_tokens, mtp_labels, doc_ids, rope, mask,
                         self.tok_embeddings, self.output, self.cp_shard)
        if self.output is not None:
            h = self.output(h)
        return h

    def _attention_inputs(self, seqlen: int, doc_ids, positions, device) -> tuple[torch.Tensor, AttnMask | None]:
        """(RoPE rows, AttnMask or None) for one forward: one build for all layers."""
        q_index, mask = forward_mask(self.cp_shard, seqlen, doc_ids, self.mask_kernel, device)
        if positions is not None:
            rope = self.rope_cache[positions if q_index is None else positions[:, q_index]]
        else:
            rope = self.rope_cache if q_index is None else self.rope_cache[q_index]
        return rope, mask
