"""FlashAttention-4's Hopper/Blackwell kernels (the `flash-attn-4` package, CuTe DSL: `pip install 'titanlike[fa4]'`)
as the model's attention (model.attn_backend = "fa4", or "auto" on a Hopper+ GPU where the package imports).

Why: at head dim 64 (Llama-3.2-1B) cuDNN's SDPA reaches ~350 TFLOP/s forward + backward on the H100 and FA4's SM90
kernels ~415 (docs/benchmarks.md, attention kernels, 2026-11-23, H100). The kernels read grouped KV heads as they are
and take the [B, S, H, D] layout the projections produce, so nothing is transposed or repeated.

FA4 launches JIT-compiled kernels from Python, which torch.compile cannot trace: forward and backward are wrapped as
custom ops (opaque nodes with fake implementations for tracing), and autograd connects them.
"""
from __future__ import annotations

import torch

HEAD_DIMS = (64, 96, 128)  # what this wrapper hands to FA4; other head dims stay on SDPA


def fa4_unavailable(device: torch.device) -> str | None:
    """Why FA4 cannot run here (None: it can). Imports the package (its first import takes ~10 s)."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device)[0] < 9:
        return "FA4's kernels need a Hopper (sm90) or newer GPU"
    try:
        from flash_attn.cute import interface  # noqa: F401
    except Exception as e:  # noqa: BLE001  (ImportError, or a CUDA/cutlass-dsl mismatch inside it)
        return f"flash-attn-4 does not import ({type(e).__name__}: {e}); pip install 'titanlike[fa4]'"
    return None


@torch.library.custom_op("titanlike::fa4_fwd", mutates_args=(), device_types="cuda")
def _fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    from flash_attn.cute.interface import _flash_attn_fwd

    out, lse = _flash_attn_fwd(q, k, v, causal=causal, return_lse=True)[:2]
    return out, lse


@_fwd.register_fake
def _(q, k, v, causal):
    b, s, h, _ = q.shape
    return torch.empty_like(q), q.new_empty((b, h, s), dtype=torch.float32)


@torch.library.custom_op("titanlike::fa4_bwd", mutates_args=(), device_types="cuda")
def _bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
         lse: torch.Tensor, causal: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    from flash_attn.cute.interface import _flash_attn_bwd

    dq, dk, dv = _flash_attn_bwd(q, k, v, out, dout, lse, causal=causal)[:3]
    return dq, dk, dv


@_bwd.register_fake
def _(dout, q, k, v, out, lse, causal):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, ctx.causal = inputs
    ctx.save_for_backward(q, k, v, *output)


def _backward(ctx, dout, dlse):
    q, k, v, out, lse = ctx.saved_tensors
    return *_bwd(dout.contiguous(), q, k, v, out, lse, ctx.causal), None


_fwd.register_autograd(_backward, setup_context=_setup_context)


def fa4_forward_op():
    """The forward op (for per-op activation checkpointing's list of outputs to keep)."""
    return torch.ops.titanlike.fa4_fwd.default


def _fa4_takes(q: torch.Tensor) -> bool:
    return q.shape[-1] in HEAD_DIMS and q.dtype in (torch.bfloat16, torch.float16)


def fa4_causal_attention(xq: torch.Tensor, xk: torch.Tensor, xv: torch.Tensor,
                         repeat_kv_heads: bool = False, mask=None) -> torch.Tensor:
    """models.common.causal_attention's contract ([B, S, H, D] q, [B, S, Hkv, D] k/v -> [B, S, H, D]) on FA4.
    Grouped KV heads are read as they are (repeat_kv_heads is moot); a head dim or dtype FA4 is not given here, or a
    mask (documents, context parallel), goes to SDPA."""
    if mask is not None or not _fa4_takes(xq):
        from models.common.attention import causal_attention

        return causal_attention(xq, xk, xv, repeat_kv_heads, mask)
    return _fwd(xq.contiguous(), xk.contiguous(), xv.contiguous(), True)[0]


def fa4_bidirectional_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask=None) -> torch.Tensor:
    """models.common.encoder.bidirectional_attention's contract ([B, S, H, D] q, [B, Skv, H, D] k/v -> [B, S, H, D])
    on FA4, not causal (BERT, ViT and the vision towers). A padding mask, queries over other tokens (SigLIP's pooling
    probe), or a head dim or dtype FA4 is not given here, go to SDPA."""
    if mask is not None or q.shape[1] != k.shape[1] or not _fa4_takes(q):
        from models.common.encoder import bidirectional_attention

        return bidirectional_attention(q, k, v, mask)
    return _fwd(q.contiguous(), k.contiguous(), v.contiguous(), False)[0]


def use_fa4(model: torch.nn.Module, encoders: bool = True) -> int:
    """Point every attention module's kernel at FA4 (a causal one's `attention_fn`; with `encoders`, a bidirectional
    one's `bidirectional_fn` too); returns how many. model.attn_backend = "auto" leaves the encoders on cuDNN's SDPA:
    FA4's non-causal kernels have not yet run on a GPU here (tests/gpu/test_gpu_fa4.py checks them against cuDNN)."""
    kinds = [("attention_fn", fa4_causal_attention)]
    if encoders:
        kinds.append(("bidirectional_fn", fa4_bidirectional_attention))
    n = 0
    for module in model.modules():
        for attr, fn in kinds:
            if hasattr(module, attr):
                setattr(module, attr, fn)
                n += 1
    return n
