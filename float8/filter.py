"""Which nn.Linear layers become Float8Linear: one predicate `fn(module, fqn) -> bool` for torchao's swap.

Rules, in order (the first that applies decides; `explain` names it, for the conversion log):
  1. not an nn.Linear                          -> keep
  2. FQN matched by `filter_fqns`              -> keep ("output" by default: the LM head's logits feed the loss
                                                  directly and are the most sensitive to float8 rounding)
  3. FQN matched by the family's heads         -> keep (ModelSpec.float8_keep, while float8.keep_model_heads: output
                                                  heads besides "output", e.g. BERT's pooler and binary head)
  4. a tied weight under the float8 all-gather -> keep (torchao wraps the weight in a new Parameter for the
                                                  all-gather, which would untie it from the word table)
  5. an MoE router's gate (`router.gate`)      -> keep (routing decisions are discrete: rounding flips them; the
                                                  router computes its logits in fp32 from the weight anyway)
  6. in or out features not a multiple of 16   -> keep (float8 tensor-core GEMMs need 16-aligned dims)
  7. `filter_small` and too small to gain      -> keep (torchao's H100 thresholds per recipe: below them the
                                                  casts cost more than the faster GEMM saves)
  otherwise                                    -> convert
Routed experts (models/common/moe.py GroupedExperts) hold 3-D weights, not nn.Linear: this filter never sees them;
float8.moe_experts puts their grouped GEMMs in float8 (float8/experts.py).
"""
from __future__ import annotations

from typing import Callable

from torch import nn

Filter = Callable[[nn.Module, str], bool]


def fqn_matches(fqn: str, pattern: str) -> bool:
    """True when `pattern`'s dotted components appear as a contiguous run in `fqn`'s.

    "output" matches "output" but not "layers.0.feed_forward.output_proj"; "attention.wq" matches
    "layers.3.attention.wq"; "layers.0" matches every Linear inside block 0 but not "layers.10". (torchtitan
    matches substrings; component runs accept the same configs without the "layers.1" ⊂ "layers.10" surprise.)
    """
    parts, want = fqn.split("."), pattern.split(".")
    n = len(want)
    return any(parts[i:i + n] == want for i in range(len(parts) - n + 1))


def _small_filter(recipe: str) -> Filter:
    """torchao's size heuristic for `recipe` (True = big enough to gain). rowwise_with_gw_hp has no table of its
    own in torchao: its forward and grad-input GEMMs are rowwise, so the rowwise thresholds apply."""
    from torchao.float8 import _auto_filter_for_recipe

    return _auto_filter_for_recipe("rowwise" if recipe == "rowwise_with_gw_hp" else recipe, filter_fqns=[])


def explain(module: nn.Module, fqn: str, filter_fqns: list[str], small: Filter | None,
            model_keep: list[str] = (), tied: frozenset[str] = frozenset()) -> str | None:
    """None when `module` should be converted, else the reason it is kept in high precision. `model_keep`: the
    family's head patterns (rule 3); `tied`: FQNs of Linears to keep because their weight is tied (rule 4)."""
    if not isinstance(module, nn.Linear):
        return "not nn.Linear"
    hit = next((p for p in filter_fqns if fqn_matches(fqn, p)), None)
    if hit is not None:
        return f"float8.filter_fqns has {hit!r}"
    hit = next((p for p in model_keep if fqn_matches(fqn, p)), None)
    if hit is not None:
        return f"the model's output head {hit!r} (ModelSpec.float8_keep; float8.keep_model_heads)"
    if fqn in tied:
        return "weight tied to another module (the float8 all-gather would untie it)"
    if fqn_matches(fqn, "router.gate"):
        return "an MoE router's gate (routing stays in high precision)"
    if module.in_features % 16 or module.out_features % 16:
        return f"dims {module.in_features}x{module.out_features} not multiples of 16"
    if small is not None and not small(module, fqn):
        return f"dims {module.in_features}x{module.out_features} too small to gain (float8.filter_small)"
    return None


def tied_linears(model: nn.Module) -> frozenset[str]:
    """FQNs of the Linear layers whose weight another module shares (a tied LM head or decoder)."""
    owners: dict[int, int] = {}
    for _, m in model.named_modules(remove_duplicate=False):
        for p in m.parameters(recurse=False):
            owners[id(p)] = owners.get(id(p), 0) + 1
    return frozenset(name for name, m in model.named_modules()
                     if isinstance(m, nn.Linear) and owners.get(id(m.weight), 0) > 1)


def build_filter(filter_fqns: list[str], recipe: str, filter_small: bool, skipped: dict[str, str] | None = None,
                 model_keep: list[str] = (), tied: frozenset[str] = frozenset()) -> Filter:
    """The predicate for `convert_to_float8_training`; records each kept Linear's reason in `skipped`."""
    small = _small_filter(recipe) if filter_small else None
    patterns = [p.strip() for p in filter_fqns if p.strip()]
    heads = [p.strip() for p in model_keep if p.strip()]

    def keep_or_convert(module: nn.Module, fqn: str) -> bool:
        reason = explain(module, fqn, patterns, small, heads, tied)
        if reason is not None and skipped is not None and isinstance(module, nn.Linear):
            skipped[fqn] = reason
        return reason is None

    return keep_or_convert
