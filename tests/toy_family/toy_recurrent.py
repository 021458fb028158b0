"""A toy recurrent decoder that declares its own generation cache (ModelSpec.cache, models/cache.py): what a
Mamba-2 / Gated DeltaNet family needs, in miniature. Nothing in titanlike/infer names it.

Each block mixes tokens with a causal depthwise convolution (a window of CONV inputs) followed by a gated linear
recurrence per channel, no attention and no positions:

    u = in_proj(x), masked to 0 on pad tokens        c_t = sum_j conv[:, j] * u_{t-CONV+1+j}   (zeros before t=0)
    a_t = sigmoid(gate(x_t))                         h_t = a_t * h_{t-1} + (1 - a_t) * silu(c_t)    (h_{-1} = 0)
    y_t = out_proj(h_t)

Training runs the whole sequence from zero state. Generation carries, per layer, the last CONV-1 inputs and h from
one forward to the next (RecurrentCache): the prefill starts them at zero (Step.start), a pad token leaves them
unchanged (Step.valid), and each decode step continues them, so the greedy tokens equal full forwards'.
Generation only: the family has no plan in toy_plans (training is what the other toy families are for).
"""
from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from torch import nn

from models.cache import Step
from models.spec import ModelShape, ModelSpec, ParamCounts, PipelineCosts
from toy_models import ToyArgs, check, toy_flavors

CONV = 4  # the convolution's window (Mamba's d_conv)


class LayerState:
    """One mixer's carried state: the last CONV-1 inputs [B, CONV-1, D], the recurrent state [B, D], and the
    current forward's valid tokens [B, S]."""

    def __init__(self) -> None:
        self.window: torch.Tensor | None = None
        self.h: torch.Tensor | None = None
        self.valid: torch.Tensor | None = None


class RecurrentMixer(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.in_proj = nn.Linear(dim, dim)
        self.gate = nn.Linear(dim, dim)
        self.conv = nn.Parameter(torch.empty(dim, CONV))
        self.out_proj = nn.Linear(dim, dim)
        self.state: LayerState | None = None  # set by RecurrentCache.attached during generation only

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        u, a = self.in_proj(x), torch.sigmoid(self.gate(x))
        st = self.state
        window = x.new_zeros(b, CONV - 1, d) if st is None else st.window
        h = x.new_zeros(b, d) if st is None else st.h
        valid = None if st is None else st.valid
        if valid is not None:  # a pad token puts nothing into the window (the zeros before the sequence)
            u = u * valid[..., None].to(u.dtype)
        full = torch.cat([window, u], dim=1)  # [B, CONV-1+S, D]
        f = F.silu(sum(full[:, j:j + s] * self.conv[:, j] for j in range(CONV)))
        out = []
        for t in range(s):
            new = a[:, t] * h + (1 - a[:, t]) * f[:, t]
            h = new if valid is None else torch.where(valid[:, t, None], new, h)  # a pad token leaves h as it was
            out.append(h)
        if st is not None:
            st.window, st.h = full[:, s:], h
        return self.out_proj(torch.stack(out, dim=1))


class RecurrentBlock(nn.Module):
    def __init__(self, args: ToyArgs):
        super().__init__()
        d = args.dim
        self.ln_1 = nn.LayerNorm(d, eps=args.norm_eps)
        self.mixer = RecurrentMixer(d)
        self.ln_2 = nn.LayerNorm(d, eps=args.norm_eps)
        self.fc_in = nn.Linear(d, args.mlp_ratio * d)
        self.fc_out = nn.Linear(args.mlp_ratio * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.mixer(self.ln_1(x))
        return x + self.fc_out(F.gelu(self.fc_in(self.ln_2(x))))


class RecurrentDecoder(nn.Module):
    """tokens [B, S] -> logits [B, S, V]. `positions` (generation passes them) mean nothing to a recurrence."""

    def __init__(self, args: ToyArgs):
        super().__init__()
        self.args = args
        self.wte = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): RecurrentBlock(args) for i in range(args.n_layers)})
        self.ln_f = nn.LayerNorm(args.dim, eps=args.norm_eps)
        self.lm_head = nn.Linear(args.dim, args.vocab_size, bias=False)

    @torch.no_grad()
    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        """N(0, 1) embeddings (so a tiny random model does not repeat one token), N(0, 1/sqrt(fan_in)) linears and
        convolution, zero biases, unit LayerNorms. No buffers."""
        nn.init.normal_(self.wte.weight)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=1 / math.sqrt(m.in_features))
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.LayerNorm):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
            elif isinstance(m, RecurrentMixer):
                nn.init.normal_(m.conv, std=1 / math.sqrt(CONV))

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        h = self.wte(tokens)
        for block in self.layers.values():
            h = block(h)
        return self.lm_head(self.ln_f(h))


class RecurrentCache:
    """models/cache.py's GenerationCache for RecurrentDecoder: a LayerState per block, reset at each Step.start."""

    def __init__(self, model: RecurrentDecoder, rows: int, max_len: int) -> None:
        p = next(model.parameters())
        self.rows, self.dim, self.dtype, self.device = rows, model.args.dim, p.dtype, p.device
        self.layers = {key: LayerState() for key in model.layers}

    def set_step(self, step: Step) -> None:
        for st in self.layers.values():
            if step.start:  # new sequences: nothing an earlier call carried is theirs
                st.window = torch.zeros(self.rows, CONV - 1, self.dim, dtype=self.dtype, device=self.device)
                st.h = torch.zeros(self.rows, self.dim, dtype=self.dtype, device=self.device)
            st.valid = step.valid

    @contextlib.contextmanager
    def attached(self, model: RecurrentDecoder):
        for key, block in model.layers.items():
            block.mixer.state = self.layers[key]
        try:
            yield self
        finally:
            for block in model.layers.values():
                block.mixer.state = None


# ------------------------------------------------------------------------------------ counts, from the args alone
def _block_params(args: ToyArgs) -> int:
    d, h = args.dim, args.mlp_ratio * args.dim
    return 3 * (d * d + d) + d * CONV + (d * h + h) + (h * d + d) + 2 * 2 * d


def param_counts(args: ToyArgs) -> ParamCounts:
    embedding = args.vocab_size * args.dim
    total = embedding + args.n_layers * _block_params(args) + 2 * args.dim + args.dim * args.vocab_size
    return ParamCounts(total=total, active=total, embedding=embedding)


def flops_per_token(args: ToyArgs, seq_len: int) -> int:
    d, h = args.dim, args.mlp_ratio * args.dim
    return 6 * (args.n_layers * (3 * d * d + 2 * d * h) + d * args.vocab_size)  # no attention: linear in seq_len


def pp_costs(args: ToyArgs, seq_len: int) -> PipelineCosts:
    d, h = args.dim, args.mlp_ratio * args.dim
    return PipelineCosts(layers={str(i): 6.0 * (3 * d * d + 2 * d * h) for i in range(args.n_layers)},
                         embedding=0.0, output=6.0 * d * args.vocab_size)


def shape(args: ToyArgs) -> ModelShape:
    return ModelShape(dim=args.dim, n_layers=args.n_layers, kv_dim=0)  # no attention: nothing for CP to gather


SPEC = ModelSpec(
    name="toy_recurrent",
    model_cls=RecurrentDecoder,
    args_cls=ToyArgs,
    flavors=toy_flavors,
    plans="toy_plans",
    param_counts=param_counts,
    flops_per_token=flops_per_token,
    pp_costs=pp_costs,
    shape=shape,
    check=check,
    input_modules=("wte",),
    output_modules=("ln_f", "lm_head"),
    cache=RecurrentCache,
)

__all__ = ["SPEC", "RecurrentCache", "RecurrentDecoder"]
