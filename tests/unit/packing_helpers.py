"""Packed documents against each document alone, for the recurrent families' tests (test_nemotron_h.py,
test_qwen3_next.py): the logits and the gradients of a summed cross-entropy, and the leak check."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def _loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), target.reshape(-1), reduction="sum")


def _grads(model) -> dict[str, torch.Tensor]:
    out = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return out


def packed_and_alone(model, docs: list[torch.Tensor], labels: list[torch.Tensor], **packed_inputs):
    """docs / labels: [1, n] each. Returns (packed logits, the documents' logits alone concatenated, the packed row's
    gradients, the sum of the documents' gradients, the gradients of the row without `packed_inputs`: leaked)."""
    alone = []
    for d, lab in zip(docs, labels):  # the documents' gradients accumulate: their sum
        alone.append(model(d))
        _loss(alone[-1], lab).backward()
    want = _grads(model)
    row, target = torch.cat(docs, dim=1), torch.cat(labels, dim=1)
    packed = model(row, **packed_inputs)
    _loss(packed, target).backward()
    got = _grads(model)
    _loss(model(row), target).backward()  # without the documents: they see each other
    leaked = _grads(model)
    assert got.keys() == want.keys()
    return packed.detach(), torch.cat(alone, dim=1).detach(), got, want, leaked
