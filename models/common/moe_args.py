"""The MoE layer's arguments and their checks, importing nothing of the project's: models/common/moe.py (the
layer), router.py (the router) and the families' args, flavors and HF adapters import them."""

from __future__ import annotations

from dataclasses import dataclass

SCORE_FUNCS = ("softmax", "sigmoid")  # the router's score functions (models/common/router.py)
# The experts' MLP: "swiglu" w2(silu(w1 x) * w3 x) (Llama, Qwen3, DeepSeek-V3); "relu2" w2(relu(w1 x)^2), no gate
# and no w3 (NemotronH, Megatron --squared-relu). The shared experts follow the same choice.
EXPERT_ACTS = ("swiglu", "relu2")


@dataclass
class MoEArgs:
    num_experts: int = 8
    top_k: int = 2
    hidden_dim: int = 0            # each routed expert's hidden size
    num_shared_experts: int = 0    # shared experts: one FeedForward (expert_act's kind) of hidden shared_hidden_dim
    shared_hidden_dim: int = 0     # 0 = num_shared_experts * hidden_dim
    score_func: str = "softmax"    # "softmax" | "sigmoid"
    route_norm: bool = False       # renormalise the k selected weights to sum to 1
    route_scale: float = 1.0       # multiply the selected weights
    n_groups: int = 1              # group-limited routing: experts split into n_groups groups ...
    topk_groups: int = 1           # ... each token may use experts of its topk_groups best groups
    aux_loss_coeff: float = 0.0    # Switch/GShard load-balancing loss (Megatron --moe-aux-loss-coeff)
    seq_aux_loss_coeff: float = 0.0  # DeepSeek-V3's sequence-wise balance loss
    z_loss_coeff: float = 0.0      # router z-loss
    bias_update_rate: float = 0.0  # > 0: auxiliary-loss-free balancing (expert bias, selection only)
    capacity_factor: float = 0.0   # 0 = dropless; > 0: per-expert capacity ceil(cf * tokens * top_k / E), rest dropped
    expert_act: str = "swiglu"     # EXPERT_ACTS: "swiglu" (w1, w2, w3) | "relu2" (w1, w2)
    # > 0: the routed experts work in a latent space of this width (NemotronH's moe_latent_size): latent_in projects
    # the tokens down before dispatch, latent_out the weighted sum of the experts' outputs back up; router and shared
    # experts read the full width.
    latent_dim: int = 0


def moe_problems(args: MoEArgs, ep: int, prefix: str = "model") -> list[str]:
    """Everything wrong with `args` (and the expert-parallel degree ep), one line each naming the key and the fix."""
    p, e, k = prefix, args.num_experts, args.top_k
    out = []
    if args.score_func not in SCORE_FUNCS:
        out.append(f"{p}.score_func={args.score_func!r} is unknown; use one of {list(SCORE_FUNCS)}")
    if e < 1:
        out.append(f"{p}.num_experts={e} must be at least 1")
    top_k_ok = 1 <= k <= e
    if not top_k_ok:
        out.append(f"{p}.top_k={k} must lie in 1..{p}.num_experts={e}; lower top_k or add experts")
    if e >= 1 and ep >= 1 and e % ep:
        divs = [d for d in range(1, e + 1) if e % d == 0]
        out.append(f"parallelism.ep={ep} does not divide {p}.num_experts={e}; use ep in {{{','.join(map(str, divs))}}}")
    g, tg = args.n_groups, args.topk_groups
    if g < 1 or (e >= 1 and e % g):
        out.append(f"{p}.n_groups={g} does not divide {p}.num_experts={e}; use a divisor of num_experts "
                   f"(1 = no groups)")
    elif not 1 <= tg <= g:
        out.append(f"{p}.topk_groups={tg} must lie in 1..{p}.n_groups={g}; lower topk_groups")
    elif top_k_ok and k > tg * (e // g):
        out.append(f"{p}.top_k={k} exceeds the {tg * (e // g)} experts that {p}.topk_groups={tg} groups of "
                   f"{e // g} hold; raise topk_groups or lower top_k")
    if args.expert_act not in EXPERT_ACTS:
        out.append(f"{p}.expert_act={args.expert_act!r} is unknown; use one of {list(EXPERT_ACTS)}")
    if args.latent_dim < 0:
        out.append(f"{p}.latent_dim={args.latent_dim} is negative; use 0 (no latent projection) or a width")
    if args.capacity_factor < 0:
        out.append(f"{p}.capacity_factor={args.capacity_factor} is negative; use 0 (dropless) or a positive factor")
    return out
