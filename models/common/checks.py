"""Config checks shared by attention-based families: what the parallel degrees require of the model's shapes."""
from __future__ import annotations

import math


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def attention_head_checks(n_heads: int, n_kv_heads: int, par, flavor: str) -> list[str]:
    """TP splits attention by heads: each TP rank needs whole query heads and whole KV heads. `par` is the
    parallelism config section."""
    tp = par.tp
    fix = "use tp in {" + ",".join(map(str, _divisors(math.gcd(n_heads, n_kv_heads)))) + "}"
    # KV heads are the tighter limit under GQA, so they are named first.
    if n_kv_heads % tp and n_kv_heads != n_heads:
        return [f"model.flavor {flavor!r} has n_kv_heads={n_kv_heads} which parallelism.tp={tp} does not divide; {fix}"]
    if n_heads % tp:
        return [f"model.flavor {flavor!r} has n_heads={n_heads} which parallelism.tp={tp} does not divide; {fix}"]
    return []


def ffn_checks(hidden: int, par, flavor: str) -> list[str]:
    """TP splits the FFN's hidden units evenly over its ranks."""
    if hidden % par.tp:
        return [f"model.flavor {flavor!r} has the FFN hidden size {hidden}, which parallelism.tp={par.tp} does not "
                f"divide; use a tp that divides it"]
    return []


def dense_checks(par, model_name: str) -> list[str]:
    """A model without experts has nothing to shard over an expert-parallel axis."""
    if par.ep > 1:
        return [f"parallelism.ep={par.ep}: {model_name} has no experts to shard; set parallelism.ep=1"]
    return []
