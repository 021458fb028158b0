"""A toy decoder family, written only against the ModelSpec contract (models/spec.py) to prove that a family needs
nothing outside its own package and plans module.

Deliberately not Llama: learned absolute position embeddings (no RoPE), LayerNorm with biases (no RMSNorm), a GELU
MLP (no SwiGLU), fused QKV projection, and its own module names (`wte`, `wpe`, `ln_f`, `lm_head`; blocks with
`ln_1`, `qkv`, `proj`, `ln_2`, `fc_in`, `fc_out`), so any library code that reaches for Llama's names
(tok_embeddings / norm / output / attention.wq ...) or Llama's args shows up when this family is trained.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from models.spec import ModelShape, ModelSpec, ParamCounts, PipelineCosts


@dataclass
class ToyArgs:
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    mlp_ratio: int = 4
    vocab_size: int = 256  # the trainer sets it from the tokenizer / model.vocab_size
    max_seq_len: int = 64  # rows of the position table; the trainer sets it to training.seq_len
    norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        if self.dim % self.n_heads:
            raise ValueError(f"dim ({self.dim}) must be divisible by n_heads ({self.n_heads})")


toy_flavors: dict[str, ToyArgs] = {
    "tiny": ToyArgs(dim=64, n_layers=2, n_heads=4, mlp_ratio=4, vocab_size=2048, max_seq_len=64),
}


class ToyBlock(nn.Module):
    """Pre-LayerNorm block: x + proj(attn(ln_1 x)), then x + fc_out(gelu(fc_in(ln_2 x))). causal=False: every
    position sees every other (the encoder families of toy_encoder.py and toy_vision.py)."""

    def __init__(self, args: ToyArgs, causal: bool = True):
        super().__init__()
        d, h = args.dim, args.mlp_ratio * args.dim
        self.n_heads = args.n_heads
        self.causal = causal
        self.ln_1 = nn.LayerNorm(d, eps=args.norm_eps)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln_2 = nn.LayerNorm(d, eps=args.norm_eps)
        self.fc_in = nn.Linear(d, h)
        self.fc_out = nn.Linear(h, d)

    @torch.no_grad()
    def init_weights(self, std: float, resid: float) -> None:
        """N(0, std) weights (the residual projections N(0, resid)), zero biases, unit LayerNorm gains."""
        for lin in (self.qkv, self.fc_in, self.proj, self.fc_out):
            nn.init.normal_(lin.weight, std=resid if lin in (self.proj, self.fc_out) else std)
            nn.init.zeros_(lin.bias)
        for ln in (self.ln_1, self.ln_2):
            nn.init.ones_(ln.weight)
            nn.init.zeros_(ln.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.ln_1(x)).view(b, s, 3, self.n_heads, d // self.n_heads).unbind(2)
        attn = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                              is_causal=self.causal)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, s, d))
        return x + self.fc_out(F.gelu(self.fc_in(self.ln_2(x))))


class ToyDecoder(nn.Module):
    """tokens [B, S] -> logits [B, S, V]. Pipeline stages may set wte/wpe (first) or ln_f/lm_head (last) to None:
    forward then takes / returns the hidden states."""

    def __init__(self, args: ToyArgs):
        super().__init__()
        self.args = args
        self.wte = nn.Embedding(args.vocab_size, args.dim)
        self.wpe = nn.Embedding(args.max_seq_len, args.dim)
        self.layers = nn.ModuleDict({str(i): ToyBlock(args) for i in range(args.n_layers)})
        self.ln_f = nn.LayerNorm(args.dim, eps=args.norm_eps)
        self.lm_head = nn.Linear(args.dim, args.vocab_size, bias=False)

    @torch.no_grad()
    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        """GPT-2 style: N(0, 0.02) weights, zero biases, unit LayerNorm gains, residual projections scaled by
        1/sqrt(2 * n_layers). No buffers (`buffer_device` is part of the contract)."""
        std, resid = 0.02, 0.02 / math.sqrt(2 * self.args.n_layers)
        for emb in (self.wte, self.wpe):
            if emb is not None:
                nn.init.normal_(emb.weight, std=std)
        for block in self.layers.values():
            block.init_weights(std, resid)
        if self.ln_f is not None:
            nn.init.ones_(self.ln_f.weight)
            nn.init.zeros_(self.ln_f.bias)
        if self.lm_head is not None:
            nn.init.normal_(self.lm_head.weight, std=std)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.wte is not None:
            positions = torch.arange(tokens.shape[1], device=tokens.device)
            h = self.wte(tokens) + self.wpe(positions)
        else:
            h = tokens  # a later pipeline stage: hidden states in
        for block in self.layers.values():
            h = block(h)
        if self.ln_f is not None:
            h = self.ln_f(h)
        return self.lm_head(h) if self.lm_head is not None else h


# ------------------------------------------------------------------------------------ counts, from the args alone
def _block_matmul_params(args: ToyArgs) -> int:
    d, h = args.dim, args.mlp_ratio * args.dim
    return 3 * d * d + d * d + 2 * d * h  # qkv, proj, fc_in, fc_out weights


def _block_params(args: ToyArgs) -> int:
    d, h = args.dim, args.mlp_ratio * args.dim
    return _block_matmul_params(args) + 3 * d + d + h + d + 2 * 2 * d  # + biases + two LayerNorms


def param_counts(args: ToyArgs) -> ParamCounts:
    d = args.dim
    embedding = args.vocab_size * d + args.max_seq_len * d  # both tables are lookups
    total = embedding + args.n_layers * _block_params(args) + 2 * d + d * args.vocab_size
    return ParamCounts(total=total, active=total, embedding=embedding)


def flops_per_token(args: ToyArgs, seq_len: int) -> int:
    """6 per matmul weight (biases, LayerNorms and lookups do no matmul) + attention 12 * dim * seq_len per layer."""
    matmul = args.n_layers * _block_matmul_params(args) + args.dim * args.vocab_size
    return 6 * matmul + 12 * args.n_layers * args.dim * seq_len


def pp_costs(args: ToyArgs, seq_len: int) -> PipelineCosts:
    block = 6.0 * _block_matmul_params(args) + 12.0 * args.dim * seq_len
    return PipelineCosts(layers={str(i): block for i in range(args.n_layers)}, embedding=0.0,
                         output=6.0 * args.dim * args.vocab_size)


def shape(args: ToyArgs) -> ModelShape:
    return ModelShape(dim=args.dim, n_layers=args.n_layers, kv_dim=2 * args.dim)


def check(args: ToyArgs, par, flavor: str) -> list[str]:
    problems = []
    for name in ("tp", "pp", "cp", "ep"):
        degree = getattr(par, name, 1)
        if degree > 1:
            problems.append(f"parallelism.{name}={degree}: the toy family implements FSDP only; set "
                            f"parallelism.{name}=1")
    if args.dim % args.n_heads:
        problems.append(f"model.flavor={flavor!r}: dim {args.dim} is not divisible by n_heads {args.n_heads}")
    return problems


SPEC = ModelSpec(
    name="toy",
    model_cls=ToyDecoder,
    args_cls=ToyArgs,
    flavors=toy_flavors,
    plans="toy_plans",
    param_counts=param_counts,
    flops_per_token=flops_per_token,
    pp_costs=pp_costs,
    shape=shape,
    check=check,
    hf=None,
    input_modules=("wte", "wpe"),
    output_modules=("ln_f", "lm_head"),
)

__all__ = ["SPEC", "ToyArgs", "ToyBlock", "ToyDecoder", "toy_flavors"]
