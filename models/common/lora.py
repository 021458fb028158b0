"""LoRA (low-rank adapters, Hu et al. 2021) as a module swap on the meta model, PEFT's conventions.

`apply_lora(model, ...)` replaces the chosen nn.Linear layers by LoraLinear, a subclass of nn.Linear whose own
`weight` and `bias` are the original (frozen) parameters under the same FQNs, so a pretrained or HF-imported
checkpoint loads as before, and whose extra children are `lora_A` (in -> rank) and `lora_B` (rank -> out):

    y = base(x) + lora_B(lora_A(dropout(x))) * alpha / rank

PEFT's init (`init_adapters`, after the family's init_weights): A kaiming-uniform (a = sqrt(5)), B zeros, so a fresh
adapter leaves the model's output unchanged. Plain torch only: under tensor parallel the plan hands the forward
DTensors and the same arithmetic runs on them (parallelize/lora.py shards the adapters the way the base is sharded).

Which layers: `targets` are module names matched against FQN suffixes the way PEFT's target_modules are ("wq"
matches "layers.0.attention.wq"; "attention.wq" too; "layers.1.attention.wq" just that one). Only nn.Linear layers
take adapters. Linears inside an MoE layer (shared experts) need `include_experts`; the routed experts' stacked 3-D
weights (GroupedExperts) are not Linears, and the router's gate is read as a weight (fp32 logits), not called: neither
ever gets adapters.
"""
from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from torch import nn

from models.common.moe import MoE
from models.common.router import Router


class LoraLinear(nn.Linear):
    """nn.Linear (frozen `weight`, `bias`) plus a trainable low-rank update; see the module docstring."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, rank: int, alpha: float,
                 dropout: float = 0.0, device=None, dtype=None):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.rank, self.alpha = rank, alpha
        self.scaling = alpha / rank
        self.lora_A = nn.Linear(in_features, rank, bias=False, device=device, dtype=dtype)
        self.lora_B = nn.Linear(rank, out_features, bias=False, device=device, dtype=dtype)
        self.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()

    @classmethod
    def from_linear(cls, linear: nn.Linear, rank: int, alpha: float, dropout: float) -> LoraLinear:
        """A LoraLinear holding `linear`'s own weight and bias Parameters (frozen), with new adapters on its device."""
        w = linear.weight
        new = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, rank=rank, alpha=alpha,
                  dropout=dropout, device=w.device, dtype=w.dtype)
        new.weight = linear.weight
        new.bias = linear.bias
        new.weight.requires_grad_(False)
        if new.bias is not None:
            new.bias.requires_grad_(False)
        return new

    adapters_enabled = True  # False inside adapters_disabled(): the layer computes its base alone

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        base = F.linear(x, self.weight, self.bias)
        if not self.adapters_enabled:
            return base
        return base + self.lora_B(self.lora_A(self.lora_dropout(x))) * self.scaling

    @torch.no_grad()
    def init_adapters(self) -> None:
        """PEFT's init: A as nn.Linear's default (kaiming-uniform, a = sqrt(5)), B zeros: a fresh adapter adds 0."""
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B.weight)

    def delta_weight(self) -> torch.Tensor:
        """scaling * B @ A in fp32: what merging adds to `weight` (full tensors; gather DTensors first)."""
        return (self.lora_B.weight.float() @ self.lora_A.weight.float()) * self.scaling

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, rank={self.rank}, alpha={self.alpha}"


def matches(fqn: str, pattern: str) -> bool:
    """PEFT's target_modules rule: the FQN is the pattern, or ends with "." + pattern."""
    return fqn == pattern or fqn.endswith("." + pattern)


def _read_directly(model: nn.Module) -> set[str]:
    """Linears whose module reads their weight instead of calling them (an adapter there would do nothing): the MoE
    router's gate (models/common/router.py: fp32 logits from the weight)."""
    return {f"{name}.{child}" for name, m in model.named_modules() if isinstance(m, Router)
            for child, c in m.named_children() if isinstance(c, nn.Linear)}


def candidates(model: nn.Module, include_experts: bool) -> tuple[dict[str, nn.Linear], set[str]]:
    """({FQN: Linear} that may take adapters, FQNs of the Linears inside MoE layers left out without
    include_experts). Linears read as weights (the router's gate) are in neither."""
    direct = _read_directly(model)
    linears = {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear) and name not in direct}
    inside_moe = {f"{name}.{sub}" for name, m in model.named_modules() if isinstance(m, MoE)
                  for sub, s in m.named_modules() if isinstance(s, nn.Linear)}
    skipped = set() if include_experts else inside_moe & set(linears)
    return {k: v for k, v in linears.items() if k not in skipped}, skipped


def lora_problems(model: nn.Module, targets: list[str], rank: int, include_experts: bool,
                  head: str | None = None) -> list[str]:
    """What is wrong with these LoRA settings for `model` (built, e.g. on meta): a target matching no Linear, a rank
    above min(in, out) of a matched layer; `head`: the output projection's name when a chunked loss replaces it
    (training.loss_chunk_tokens > 0: it reads the head's weight directly, so an adapter there would be skipped).
    Each names the lora.* key and the fix."""
    found, skipped = candidates(model, include_experts)
    direct = _read_directly(model)
    problems = []
    names = sorted({k.rsplit(".", 1)[-1] for k in found})
    for pattern in targets:
        hits = [k for k in found if matches(k, pattern)]
        if not hits and any(matches(k, pattern) for k in direct):
            problems.append(f"lora.target_modules entry {pattern!r} matches only MoE router gates, whose weight the "
                            f"router reads directly (fp32 logits): an adapter there would do nothing; remove "
                            f"{pattern!r}")
        elif not hits and any(matches(k, pattern) for k in skipped):
            problems.append(f"lora.target_modules entry {pattern!r} matches only Linear layers inside MoE layers; set "
                            f"lora.include_experts=true or remove {pattern!r}")
        elif not hits:
            problems.append(f"lora.target_modules entry {pattern!r} matches no Linear layer of the model; its Linear "
                            f"names are {names}: fix or remove {pattern!r}")
    too_small = [(k, m) for k, m in found.items() if any(matches(k, p) for p in targets)
                 and rank > min(m.in_features, m.out_features)]
    if too_small:
        k, m = min(too_small, key=lambda km: min(km[1].in_features, km[1].out_features))
        problems.append(f"lora.rank={rank} is larger than min(in, out) = {min(m.in_features, m.out_features)} of "
                        f"{k} ({m.in_features} -> {m.out_features}); choose lora.rank <= "
                        f"{min(m.in_features, m.out_features)} or leave that layer out of lora.target_modules")
    if head is not None and any(matches(head, p) for p in targets) and head in found:
        problems.append(f"lora.target_modules puts an adapter on the output projection {head!r}, which the chunked "
                        f"loss (training.loss_chunk_tokens > 0) computes from its weight alone; set "
                        f"training.loss_chunk_tokens=0 or remove {head!r} from lora.target_modules")
    return problems


def apply_lora(model: nn.Module, targets: list[str], rank: int, alpha: float, dropout: float = 0.0,
               include_experts: bool = False) -> list[str]:
    """Freeze every parameter of `model` and swap the targeted Linears for LoraLinear, in place (on meta, before the
    plan). Returns the swapped FQNs. Call lora_problems first: this swaps whatever matches."""
    model.requires_grad_(False)  # the base: everything but the adapters made below
    found, _ = candidates(model, include_experts)
    swapped = [k for k in found if any(matches(k, p) for p in targets)]
    for fqn in swapped:
        parent_name, _, child = fqn.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, LoraLinear.from_linear(found[fqn], rank, alpha, dropout))
    return swapped


def is_adapter_key(key: str) -> bool:
    """A state-dict key of an adapter (`<fqn>.lora_A.weight`, `<fqn>.lora_B.weight`)."""
    return ".lora_A." in key or ".lora_B." in key


def has_lora(model: nn.Module) -> bool:
    return any(isinstance(m, LoraLinear) for m in model.modules())


@contextlib.contextmanager
def adapters_disabled(model: nn.Module):
    """Within the block every LoraLinear computes its base alone (DPO's reference is the base model); a model without
    adapters is untouched."""
    layers = [m for m in model.modules() if isinstance(m, LoraLinear)]
    for m in layers:
        m.adapters_enabled = False
    try:
        yield
    finally:
        for m in layers:
            del m.adapters_enabled  # back to the class default


def lora_modules(model: nn.Module) -> dict[str, LoraLinear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, LoraLinear)}


def init_adapters(model: nn.Module) -> int:
    """PEFT's init of every adapter in `model` (after its init_weights, which knows nothing of them); returns how
    many."""
    mods = lora_modules(model)
    for m in mods.values():
        m.init_adapters()
    return len(mods)


@torch.no_grad()
def merge_state_dict(sd: dict[str, torch.Tensor], scaling: float) -> dict[str, torch.Tensor]:
    """A state dict with adapters (`<fqn>.lora_A.weight`, `<fqn>.lora_B.weight`) -> the plain model's: each
    `<fqn>.weight` += scaling * B @ A (in fp32, then the weight's dtype), the adapter keys dropped. Full tensors."""
    out = {k: v for k, v in sd.items() if ".lora_A." not in k and ".lora_B." not in k}
    for key in sd:
        if key.endswith(".lora_A.weight"):
            fqn = key[:-len(".lora_A.weight")]
            a, b, w = sd[key], sd[f"{fqn}.lora_B.weight"], out[f"{fqn}.weight"]
            out[f"{fqn}.weight"] = (w.float() + (b.float() @ a.float()) * scaling).to(w.dtype)
    return out


__all__ = ["LoraLinear", "apply_lora", "candidates", "init_adapters", "is_adapter_key", "lora_modules",
           "lora_problems", "matches", "merge_state_dict"]
