"""LoRA (low-rank adapters, Hu et al. 2021) as a module swap on the meta model, PEFT's conventions.

`apply_lora(model, ...)` replaces the chosen nn.Linear layers by LoraLinear, a subclass of nn.Linear whose own
`weight` and `bias` are the original (frozen) parameters under the same FQNs, so a pretrained or HF-imported
checkpoint loads as before, and whose extra children are `lora_A` (in -> rank) and `lora_B` (rank -> out):

    y = base(x) + lora_B(lora_A(dropout(x))) * alpha / rank

PEFT's init (`init_adapters`, after the family's init_weights): A kaiming-uniform (a = sqrt(5)), B zeros, so a fresh
adapter leaves the model's output unchanged. Plain torch only: under tensor parallel the plan hands the forward
DTensors and the same arithmetic runs on them (parallelize/lora.py shards the adapters the way the base is sharded).

Which layers: `targets` are module names matched against FQN suffixes the way PEFT's target_modules are ("wq"
matches "layers.0.attention.wq"; "attention.wq" too; "layers.1.attention.wq" just that one). nn.Linear layers take
adapters, and so do the routed experts (models/common/moe.py's GroupedExperts, named "experts" in every MoE layer):
a target naming that module puts a low-rank update on each expert's w1, w2 and w3, stacked like the weights
(`<experts>.lora_A.w1` [E, r, in], `<experts>.lora_B.w1` [E, out, r]; the forward adds scale * (x A_e^T) B_e^T to
expert e's projection without forming B @ A), so expert parallelism shards them with the experts. Everything inside
an MoE layer (shared experts' Linears, routed experts) needs `include_experts`. The router's gate is read as a weight
(fp32 logits), not called: it never gets adapters.

Adapter keys name the weight they adapt: `<owner>.lora_A.<leaf>` and `<owner>.lora_B.<leaf>` update `<owner>.<leaf>`
(a LoraLinear's `weight`, or an experts module's `w1`, ...); merge_state_dict and the exports rely on that rule.
"""
from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from torch import nn

from models.common.moe import GroupedExperts, MoE
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


def expert_candidates(model: nn.Module) -> dict[str, GroupedExperts]:
    """{FQN: routed-experts module} of every MoE layer: adapted when a target names the module (e.g. "experts") and
    include_experts is on."""
    return {name: m for name, m in model.named_modules() if isinstance(m, GroupedExperts)}


def _targeted(model: nn.Module, targets: list[str], include_experts: bool) -> dict[str, nn.Module]:
    """{FQN: module} that `targets` adapt: Linears, and routed experts with include_experts."""
    found, _ = candidates(model, include_experts)
    if include_experts:
        found = {**found, **expert_candidates(model)}
    return {k: m for k, m in found.items() if any(matches(k, p) for p in targets)}


def _widths(module: nn.Module) -> tuple[int, int]:
    """(in, out) of a Linear; of an experts module, (dim, hidden) of its w1 [E, hidden, dim]."""
    if isinstance(module, GroupedExperts):
        return module.w1.shape[2], module.w1.shape[1]
    return module.in_features, module.out_features


def lora_problems(model: nn.Module, targets: list[str], rank: int, include_experts: bool,
                  head: str | None = None) -> list[str]:
    """What is wrong with these LoRA settings for `model` (built, e.g. on meta): a target matching no Linear (or
    experts module), a rank above min(in, out) of a matched layer; `head`: the output projection's name when a
    chunked loss replaces it (training.loss_chunk_tokens > 0: it reads the head's weight directly, so an adapter there
    would be skipped). Each names the lora.* key and the fix."""
    found, skipped = candidates(model, include_experts)
    experts = expert_candidates(model)
    inside_moe = skipped | (set() if include_experts else set(experts))
    direct = _read_directly(model)
    problems = []
    names = sorted({k.rsplit(".", 1)[-1] for k in found})
    expert_names = sorted({k.rsplit(".", 1)[-1] for k in experts})
    hint = (f" (the routed experts take adapters by their module's name, {expert_names}, with "
            f"lora.include_experts=true)" if experts else "")
    for pattern in targets:
        hits = [k for k in [*found, *(experts if include_experts else ())] if matches(k, pattern)]
        if not hits and any(matches(k, pattern) for k in direct):
            problems.append(f"lora.target_modules entry {pattern!r} matches only MoE router gates, whose weight the "
                            f"router reads directly (fp32 logits): an adapter there would do nothing; remove "
                            f"{pattern!r}")
        elif not hits and any(matches(k, pattern) for k in inside_moe):
            what = "routed experts" if any(matches(k, pattern) for k in experts) else "Linear layers inside MoE layers"
            problems.append(f"lora.target_modules entry {pattern!r} matches only {what}; set "
                            f"lora.include_experts=true or remove {pattern!r}")
        elif not hits:
            problems.append(f"lora.target_modules entry {pattern!r} matches no Linear layer of the model; its Linear "
                            f"names are {names}{hint}: fix or remove {pattern!r}")
    too_small = [(k, _widths(m)) for k, m in _targeted(model, targets, include_experts).items()
                 if rank > min(_widths(m))]
    if too_small:
        k, (i, o) = min(too_small, key=lambda kw: min(kw[1]))
        problems.append(f"lora.rank={rank} is larger than min(in, out) = {min(i, o)} of {k} ({i} -> {o}); choose "
                        f"lora.rank <= {min(i, o)} or leave that layer out of lora.target_modules")
    if head is not None and any(matches(head, p) for p in targets) and head in found:
        problems.append(f"lora.target_modules puts an adapter on the output projection {head!r}, which the chunked "
                        f"loss (training.loss_chunk_tokens > 0) computes from its weight alone; set "
                        f"training.loss_chunk_tokens=0 or remove {head!r} from lora.target_modules")
    return problems


def add_expert_adapters(experts: GroupedExperts, rank: int, alpha: float, dropout: float = 0.0) -> None:
    """LoRA on every weight of a routed-experts module, in place: for each of w1, w2, w3 [E, out, in], `lora_A[name]`
    [E, r, in] and `lora_B[name]` [E, out, r] (each expert's own A and B, stacked as the weights are), on the weights'
    device and dtype; models/common/moe.py's forward adds them (see GroupedExperts)."""
    a, b = nn.ParameterDict(), nn.ParameterDict()
    for name in ("w1", "w2", "w3"):
        w = getattr(experts, name)
        if w is None:  # squared-ReLU experts have no w3
            continue
        e, out, inp = w.shape
        a[name] = nn.Parameter(torch.empty(e, rank, inp, device=w.device, dtype=w.dtype))
        b[name] = nn.Parameter(torch.empty(e, out, rank, device=w.device, dtype=w.dtype))
    experts.lora_A, experts.lora_B = a, b
    experts.lora_scaling, experts.lora_dropout = alpha / rank, dropout


def apply_lora(model: nn.Module, targets: list[str], rank: int, alpha: float, dropout: float = 0.0,
               include_experts: bool = False) -> list[str]:
    """Freeze every parameter of `model`, swap the targeted Linears for LoraLinear and give the targeted routed experts
    their adapters, in place (on meta, before the plan). Returns the adapted modules' FQNs. Call lora_problems first:
    this adapts whatever matches."""
    model.requires_grad_(False)  # the base: everything but the adapters made below
    targeted = _targeted(model, targets, include_experts)
    for fqn, module in targeted.items():
        if isinstance(module, GroupedExperts):
            add_expert_adapters(module, rank, alpha, dropout)
            continue
        parent_name, _, child = fqn.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, LoraLinear.from_linear(module, rank, alpha, dropout))
    return list(targeted)


def is_adapter_key(key: str) -> bool:
    """A state-dict key of an adapter (`<owner>.lora_A.<leaf>`, `<owner>.lora_B.<leaf>`)."""
    return ".lora_A." in key or ".lora_B." in key


def adapted_weights(keys) -> dict[str, tuple[str, str]]:
    """{adapted weight's key: (its lora_A key, its lora_B key)} of the adapters among `keys` (the module doc's rule:
    `<owner>.lora_A.<leaf>` updates `<owner>.<leaf>`)."""
    out = {}
    for key in keys:
        if ".lora_A." in key:
            owner, _, leaf = key.rpartition(".lora_A.")
            out[f"{owner}.{leaf}"] = (key, f"{owner}.lora_B.{leaf}")
    return out


def adapted_experts(model: nn.Module) -> dict[str, GroupedExperts]:
    return {name: m for name, m in model.named_modules() if isinstance(m, GroupedExperts) and "lora_A" in m._modules}


def lora_modules(model: nn.Module) -> dict[str, LoraLinear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, LoraLinear)}


def has_lora(model: nn.Module) -> bool:
    return bool(lora_modules(model) or adapted_experts(model))


@contextlib.contextmanager
def adapters_disabled(model: nn.Module):
    """Within the block every LoraLinear and adapted experts module computes its base alone (DPO's reference is the
    base model); a model without adapters is untouched."""
    layers = [*lora_modules(model).values(), *adapted_experts(model).values()]
    for m in layers:
        m.adapters_enabled = False
    try:
        yield
    finally:
        for m in layers:
            del m.adapters_enabled  # back to the class default


@torch.no_grad()
def _init_expert_adapters(experts: GroupedExperts) -> None:
    """PEFT's init per expert: each A[e] [r, in] as kaiming-uniform with a = sqrt(5) draws it, U(-1/sqrt(in),
    1/sqrt(in)) (one elementwise draw on the whole stack, which seeded_init keeps layout-independent); B zeros."""
    for name, a in experts.lora_A.items():
        bound = 1.0 / math.sqrt(a.shape[-1])
        nn.init.uniform_(a, -bound, bound)
        nn.init.zeros_(experts.lora_B[name])


def init_adapters(model: nn.Module) -> int:
    """PEFT's init of every adapter in `model` (after its init_weights, which knows nothing of them); returns how
    many adapted modules."""
    mods, experts = lora_modules(model), adapted_experts(model)
    for m in mods.values():
        m.init_adapters()
    for m in experts.values():
        _init_expert_adapters(m)
    return len(mods) + len(experts)


@torch.no_grad()
def merge_state_dict(sd: dict[str, torch.Tensor], scaling: float) -> dict[str, torch.Tensor]:
    """A state dict with adapters -> the plain model's: each adapted weight += scaling * B @ A (in fp32, then the
    weight's dtype; batched over the experts of a stacked weight), the adapter keys dropped. Full tensors."""
    out = {k: v for k, v in sd.items() if not is_adapter_key(k)}
    for key, (a, b) in adapted_weights(sd).items():
        w = out[key]
        out[key] = (w.float() + (sd[b].float() @ sd[a].float()) * scaling).to(w.dtype)
    return out


__all__ = ["LoraLinear", "add_expert_adapters", "adapted_experts", "adapted_weights", "apply_lora", "candidates",
           "expert_candidates", "init_adapters", "is_adapter_key", "lora_modules", "lora_problems", "matches",
           "merge_state_dict"]
