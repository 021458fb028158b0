"""Mixture-of-experts feed-forward: router, sort-based dispatch, grouped experts (SwiGLU, or squared ReLU without a
gate: MoEArgs.expert_act), shared experts, an optional latent projection around the routed experts, balancing.

Public API (the model families, parallelize/ep.py and the trainer code against it): MoEArgs, moe_problems, MoE,
GroupedExperts (and LowRank, its weights with LoRA's adapters: models/common/lora.py), update_expert_bias. The router
and the balance losses live in models/common/router.py.

One forward, for x [B, S, dim] (T = B*S tokens, k = top_k, N = T*k assignments):
  1. the router picks k experts per token (fp32), with weights;
  2. the N assignments are sorted by expert (a stable argsort: no host sync) and the tokens gathered in that order;
  3. GroupedExperts runs each expert on its contiguous rows: torch._grouped_mm on CUDA capability >= 9.0 in bf16
     (or a converter's grouped GEMM on groups padded to its alignment: float8.moe_experts), else a per-expert loop;
  4. the rows are put back in token order and summed with the routing weights; shared experts are added;
     with latent_dim > 0 (NemotronH's moe_latent_size) the tokens are projected to latent_dim before step 2 and the
     weighted sum back to dim after step 4 (router and shared experts read the full width);
  5. the auxiliary losses, when enabled, enter the gradient through AuxLossGrad (the output's value is unchanged).

Capacity (capacity_factor > 0, Megatron's --moe-expert-capacity-factor): each expert keeps at most
ceil(cf * T * k / E) assignments per forward, the ones with its highest router scores (ties: the earlier token);
the rest contribute nothing and are counted in `last_dropped`. T is the tokens of this forward on this rank. The
experts then receive all N rows, the kept ones grouped by expert first and the dropped ones after them (padding:
sum(num_tokens_per_expert) < N), so that no shape depends on the data.

Buffers stay fp32 (expert_bias, tokens_per_expert): cast parameters, not the module (Module.to(bf16) would round the
counts above 256).
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from models.common.ffn import FeedForward, ReLU2FeedForward
from models.common.moe_align import pad_groups, unpad_groups
from models.common.moe_args import EXPERT_ACTS, MoEArgs, moe_problems
from models.common.router import (AuxLossGrad, Router, expert_counts, load_balance_loss, router_z_loss,
                                  routing_probs, seq_balance_loss)

__all__ = ["MoEArgs", "MoE", "GroupedExperts", "LowRank", "Router", "host_sizes", "moe_problems", "update_expert_bias"]


def _local(w: torch.Tensor) -> torch.Tensor:
    # Under expert parallelism the weights are DTensors sharded on dim 0; models/ may not import DTensor.
    # type(w), not w: dynamo answers hasattr(w, ...) False for a DTensor parameter while tracing.
    return w.to_local() if hasattr(type(w), "to_local") else w


def _use_grouped_mm(x: torch.Tensor, *widths: int) -> bool:
    """torch._grouped_mm's fast (CUTLASS, no host sync) kernel: bf16 on CUDA capability >= 9.0. Its TMA loads need
    16-byte aligned row strides, hence every width (dim, hidden, a LoRA rank) a multiple of 8; the per-expert row
    counts need no padding in bf16 (the weight-gradient GEMM reads the token dimension strided, not as the contiguous
    one)."""
    return (x.is_cuda and x.dtype == torch.bfloat16 and all(w % 8 == 0 for w in widths)
            and torch.cuda.get_device_properties(x.device).major >= 9)


def host_sizes(counts: torch.Tensor) -> list:
    """The routing's row counts as host integers (.tolist(): a host sync on CUDA). The one place the MoE reads routing
    values on the host: the expert loop's slices here, parallelize/ep.py's all-to-all split sizes."""
    return counts.tolist()


class LowRank(NamedTuple):
    """A stacked expert weight w [E, out, in] with a low-rank update per expert (LoRA on the routed experts,
    models/common/lora.py): expert e maps x to x w[e]^T + scale * (dropout(x) a[e]^T) b[e]^T, with a [E, r, in] and
    b [E, out, r]. The [E, out, in] sum is never formed, so autograd keeps only r-wide activations beyond the base's.
    The expert functions below take a LowRank wherever they take a weight."""
    w: torch.Tensor
    a: torch.Tensor
    b: torch.Tensor
    scale: float
    dropout: float = 0.0


def _base(w) -> torch.Tensor:
    return w.w if isinstance(w, LowRank) else w


def _tensors(*weights) -> list[torch.Tensor]:
    """Every tensor of `weights` (plain, LowRank or None)."""
    return [t for w in weights if w is not None for t in ((w.w, w.a, w.b) if isinstance(w, LowRank) else (w,))]


def _adapter_input(x: torch.Tensor, w: LowRank) -> torch.Tensor:
    return F.dropout(x, w.dropout) if w.dropout > 0 else x


def _grouped(x: torch.Tensor, w, offs: torch.Tensor, mm=None) -> torch.Tensor:
    """x [N, in] sorted by expert -> [N, out], each expert's rows through its weight (grouped GEMMs). `mm(x, w_t,
    offs)` replaces torch._grouped_mm for the base weight (GroupedExperts.grouped_mm); LoRA's adapters keep it."""
    w_t = _base(w).transpose(-2, -1)  # [E, in, out], column-major per expert (the float8 GEMM requires it)
    out = torch._grouped_mm(x, w_t, offs=offs) if mm is None else mm(x, w_t, offs)
    if isinstance(w, LowRank):
        low = torch._grouped_mm(_adapter_input(x, w), w.a.transpose(-2, -1), offs=offs)
        out = out + torch._grouped_mm(low, w.b.transpose(-2, -1), offs=offs) * w.scale
    return out


def _linear(x: torch.Tensor, w, i: int) -> torch.Tensor:
    """x [n, in] -> [n, out] through expert i's weight."""
    out = F.linear(x, _base(w)[i])
    if isinstance(w, LowRank):
        out = out + F.linear(F.linear(_adapter_input(x, w), w.a[i]), w.b[i]) * w.scale
    return out


def swiglu_grouped_mm(x, w1, w2, w3, num_tokens_per_expert, mm=None):
    """x [N, dim] sorted by expert -> [N, dim] with torch._grouped_mm (or `mm`, see _grouped); offsets are the
    cumulative row counts (int32). Rows past sum(num_tokens_per_expert) are padding: their outputs and input gradients
    are unspecified. w3 None: the squared-ReLU experts, w2(relu(w1 x)^2). Weights may be LowRank."""
    offs = torch.cumsum(num_tokens_per_expert, dim=0, dtype=torch.int32)
    h = _grouped(x, w1, offs, mm)
    h = F.relu(h).square() if w3 is None else F.silu(h) * _grouped(x, w3, offs, mm)
    return _grouped(h, w2, offs, mm)


def _expert_mlp(x, w1, w2, w3, i: int):
    """Expert i on its rows: SwiGLU, or squared ReLU when w3 is None."""
    h = _linear(x, w1, i)
    return _linear(F.relu(h).square() if w3 is None else F.silu(h) * _linear(x, w3, i), w2, i)


def swiglu_expert_loop(x, w1, w2, w3, num_tokens_per_expert):
    """The fallback: each expert's MLP on its own rows (padding rows come back 0); w3 None: squared ReLU. Weights
    may be LowRank.

    Eager: slices by the row counts, which are read on the host (.tolist(), a sync on CUDA). Under torch.compile
    (fullgraph, as parallelize/compile.py uses it) data-dependent slicing would break the graph, so there each expert
    runs on every row and a mask keeps its own: E times the FLOPs, no sync; meant for CPU tests, not speed."""
    n, e, out_dim = x.shape[0], _base(w1).shape[0], _base(w2).shape[1]
    if torch.compiler.is_compiling():
        ends = torch.cumsum(num_tokens_per_expert, dim=0)
        row_expert = torch.searchsorted(ends, torch.arange(n, device=x.device), right=True)  # E for padding rows
        out = x.new_zeros(n, out_dim)
        for i in range(e):
            y = _expert_mlp(x, w1, w2, w3, i)
            out = out + torch.where((row_expert == i).unsqueeze(-1), y, 0)
        return out
    sizes = host_sizes(num_tokens_per_expert)
    outs, start = [], 0
    for i, size in enumerate(sizes):
        outs.append(_expert_mlp(x[start:start + size], w1, w2, w3, i))
        start += size
    if start < n:
        outs.append(x.new_zeros(n - start, out_dim))
    return torch.cat(outs)


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; the gradient times `scale` in backward."""

    @staticmethod
    def forward(ctx, w: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return w.view_as(w)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.scale, None


class GroupedExperts(nn.Module):
    """num_experts experts stored as 3-D weights, run as grouped GEMMs on rows sorted by expert: SwiGLU
    (act="swiglu") or squared ReLU without a gate (act="relu2": no w3, which is then None).

    w1, w3: [E, hidden, dim]; w2: [E, dim, hidden] (each expert's slice is an nn.Linear weight, so HF adapters can
    stack/unstack them). forward(x [N, dim], num_tokens_per_expert [E_local] int) -> [N, dim]: the first
    num_tokens_per_expert[0] rows go through local expert 0, and so on. Rows past the total are padding (capacity
    mode puts its dropped assignments there): callers discard their outputs and must not rely on their gradients.
    """

    def __init__(self, num_experts: int, dim: int, hidden_dim: int, act: str = "swiglu"):
        super().__init__()
        if act not in EXPERT_ACTS:  # moe_problems says it first, naming the key
            raise ValueError(f"GroupedExperts: act={act!r} is unknown; use one of {list(EXPERT_ACTS)}")
        self.num_experts = num_experts
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        if act == "swiglu":
            self.w3 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        else:
            self.register_parameter("w3", None)
        # Multiplies the weights' gradient: expert parallelism sets it where no FSDP reduction divides the expert
        # gradients (parallelize/ep.py). An attribute, not a tensor hook, so it survives to_empty/materialisation.
        self.grad_scale = 1.0

    # LoRA on the routed experts (models/common/lora.py's add_expert_adapters) adds the children `lora_A` and `lora_B`,
    # ParameterDicts {weight name: [E, r, in] / [E, out, r]}, and sets lora_scaling and lora_dropout; each adapted
    # weight then enters the expert functions as a LowRank. adapters_enabled is False inside lora.adapters_disabled.
    lora_scaling, lora_dropout, adapters_enabled = 1.0, 0.0, True
    # Set per instance by a numeric-format converter (float8/experts.py, float8.moe_experts): `grouped_mm(x [M, in],
    # w_t [E, in, out], offs int32) -> [M, out]` replaces torch._grouped_mm for the three base GEMMs, and every
    # expert's rows are padded with zero rows to a multiple of `group_align` around them (models/common/moe_align.py:
    # no host sync, static shapes). Attributes, not imports: models/ stays free of torchao. Only on the grouped-GEMM
    # path (bf16, CUDA capability >= 9.0); the loop fallback ignores them.
    grouped_mm: Callable | None = None
    group_align: int = 1

    def forward(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        # Under autocast nothing casts for torch._grouped_mm, so cast here as autocast would for a Linear. Without
        # it, fp32 weights meeting 16-bit tokens (experts that no mixed-precision wrapper casts, e.g. expert parallel
        # without replicas) compute in the tokens' dtype, as the wrapper would have.
        w_dtype = _local(self.w1).dtype
        if torch.is_autocast_enabled(x.device.type):
            dtype = torch.get_autocast_dtype(x.device.type)
        elif x.dtype in (torch.bfloat16, torch.float16) and w_dtype == torch.float32:
            dtype = x.dtype
        else:
            dtype = w_dtype
        x = x.to(dtype)
        w1, w2, w3 = (self._weight(name, dtype) for name in ("w1", "w2", "w3"))
        ranks = [w.a.shape[1] for w in (w1, w2, w3) if isinstance(w, LowRank)]
        if _use_grouped_mm(x, _base(w1).shape[2], _base(w1).shape[1], *ranks):
            if x.shape[0] == 0:
                # Nothing routed here (possible under EP): the weight-gradient grouped GEMM would have a zero-length
                # contraction, which it rejects; keep the weights in the graph (zero gradients) for the collectives.
                return x.new_zeros(0, _base(w2).shape[1]) + 0 * sum(t.sum() for t in _tensors(w1, w2, w3))
            if self.group_align > 1:
                xp, counts, dest = pad_groups(x, num_tokens_per_expert, self.group_align)
                return unpad_groups(swiglu_grouped_mm(xp, w1, w2, w3, counts, self.grouped_mm), dest)
            return swiglu_grouped_mm(x.contiguous(), w1, w2, w3, num_tokens_per_expert, self.grouped_mm)
        return swiglu_expert_loop(x, w1, w2, w3, num_tokens_per_expert)

    def _weight(self, name: str, dtype: torch.dtype):
        """Weight `name` as the expert functions take it: local (EP), its gradient scaled, cast to `dtype`; a LowRank
        with its adapters when it has some (and they are enabled); None for a missing w3."""
        def prepared(w: torch.Tensor) -> torch.Tensor:
            w = _local(w)
            if self.grad_scale != 1.0:
                w = _ScaleGrad.apply(w, self.grad_scale)
            return w.to(dtype)

        w = getattr(self, name)
        if w is None:
            return None
        adapters = self._modules.get("lora_A")
        if adapters is None or name not in adapters or not self.adapters_enabled:
            return prepared(w)
        return LowRank(prepared(w), prepared(adapters[name]), prepared(self.lora_B[name]), self.lora_scaling,
                       self.lora_dropout if self.training else 0.0)

    def init_weights(self, init_std: float) -> None:
        # As models/common/ffn.py: w1/w3 read the residual stream; w2 writes into it and gets the depth-scaled std.
        for w in (self.w1, self.w3):
            if w is not None:
                nn.init.trunc_normal_(w, mean=0.0, std=0.02, a=-3 * 0.02, b=3 * 0.02)
        nn.init.trunc_normal_(self.w2, mean=0.0, std=init_std, a=-3 * init_std, b=3 * init_std)


class MoE(nn.Module):
    """Routed experts (top_k of num_experts per token) plus optional shared experts; see the module docstring."""

    def __init__(self, dim: int, args: MoEArgs):
        super().__init__()
        self.args = args
        self.num_experts = args.num_experts
        self.top_k = args.top_k
        self.router = Router(dim, args)
        latent = args.latent_dim
        # NemotronH's fc1_latent_proj / fc2_latent_proj: the routed experts' width is latent_dim.
        self.latent_in = nn.Linear(dim, latent, bias=False) if latent > 0 else None
        self.latent_out = nn.Linear(latent, dim, bias=False) if latent > 0 else None
        self.experts = GroupedExperts(args.num_experts, latent or dim, args.hidden_dim, act=args.expert_act)
        shared_hidden = args.shared_hidden_dim or args.num_shared_experts * args.hidden_dim
        shared_cls = ReLU2FeedForward if args.expert_act == "relu2" else FeedForward
        self.shared_experts = shared_cls(dim, shared_hidden) if args.num_shared_experts > 0 else None
        # Persistent: the bias is model state (it changes which experts serve a token), so checkpoints carry it.
        self.register_buffer("expert_bias", torch.zeros(args.num_experts, dtype=torch.float32), persistent=True)
        # Assignments per expert since the last bias update (training-mode forwards only, so validation passes do not
        # steer the bias). Under activation checkpointing a recomputed forward counts again: every expert's count
        # doubles alike, which leaves update_expert_bias's sign(mean - count) unchanged.
        self.register_buffer("tokens_per_expert", torch.zeros(args.num_experts, dtype=torch.float32), persistent=False)
        # Assignments dropped by the capacity factor over the same forwards (for the dropped share in the metrics).
        self.register_buffer("dropped_assignments", torch.zeros((), dtype=torch.float32), persistent=False)
        self.aux_grad_scale = 1.0  # set by the trainer: weight of this micro-batch's aux loss in the gradient
        # Set by context parallelism (parallelize/cp.py): the mean of a statistic over the ranks holding the other
        # equal shares of this rank's sequences. The balance losses' expert loads f are statistics of whole sequences
        # (of the whole local batch for the Switch loss), so each rank takes the mean of its shares' loads and keeps
        # its own probabilities P; the losses E * sum(f * P_local), averaged over those ranks by the data-parallel
        # gradient mean, are then the loss of the whole sequences, value and gradient (the z-loss, a mean over
        # tokens, needs nothing: the mean of equal shares' means). None: whole sequences here.
        self.shard_mean: Callable[[torch.Tensor], torch.Tensor] | None = None
        self.last_aux_loss = torch.zeros(())
        self.last_dropped = torch.zeros((), dtype=torch.int64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, dim = x.shape
        xf = x.reshape(-1, dim)
        t, k = xf.shape[0], self.top_k
        indices, weights, scores, logits = self.router(xf, self.expert_bias)
        counts = expert_counts(indices, self.num_experts)  # the router's demand, before any capacity drop
        if self.training:
            with torch.no_grad():
                self.tokens_per_expert.add_(counts)

        flat_expert = indices.reshape(-1)
        keep = None
        if self.args.capacity_factor > 0:
            score = scores.detach().gather(-1, indices).reshape(-1)
            order, keep, kept_counts, dropped = self._capacity_order(flat_expert, score, counts, t)
        else:
            order = torch.argsort(flat_expert, stable=True)
            kept_counts, dropped = counts.to(torch.int64), torch.zeros((), dtype=torch.int64, device=x.device)
        xr = self.latent_in(xf) if self.latent_in is not None else xf
        routed = xr.index_select(0, order // k)
        if keep is not None:
            routed = torch.where(keep.unsqueeze(-1), routed, 0)  # zero gradient for the dropped rows
        out = self.experts(routed, kept_counts)
        if keep is not None:
            out = torch.where(keep.unsqueeze(-1), out, 0)  # dropped rows are padding: unspecified values
        # Back to (token, choice) order, then the weighted sum over the k choices as one batched matmul.
        inverse = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
        out = out.index_select(0, inverse).view(t, k, -1)
        y = torch.bmm(weights.to(out.dtype).unsqueeze(1), out).squeeze(1)
        if self.latent_out is not None:
            y = self.latent_out(y)
        if self.shared_experts is not None:
            y = y + self.shared_experts(xf)
        y = y.view(b, s, -1)

        aux = self._aux_loss(indices.view(b, s, k), scores, logits)
        self.last_dropped = dropped
        if self.training:
            with torch.no_grad():
                self.dropped_assignments.add_(dropped)
        self.last_aux_loss = aux.detach() if aux is not None else torch.zeros((), device=x.device)
        if aux is not None and aux.requires_grad:
            y = AuxLossGrad.apply(y, aux, self.aux_grad_scale)
        return y

    def _capacity_order(self, flat_expert, score, counts, t):
        """Sort order with each expert's kept assignments first, grouped by expert; the dropped ones at the end.

        Within an expert the assignments are ranked by the router's unbiased score, highest first (the expert bias is
        constant per expert, so biased scores rank alike; the routing weights would not, once renormalised per
        token); ties keep the earlier token. No host sync: capacity depends only on shapes, and the drop decision is
        made on the device."""
        e, k = self.num_experts, self.top_k
        capacity = math.ceil(self.args.capacity_factor * t * k / e)
        by_score = torch.argsort(score, descending=True, stable=True)
        order = by_score[torch.argsort(flat_expert[by_score], stable=True)]  # by expert, then score, then position
        counts = counts.to(torch.int64)
        starts = torch.cumsum(counts, 0) - counts
        sorted_expert = flat_expert[order]
        position = torch.arange(order.numel(), device=order.device) - starts[sorted_expert]
        keep = position < capacity
        # Dropped rows go last: sort key E puts them after every expert's group; stable keeps the rest in place.
        tail = torch.argsort(torch.where(keep, sorted_expert, e), stable=True)
        kept_counts = counts.clamp(max=capacity)
        return order[tail], keep[tail], kept_counts, counts.sum() - kept_counts.sum()

    def _aux_loss(self, indices: torch.Tensor, scores: torch.Tensor, logits: torch.Tensor) -> torch.Tensor | None:
        """coeff-weighted sum of the enabled balance losses (None when all coefficients are 0)."""
        a = self.args
        if a.aux_loss_coeff <= 0 and a.seq_aux_loss_coeff <= 0 and a.z_loss_coeff <= 0:
            return None
        b, s, k = indices.shape
        total = logits.new_zeros(())
        probs = routing_probs(scores, a.score_func)
        if a.aux_loss_coeff > 0:
            total = total + a.aux_loss_coeff * load_balance_loss(probs, indices.view(b * s, k), self.num_experts,
                                                                 self.shard_mean)
        if a.seq_aux_loss_coeff > 0:
            total = total + a.seq_aux_loss_coeff * seq_balance_loss(probs.view(b, s, -1), indices, self.num_experts,
                                                                    self.shard_mean)
        if a.z_loss_coeff > 0:
            total = total + a.z_loss_coeff * router_z_loss(logits)
        return total

    def init_weights(self, init_std: float) -> None:
        """Every parameter and buffer (also after to_empty from the meta device)."""
        self.router.init_weights(init_std)
        self.experts.init_weights(init_std)
        if self.shared_experts is not None:
            self.shared_experts.init_weights(init_std)
        if self.latent_in is not None:  # reads the residual stream; latent_out writes into it (depth-scaled)
            nn.init.trunc_normal_(self.latent_in.weight, mean=0.0, std=0.02, a=-3 * 0.02, b=3 * 0.02)
            nn.init.trunc_normal_(self.latent_out.weight, mean=0.0, std=init_std, a=-3 * init_std, b=3 * init_std)
        with torch.no_grad():
            self.expert_bias.zero_()
            self.tokens_per_expert.zero_()
            self.dropped_assignments.zero_()
        # Plain attributes that to_empty does not move: on the buffers' device, so metrics can read them before the
        # first forward.
        self.last_aux_loss = torch.zeros((), device=self.expert_bias.device)
        self.last_dropped = torch.zeros((), dtype=torch.int64, device=self.expert_bias.device)


@torch.no_grad()
def update_expert_bias(moe: MoE, global_tokens_per_expert: torch.Tensor) -> None:
    """Auxiliary-loss-free balancing (DeepSeek-V3), once per optimizer step: bias += rate * sign(mean - count), so
    overloaded experts become less likely to be chosen and idle ones more. The caller all-reduces the counts over the
    data/expert-parallel ranks first and zeroes moe.tokens_per_expert after."""
    rate = moe.args.bias_update_rate
    if rate <= 0:
        return
    counts = global_tokens_per_expert.to(device=moe.expert_bias.device, dtype=torch.float32)
    moe.expert_bias.add_(torch.sign(counts.mean() - counts), alpha=rate)
