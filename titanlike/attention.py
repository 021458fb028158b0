"""Which SDPA kernels attention may use (model.attn_backend): the models call F.scaled_dot_product_attention and
the trainer wraps forward and backward in `sdpa_context`."""
from __future__ import annotations

import contextlib
from typing import Callable

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

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


def sdpa_context(name: str, device: torch.device) -> Callable[[], contextlib.AbstractContextManager]:
    """A factory of contexts that allow the kernels `name` picks ("sdpa": torch chooses, a no-op context)."""
    backends, priority = sdpa_backends(name, device)
    if backends is None:
        return contextlib.nullcontext
    return lambda: sdpa_kernel(backends, set_priority=priority)
