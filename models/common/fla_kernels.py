"""flash-linear-attention's Triton kernels (the `fla-core` package, pure Triton: `pip install 'titanlike[fla]'`) as the
recurrent mixers' scans on a GPU (model.mixer_kernel = "fla", or "auto" on a CUDA GPU where the package imports).

Mamba-2's SSD is fla's `simple_gla` (one scalar decay per head and step) with q = C, k = B, v = x * dt, g = A * dt and
scale 1 (models/common/ssd.py says why); the gated delta rule is fla's `chunk_gated_delta_rule` with its in-kernel
q/k L2 norm. What surrounds the kernels (dt's bias, softplus and clamp, the D skip, B and C repeated to the heads)
stays in PyTorch, where Inductor fuses it into the block's graph.

fla's entry points are autograd Functions behind `torch.compiler.disable`: calling them would cut each block's compiled
graph in pieces. Their forward and backward are wrapped here as two custom ops each (opaque nodes with fake
implementations for tracing) that call fla's own Function.forward / Function.backward with a stand-in ctx, and
autograd connects the pair; so the block compiles whole. The stand-in follows what those methods save and read in
fla-core 0.6 (the extra pins `fla-core>=0.6,<0.7`). Documents (`seq_idx`) become fla's `cu_seqlens` over the rows
laid end to end, inside the ops: a host sync, with document masking only, once per step (`_Varlen` keeps them for
every layer).

A carried or returned state (generation's prefill and decode) stays on the PyTorch scans.

Hopper with Triton 3.4 to 3.7.0 (torch 2.8 to 2.12.0 pin these): fla-core refuses its gated backward kernel there
(`chunk_bwd_dqkwg`, fla issue 640: Triton miscompiles it), and so does titanlike: every mixer keeps the PyTorch scan
there, with the reason in the log (`kernel_refuses`; model.mixer_kernel = "fla" is refused in one line). titanlike
once lifted the refusal for key sizes above 64, on the issue's report that a key block of 128 compiles correctly;
on an H100 with Triton 3.6 the lifted kernel gave Mamba-2's bf16 gradients far from the PyTorch scan's (dt_bias off
by 3x its largest entry) while the same wrappers under Triton's interpreter on CPU equal fla's own autograd bit for
bit and the PyTorch scan to bf16 rounding (docs/hybrid.md). Triton 3.7.1 and later take the kernels again.
"""
from __future__ import annotations

import math
import types

import torch

from models.common.delta_rule import chunk_gated_delta_rule
from models.common.ssd import _discretize, ssd_chunk_scan

CHUNK = 64  # fla's chunk length for both kernels (a choice inside the kernel: the result does not depend on it)
MAX_HEAD_DIM = 256  # the largest key/value (state, head) size the kernels are given; larger stays on PyTorch


def fla_unavailable(device: torch.device) -> str | None:
    """Why fla's kernels cannot run here (None: they can)."""
    if device.type != "cuda":
        return "fla's Triton kernels need a CUDA GPU"
    try:
        from fla.ops.gated_delta_rule.chunk import ChunkGatedDeltaRuleFunction  # noqa: F401
        from fla.ops.simple_gla.chunk import ChunkSimpleGLAFunction  # noqa: F401
    except Exception as e:  # noqa: BLE001  (ImportError, or a Triton/torch mismatch inside it)
        return f"fla-core does not import ({type(e).__name__}: {e}); pip install 'titanlike[fla]'"
    return None


def _hopper_miscompiles() -> bool:
    """Whether this GPU and Triton are the pair fla issue 640 is about (Hopper, Triton >= 3.4 and < 3.7.1)."""
    import triton

    version = tuple(int(p) for p in triton.__version__.split("+")[0].split(".")[:3])
    return torch.cuda.get_device_capability()[0] == 9 and (3, 4, 0) <= version < (3, 7, 1)


class _Ctx(types.SimpleNamespace):
    """What fla's Function.forward / backward use of autograd's ctx."""

    def save_for_backward(self, *tensors):
        self.saved_tensors = tensors


def _backward_ctx(**attrs) -> _Ctx:
    # torch.amp.custom_bwd (fla's autocast_custom_bwd) re-enters the forward's autocast state: none inside an op.
    return _Ctx(_fwd_used_autocast=False, _dtype=torch.get_autocast_dtype("cuda"), **attrs)


def cu_seqlens(seq_idx: torch.Tensor) -> torch.Tensor:
    """Per-token document indices [B, T] (non-decreasing along a row) -> the start offsets of every document of the
    rows laid end to end, and the total length: [docs + 1] int64 (fla's and FlashAttention's varlen form)."""
    b, t = seq_idx.shape
    starts = torch.ones(b, t, dtype=torch.bool, device=seq_idx.device)
    starts[:, 1:] = seq_idx[:, 1:] != seq_idx[:, :-1]  # column 0: every row starts a document
    offsets = starts.reshape(-1).nonzero().squeeze(1)
    return torch.cat([offsets, offsets.new_tensor([b * t])])


class _Varlen:
    """The document offsets of the step's doc_ids, computed once for all mixer layers, forward and backward: each
    computation reads a count back to the host (nonzero), so per layer it would be 2 x layers syncs a step. One
    entry, keyed on the tensor's storage, strides and version counter, and it holds that tensor, so its memory cannot
    be reused by another batch while the key stands."""

    def __init__(self):
        self.held, self.key, self.cu, self.chunks = None, None, None, None

    def offsets(self, seq_idx: torch.Tensor) -> torch.Tensor:
        key = (seq_idx.data_ptr(), tuple(seq_idx.shape), seq_idx.stride(), seq_idx._version, seq_idx.device)
        if key != self.key:
            self.held, self.key, self.cu, self.chunks = seq_idx, key, cu_seqlens(seq_idx), None
        return self.cu

    def chunk_indices(self, cu):
        """fla's per-chunk (document, chunk) table of `cu` (another host sync), kept beside it."""
        if cu is None:
            return None
        from fla.ops.utils.index import prepare_chunk_indices

        if cu is not self.cu:
            return prepare_chunk_indices(cu, CHUNK)
        if self.chunks is None:
            self.chunks = prepare_chunk_indices(cu, CHUNK)
        return self.chunks


_VARLEN = _Varlen()


def _flat(seq_idx, *tensors):
    """[B, T, ...] tensors as one row [1, B*T, ...] with cu_seqlens, when there are documents."""
    if seq_idx is None:
        return tensors, None
    return tuple(x.reshape(1, -1, *x.shape[2:]) for x in tensors), _VARLEN.offsets(seq_idx)


def _chunk_indices(cu):
    return _VARLEN.chunk_indices(cu)


# Mamba-2's SSD: fla's simple_gla.

@torch.library.custom_op("titanlike::fla_ssd_fwd", mutates_args=(), device_types="cuda")
def _ssd_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
             seq_idx: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    from fla.ops.simple_gla.chunk import ChunkSimpleGLAFunction

    (fq, fk, fv, fg), cu = _flat(seq_idx, q, k, v, g)
    ctx = _Ctx()
    o, _ = ChunkSimpleGLAFunction.forward(ctx, fq, fk, fv, fg, None, 1.0, None, False, False, cu, None, CHUNK)
    return o.view(v.shape), ctx.saved_tensors[3].view(g.shape)  # y, and g summed within chunks (for backward)


@_ssd_fwd.register_fake
def _(q, k, v, g, seq_idx):
    return torch.empty_like(v, dtype=q.dtype), torch.empty_like(g, dtype=torch.float32)


@torch.library.custom_op("titanlike::fla_ssd_bwd", mutates_args=(), device_types="cuda")
def _ssd_bwd(dy: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g_cum: torch.Tensor,
             seq_idx: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    from fla.ops.simple_gla.chunk import ChunkSimpleGLAFunction

    (fdy, fq, fk, fv, fg), cu = _flat(seq_idx, dy, q, k, v, g_cum)
    ctx = _backward_ctx(saved_tensors=(fq, fk, fv, fg, None, None, _chunk_indices(cu)), chunk_size=CHUNK,
                        scale=1.0, cu_seqlens=cu, state_v_first=False)
    dq, dk, dv, dg = ChunkSimpleGLAFunction.backward(ctx, fdy, None)[:4]
    return dq.view(q.shape), dk.view(k.shape), dv.view(v.shape), dg.view(g_cum.shape)


@_ssd_bwd.register_fake
def _(dy, q, k, v, g_cum, seq_idx):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), torch.empty_like(g_cum)


def _ssd_setup(ctx, inputs, output):
    q, k, v, _, seq_idx = inputs
    ctx.save_for_backward(q, k, v, output[1], seq_idx)


def _ssd_backward(ctx, dy, _dg_cum):
    q, k, v, g_cum, seq_idx = ctx.saved_tensors
    return (*_ssd_bwd(dy.contiguous(), q, k, v, g_cum, seq_idx), None)


_ssd_fwd.register_autograd(_ssd_backward, setup_context=_ssd_setup)


def ssd_fla(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
            chunk_size: int = 64, D: torch.Tensor | None = None, dt_bias: torch.Tensor | None = None,
            initial_states: torch.Tensor | None = None, seq_idx: torch.Tensor | None = None,
            dt_softplus: bool = False, dt_limit: tuple[float, float] = (0.0, math.inf),
            return_final_states: bool = False):
    """models.common.ssd.ssd_chunk_scan's contract on fla's kernel (a carried or returned state: on PyTorch)."""
    if initial_states is not None or return_final_states:
        return ssd_chunk_scan(x, dt, A, B, C, chunk_size, D, dt_bias, initial_states, seq_idx, dt_softplus,
                              dt_limit, return_final_states)
    h, g = x.shape[2], B.shape[2]
    dt, log_a = _discretize(dt, A, dt_bias, dt_softplus, dt_limit, torch.float32)
    v = (x.float() * dt[..., None]).to(x.dtype)
    k = B.repeat_interleave(h // g, dim=2, output_size=h).to(x.dtype)
    q = C.repeat_interleave(h // g, dim=2, output_size=h).to(x.dtype)
    y = _ssd_fwd(q.contiguous(), k.contiguous(), v.contiguous(), log_a.contiguous(), seq_idx)[0]
    if D is not None:
        y = (y.float() + x.float() * D.float()[:, None]).to(x.dtype)
    return y


# Gated DeltaNet: fla's chunk_gated_delta_rule (q/k L2-normalised in the kernel, grouped value heads).

@torch.library.custom_op("titanlike::fla_gdn_fwd", mutates_args=(), device_types="cuda")
def _gdn_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, scale: float,
             seq_idx: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                                    torch.Tensor, torch.Tensor, torch.Tensor]:
    from fla.ops.gated_delta_rule.chunk import ChunkGatedDeltaRuleFunction

    (fq, fk, fv, fg, fb), cu = _flat(seq_idx, q, k, v, g, beta)
    ctx = _Ctx()
    o, _ = ChunkGatedDeltaRuleFunction.forward(ctx, fq, fk, fv, fg, fb, scale, None, False, False, cu, None, None,
                                               True, False, None, None, False, False, None, CHUNK)
    qn, q_rstd, kn, k_rstd, _, g_cum, _, _, A = ctx.saved_tensors[:9]
    return (o.view(v.shape), qn.view(q.shape), q_rstd.view(q.shape[:-1]), kn.view(k.shape),
            k_rstd.view(k.shape[:-1]), g_cum.view(g.shape), A.view(*v.shape[:3], CHUNK))


@_gdn_fwd.register_fake
def _(q, k, v, g, beta, scale, seq_idx):
    f32 = torch.float32
    return (torch.empty_like(v, dtype=q.dtype), torch.empty_like(q), q.new_empty(q.shape[:-1], dtype=f32),
            torch.empty_like(k), k.new_empty(k.shape[:-1], dtype=f32), torch.empty_like(g, dtype=f32),
            k.new_empty((*v.shape[:3], CHUNK)))


@torch.library.custom_op("titanlike::fla_gdn_bwd", mutates_args=(), device_types="cuda")
def _gdn_bwd(do: torch.Tensor, qn: torch.Tensor, q_rstd: torch.Tensor, kn: torch.Tensor, k_rstd: torch.Tensor,
             v: torch.Tensor, g_cum: torch.Tensor, beta: torch.Tensor, A: torch.Tensor, scale: float,
             seq_idx: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                                    torch.Tensor]:
    from fla.ops.gated_delta_rule.chunk import ChunkGatedDeltaRuleFunction

    (fdo, fq, fqr, fk, fkr, fv, fg, fb, fA), cu = _flat(seq_idx, do, qn, q_rstd, kn, k_rstd, v, g_cum, beta, A)
    saved = (fq, fqr, fk, fkr, fv, fg, fb, fb, fA, None, cu, _chunk_indices(cu), None, None, None)
    ctx = _backward_ctx(saved_tensors=saved, scale=scale, chunk_size=CHUNK, use_qk_l2norm_in_kernel=True,
                        use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, cp_context=None,
                        state_v_first=False, use_gate_in_kernel=False)
    dq, dk, dv, dg, db = ChunkGatedDeltaRuleFunction.backward(ctx, fdo, None)[:5]
    return dq.view(qn.shape), dk.view(kn.shape), dv.view(v.shape), dg.view(g_cum.shape), db.view(beta.shape)


@_gdn_bwd.register_fake
def _(do, qn, q_rstd, kn, k_rstd, v, g_cum, beta, A, scale, seq_idx):
    return (torch.empty_like(qn), torch.empty_like(kn), torch.empty_like(v), torch.empty_like(g_cum),
            torch.empty_like(beta))


def _gdn_setup(ctx, inputs, output):
    _, _, v, _, beta, scale, seq_idx = inputs
    _, qn, q_rstd, kn, k_rstd, g_cum, A = output
    ctx.save_for_backward(qn, q_rstd, kn, k_rstd, v, g_cum, beta, A, seq_idx)
    ctx.scale = scale


def _gdn_backward(ctx, do, *_internal):
    qn, q_rstd, kn, k_rstd, v, g_cum, beta, A, seq_idx = ctx.saved_tensors
    grads = _gdn_bwd(do.contiguous(), qn, q_rstd, kn, k_rstd, v, g_cum, beta, A, ctx.scale, seq_idx)
    return (*grads, None, None)


_gdn_fwd.register_autograd(_gdn_backward, setup_context=_gdn_setup)


def gdn_fla(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
            scale: float | None = None, initial_state: torch.Tensor | None = None, output_final_state: bool = False,
            use_qk_l2norm_in_kernel: bool = False, seq_idx: torch.Tensor | None = None, chunk_size: int = 64):
    """models.common.delta_rule.chunk_gated_delta_rule's contract on fla's kernel (a carried or returned state, or
    no in-kernel q/k norm: on PyTorch)."""
    if initial_state is not None or output_final_state or not use_qk_l2norm_in_kernel:
        return chunk_gated_delta_rule(q, k, v, g, beta, scale, initial_state, output_final_state,
                                      use_qk_l2norm_in_kernel, seq_idx, chunk_size)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    o = _gdn_fwd(q.contiguous(), k.contiguous(), v.contiguous(), g.float().contiguous(), beta.contiguous(), scale,
                 seq_idx)[0]
    return o, None


FLA_SCANS = {ssd_chunk_scan: ssd_fla, chunk_gated_delta_rule: gdn_fla}


def fla_forward_ops() -> list:
    """The forward ops (per-op activation checkpointing keeps their outputs, as it keeps attention's)."""
    return [torch.ops.titanlike.fla_ssd_fwd.default, torch.ops.titanlike.fla_gdn_fwd.default]


def key_dim(module: torch.nn.Module) -> int:
    """The kernels' key size of a mixer: Mamba-2's state size (k = B), Gated DeltaNet's key head size."""
    p, n = module.state_dims  # Mamba-2: (head_dim, state_size); Gated DeltaNet: (key head, value head)
    return n if module.scan_fn is ssd_chunk_scan else p


def kernel_refuses(module: torch.nn.Module) -> str | None:
    """Why the kernels are not given this mixer here (None: they are)."""
    sizes = tuple(module.state_dims)
    if any(s > MAX_HEAD_DIM for s in sizes):
        return f"{type(module).__name__} head/state sizes {sizes} exceed {MAX_HEAD_DIM}"
    if _hopper_miscompiles():
        return (f"{type(module).__name__}: Triton before 3.7.1 miscompiles fla's gated backward on Hopper (fla issue "
                f"640; its bf16 gradients were wrong on an H100, docs/hybrid.md); the PyTorch scan runs instead")
    return None


def use_fla(model: torch.nn.Module, strict: bool) -> tuple[int, list[str]]:
    """Point every recurrent mixer's scan (its `scan_fn`) at fla's kernel: (how many, why the others were not).
    strict (model.mixer_kernel = "fla"): a mixer the kernels cannot take is a ValueError naming the key."""
    n, skipped = 0, []
    for module in model.modules():
        fast = FLA_SCANS.get(getattr(module, "scan_fn", None))
        if fast is None:
            continue
        reason = kernel_refuses(module)
        if reason is not None:
            if strict:
                raise ValueError(f"model.mixer_kernel='fla': {reason}; use mixer_kernel='auto' or 'torch'")
            skipped.append(reason)
            continue
        module.scan_fn = fast
        n += 1
    return n, skipped
