"""State-dict adapter between titanlike Mamba-2 and Megatron-Core's MambaModel with every layer a Mamba layer
(pretrain_mamba.py with an all-"M" --hybrid-override-pattern, or no pattern and no hybrid ratios). The key map, TP
splits and Megatron arguments are the hybrid ones of models/nemotron_h/megatron.py; this family is the one an
all-Mamba Megatron model imports into because it computes what Megatron computes: no lower clamp on the step size
(nemotron_h clamps it at dt_min, as HF NemotronH does) and no attention or MLP fields to invent.
"""
from __future__ import annotations

from models.common.megatron_utils import is_hybrid
from models.mamba2.args import Mamba2Args
from models.nemotron_h import megatron as hybrid
from models.nemotron_h.args import MAMBA

POSITION_EMBEDDING_TYPES = hybrid.POSITION_EMBEDDING_TYPES
TP_SPLIT = hybrid.TP_SPLIT


def claims(margs: dict) -> bool:
    """A hybrid model whose layers are all Mamba."""
    pattern = hybrid._pattern_or_none(margs)
    return is_hybrid(margs) and pattern is not None and set(pattern) == {MAMBA}


def args_from_megatron(margs: dict) -> Mamba2Args:
    """Mamba2Args from a Megatron-LM hybrid args dict; ValueError naming the flag titanlike cannot follow."""
    pattern = hybrid.hybrid_pattern(margs)
    bad = hybrid.refusals(margs, pattern, "mamba2")
    if set(pattern) != {MAMBA}:
        bad.append(f"--hybrid-override-pattern {pattern!r} has other layers than Mamba ('M'): import it as nemotron_h")
    if bad:
        raise ValueError("; ".join(bad))
    return Mamba2Args(**hybrid.common_fields(margs))


def notes(margs: dict) -> list[str]:
    return hybrid.notes(margs, "mamba2")


def from_megatron(msd: dict, args: Mamba2Args, margs: dict | None = None) -> dict:
    return hybrid.from_megatron(msd, args, margs, "mamba2")


def to_megatron(state_dict: dict, args: Mamba2Args) -> dict:
    return hybrid.to_megatron(state_dict, args)


def megatron_args(args: Mamba2Args) -> dict:
    """No attention or MLP layer: Megatron still asks for --num-attention-heads (export_megatron writes 1)."""
    return hybrid.common_args(args)
