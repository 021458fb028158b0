"""The pipeline schedule's target: a Batch's labels with its extras packed beside them as columns.

torch.distributed.pipelining hands the last stage one `target` per micro-batch, cut from a single tensor along dim 0
the way it cuts the inputs. A loss that also reads per-row extras (DPO's reference log-probs, Batch.extras) needs
each micro-batch's rows of those too; packing them as extra columns of the target makes the schedule cut labels and
extras together, whatever the schedule and however it orders its micro-batches.

Labels stay int64 as they are. A floating extra travels as the bit pattern of its fp32 value in an int64 column, so
it comes back exactly (fp32, bf16 and fp16 values all fit fp32).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TargetLayout:
    """Where pack_targets put what: the labels' shape after the rows, then each extra's (name, shape after the rows,
    dtype), in column order."""
    label_shape: tuple[int, ...]
    extras: tuple[tuple[str, tuple[int, ...], torch.dtype], ...]


def pack_targets(labels: torch.Tensor, extras: dict[str, torch.Tensor]) -> tuple[torch.Tensor, TargetLayout | None]:
    """(labels [R, ...] with each extra [R, ...] as columns after them [R, C], its layout); the labels themselves and
    None when there are no extras."""
    if not extras:
        return labels, None
    if labels.dtype != torch.int64:
        raise ValueError(f"pipeline targets: labels with extras must be int64 class ids, got {labels.dtype}")
    rows = labels.shape[0]
    columns, layout = [labels.reshape(rows, -1)], []
    for name, x in extras.items():
        if x.shape[0] != rows or not x.is_floating_point():
            raise ValueError(f"pipeline targets: extras[{name!r}] must be a floating tensor with one entry per row "
                             f"({rows}), got {x.dtype} {tuple(x.shape)}")
        bits = x.detach().float().reshape(rows, -1).view(torch.int32)
        columns.append(bits.to(torch.int64))
        layout.append((name, tuple(x.shape[1:]), x.dtype))
    return torch.cat(columns, dim=1), TargetLayout(tuple(labels.shape[1:]), tuple(layout))


def unpack_targets(target: torch.Tensor, layout: TargetLayout | None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(labels, extras) of a packed target, or of any micro-batch's rows of it; (target, {}) for layout None."""
    if layout is None:
        return target, {}
    width = math.prod(layout.label_shape)
    labels = target[:, :width].reshape(-1, *layout.label_shape)
    extras = {}
    for name, shape, dtype in layout.extras:
        n = math.prod(shape)
        bits = target[:, width:width + n].to(torch.int32)
        extras[name] = bits.view(torch.float32).to(dtype).reshape(-1, *shape)
        width += n
    return labels, extras
