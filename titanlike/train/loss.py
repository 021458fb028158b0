"""Chunked (fused) output projection + cross-entropy: the [tokens, vocab] logits are never materialised in full.

With a 128k vocabulary the logits of one micro-batch (8k tokens) take 2 GiB in bf16, 4 GiB more as the fp32 copy the
loss upcasts to, and cross-entropy keeps a [tokens, vocab] fp32 tensor for its backward. Here the LM head and the
loss run together, `chunk_tokens` rows at a time, and the gradients are computed in the same pass:

    for each chunk c:  logits_c = h_c @ W^T                      (one chunk of logits alive at a time)
                       loss    += sum(logsumexp(logits_c) - logits_c[label])
                       dlogits  = softmax(logits_c) - onehot(label)
                       grad_h_c = dlogits @ W ;  grad_W += dlogits^T @ h_c

The backward only scales the saved grad_h / grad_W by the incoming scalar gradient, so no matmul is recomputed: the
three GEMMs are exactly those of the plain path. What stays alive from forward to backward is grad_h (the size of
h) and grad_W (the size of W), instead of the full logits and their fp32 softmax.

Wiring: `apply_chunked_loss(model, chunk_tokens)` swaps `model.output` (an nn.Linear) for `ChunkedLossLinear`, a
subclass sharing the same `weight` parameter (FQN `output.weight` unchanged, so checkpoints and plans don't notice).
Inside `with loss_targets(model.output, labels):` its forward returns the summed loss instead of logits, so the
model's forward returns the loss; outside it, it is a plain Linear. The weight is used inside the module's own
forward, where FSDP2 has all-gathered it, exactly as for a plain Linear.
"""
from __future__ import annotations

import contextlib
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from models.batch import IGNORE_INDEX


def chunk_loss_and_grad(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int, need_grad: bool):
    """Summed CE of one chunk (fp32 math) and d(loss)/d(logits) (None when not needed)."""
    logits = logits.float()
    lse = torch.logsumexp(logits, dim=-1)
    valid = labels != ignore_index
    safe = torch.where(valid, labels, 0).unsqueeze(1)  # ignored rows read column 0, then get weight 0
    loss = ((lse - logits.gather(1, safe).squeeze(1)) * valid).sum()
    if not need_grad:
        return loss, None
    grad = torch.exp(logits - lse.unsqueeze(1))
    grad.scatter_add_(1, safe, -valid.unsqueeze(1).to(grad.dtype))
    return loss, grad * valid.unsqueeze(1)


class _ChunkedLinearCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, labels, chunk_tokens: int, ignore_index: int, need_grad: bool, chunk_fn):
        n = h.shape[0]
        loss = torch.zeros((), device=h.device, dtype=torch.float32)
        grad_h = torch.empty_like(h) if need_grad else None
        # fp32 accumulator across chunks; stored in the weight's dtype (what autograd would produce) afterwards.
        grad_w = torch.zeros(weight.shape, device=weight.device, dtype=torch.float32) if need_grad else None
        for start in range(0, n, chunk_tokens):
            hc = h[start:start + chunk_tokens]
            loss_c, dlogits = chunk_fn(hc @ weight.t(), labels[start:start + chunk_tokens], ignore_index, need_grad)
            loss += loss_c
            if need_grad:
                dlogits = dlogits.to(h.dtype)
                torch.mm(dlogits, weight, out=grad_h[start:start + chunk_tokens])
                grad_w += dlogits.t() @ hc
        if need_grad:
            ctx.save_for_backward(grad_h, grad_w.to(weight.dtype))
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        grad_h, grad_w = ctx.saved_tensors
        g = grad_loss.to(grad_h.dtype)
        return grad_h * g, grad_w * grad_loss.to(grad_w.dtype), None, None, None, None, None


def chunked_linear_cross_entropy(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk_tokens: int,
                                 ignore_index: int = IGNORE_INDEX, chunk_fn=chunk_loss_and_grad) -> torch.Tensor:
    """sum over tokens of cross_entropy(h @ weight.T, labels) (fp32 scalar), `chunk_tokens` rows at a time.

    h [..., D] and labels [...] are flattened; weight [V, D]. Under autocast, h and weight are cast to the autocast
    dtype first, as nn.Linear would be.
    """
    h, labels = h.reshape(-1, h.shape[-1]), labels.reshape(-1)
    if h.shape[0] != labels.shape[0]:
        raise ValueError(f"chunked loss: {h.shape[0]} hidden rows but {labels.shape[0]} labels")
    device_type = h.device.type
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        h, weight = h.to(dtype), weight.to(dtype)
    need_grad = torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad)
    with torch.autocast(device_type, enabled=False):
        return _ChunkedLinearCE.apply(h, weight, labels, chunk_tokens, ignore_index, need_grad, chunk_fn)


class ChunkedLossLinear(nn.Linear):
    """The LM head: a plain Linear, except inside `loss_targets(...)`, where forward returns the summed loss."""

    chunk_tokens: int = 4096
    chunk_fn = staticmethod(chunk_loss_and_grad)
    _labels: torch.Tensor | None = None

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self._labels is None:
            return super().forward(h)
        if self.bias is not None:
            raise ValueError("training.loss_chunk_tokens: the output layer has a bias, which the chunked loss "
                             "does not handle; set training.loss_chunk_tokens=0")
        return chunked_linear_cross_entropy(h, self.weight, self._labels, self.chunk_tokens, chunk_fn=self.chunk_fn)


@contextlib.contextmanager
def loss_targets(head: ChunkedLossLinear, labels: torch.Tensor):
    """Within the block, `head`'s forward (and so the model's) returns the summed loss against `labels`."""
    head._labels = labels
    try:
        yield
    finally:
        head._labels = None


def apply_chunked_loss(model: nn.Module, chunk_tokens: int, compile_chunk: bool = False,
                       head_name: str = "output") -> ChunkedLossLinear:
    """Swap the output projection `model.<head_name>` for a ChunkedLossLinear sharing its parameters (in place, meta
    or not); returns it. The trainer passes the last of the ModelSpec's output_modules.

    compile_chunk: torch.compile the per-chunk softmax/gradient math (fuses ~6 passes over the chunk's logits into
    ~2; worth it on GPUs, and done when compile.components has "loss")."""
    old = getattr(model, head_name, None)
    if type(old) is not nn.Linear:
        raise ValueError(f"training.loss_chunk_tokens={chunk_tokens}: model.{head_name} must be a plain nn.Linear, "
                         f"got {type(old).__name__} (a float8 output layer: keep '{head_name}' in float8.filter_fqns)")
    if chunk_tokens < 1:
        raise ValueError(f"training.loss_chunk_tokens={chunk_tokens} must be >= 1 here")
    with torch.device(old.weight.device):
        new = ChunkedLossLinear(old.in_features, old.out_features, bias=old.bias is not None)
    new.weight = old.weight
    if old.bias is not None:
        new.bias = old.bias
    new.chunk_tokens = chunk_tokens
    if compile_chunk:
        new.chunk_fn = torch.compile(chunk_loss_and_grad, dynamic=False)
    setattr(model, head_name, new)
    return new


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed cross-entropy in fp32 of logits [..., C] against labels [...] (per token [B, S, V] / [B, S], or per
    sequence [B, C] / [B]); the caller divides by the global count of targets."""
    flat = logits.flatten(0, 1) if logits.ndim == 3 else logits.reshape(-1, logits.shape[-1])
    return F.cross_entropy(flat.float(), labels.flatten(), reduction="sum", ignore_index=IGNORE_INDEX)


LOSSES = {"cross_entropy": cross_entropy_sum}  # an Objective's `loss` -> fn(output, labels) -> summed loss


def objective_loss(objective) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The summed loss an objective (models/batch.py) names, or its own function (a family's objective: BERT's MLM +
    sentence-order loss, models/bert/objective.py); ValueError naming the choices."""
    if callable(objective.loss):
        return objective.loss
    if objective.loss not in LOSSES:
        raise ValueError(f"objective {type(objective).__name__}: loss {objective.loss!r} unknown; choose one of "
                         f"{sorted(LOSSES)} (titanlike/train/loss.py)")
    return LOSSES[objective.loss]


def plain_loss(loss: torch.Tensor) -> torch.Tensor:
    """The loss as a plain tensor: under loss parallel it is a replicated DTensor (differentiable to_local)."""
    return loss.full_tensor() if isinstance(loss, DTensor) else loss
