"""Which attention kernels the model may use (model.attn_backend). The models call F.scaled_dot_product_attention and
the trainer wraps forward and backward in `sdpa_context`; with "fa4" (or "auto" where it runs) the trainer points the
attention modules at FlashAttention-4 instead (`wants_fa4`, models/common/fa4.py)."""
from __future__ import annotations

import contextlib
from typing import Callable

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

# model.attn_backend: "auto" and "sdpa" let torch (or the Hopper order below) choose; the others pin one kernel.
ATTN_BACKENDS = ("auto", "sdpa", "flash", "cudnn", "efficient", "math", "fa4")
SDPA_BACKENDS = {"flash": [SDPBackend.FLASH_ATTENTION], "cudnn": [SDPBackend.CUDNN_ATTENTION],
                 "efficient": [SDPBackend.EFFICIENT_ATTENTION], "math": [SDPBackend.MATH]}
# model.attn_backend = auto on Hopper and newer: cuDNN's attention before flash (torch's own order puts flash, i.e.
# FlashAttention-2, first); a shape cuDNN refuses falls through to the next in this order.
AUTO_HOPPER = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
               SDPBackend.MATH]


def sdpa_backends(name: str, device: torch.device) -> tuple[list | None, bool]:
    """(backends, set_priority) for sdpa_kernel; None: leave torch's choice alone ("sdpa", or auto off Hopper)."""
    if name == "auto":
        hopper = (device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9
                  and torch.backends.cudnn.is_available())
        return (AUTO_HOPPER, True) if hopper else (None, False)
    return SDPA_BACKENDS.get(name), False


def repeats_kv_heads(name: str, device: torch.device) -> bool:
    """Whether the model must repeat its KV heads for the kernels `name` allows (ModelArgs.repeat_kv_heads): the
    memory-efficient kernel has no grouped-query support, and is torch's own pick on CUDA GPUs older than Ampere
    (no flash there), where passing the heads once would fall through to the slow math kernel."""
    if name == "efficient":
        return True
    return name in ("auto", "sdpa") and device.type == "cuda" and torch.cuda.get_device_capability(device)[0] < 8


def wants_fa4(name: str, device: torch.device) -> bool:
    """Whether the model's attention runs on FlashAttention-4 (models/common/fa4.py): always for "fa4" (a
    ValueError naming the key and the fix where it cannot run), and for "auto" where it can (a Hopper or newer GPU
    with flash-attn-4 installed); otherwise SDPA."""
    if name not in ("fa4", "auto") or device.type != "cuda":
        if name == "fa4":
            raise ValueError("model.attn_backend='fa4' needs a CUDA device; use 'auto' (or 'math' on CPU)")
        return False
    from models.common.fa4 import fa4_unavailable

    reason = fa4_unavailable(device)
    if name == "fa4" and reason is not None:
        raise ValueError(f"model.attn_backend='fa4': {reason}; or choose 'auto' / 'cudnn'")
    return reason is None


def sdpa_context(name: str, device: torch.device) -> Callable[[], contextlib.AbstractContextManager]:
    """A factory of contexts that allow the kernels `name` picks ("sdpa": torch chooses, a no-op context)."""
    backends, priority = sdpa_backends(name, device)
    if backends is None:
        return contextlib.nullcontext
    return lambda: sdpa_kernel(backends, set_priority=priority)


# model.mask_kernel: the kernel of masked attention (packed documents, context parallel; models/common/masks.py).
MASK_KERNEL_CHOICES = ("auto", "sdpa", "flex")


def mask_kernel(name: str, masked: bool, device: torch.device) -> str:
    """"auto": FlexAttention on a GPU when attention is masked (packed documents, context parallel's chunks): it
    skips the masked blocks and never holds the mask; SDPA with a dense mask otherwise (CPU, tests). "flex" on the
    CPU is refused: torch has no FlexAttention backward there."""
    if name == "auto":
        return "flex" if masked and device.type == "cuda" else "sdpa"
    if name == "flex" and device.type != "cuda":
        raise ValueError("model.mask_kernel='flex' needs a CUDA device (torch has no FlexAttention backward on the "
                         "CPU); use 'auto' or 'sdpa'")
    return name


# model.mixer_kernel: the scans of the recurrent mixers (Mamba-2, Gated DeltaNet; models/common/fla_kernels.py).
MIXER_KERNELS = ("auto", "torch", "fla")


def wants_fla(name: str, device: torch.device) -> tuple[bool, str | None]:
    """(whether the recurrent mixers run on flash-linear-attention's kernels, why not where "auto" could have):
    always for "fla" (a ValueError naming the key and the fix where they cannot run), for "auto" on a CUDA GPU where
    fla-core imports; PyTorch's chunked scans otherwise ("auto" says why: the trainer logs it once)."""
    if name == "torch":
        return False, None
    from models.common.fla_kernels import fla_unavailable

    reason = fla_unavailable(device)
    if name == "fla" and reason is not None:
        raise ValueError(f"model.mixer_kernel='fla': {reason}; or choose 'auto' / 'torch'")
    return reason is None, reason
