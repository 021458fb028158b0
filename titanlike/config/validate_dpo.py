"""[dpo] rules and what preference tuning (data.dataset = "preference") cannot run with yet (called by
validate.validate). Each problem is one line naming the key and the fix."""
from __future__ import annotations

import math
from typing import Any

DPO_LOSS_TYPES = ("sigmoid", "ipo", "length_normalized")  # titanlike/train/dpo_loss.py implements each
DPO_REFERENCES = ("precompute", "frozen_copy")
PREFERENCE_LAYOUTS = ("pad", "pack")  # data.preference_layout: titanlike/data/preference.py
PREFERENCE = "preference"  # the dataset whose samples are (chosen, rejected) pairs: it makes the objective DPO


def check_dpo(cfg: Any, errors: list[str]) -> None:
    d, data, val = cfg.dpo, cfg.data, cfg.validation
    if d.loss_type not in DPO_LOSS_TYPES:
        errors.append(f"dpo.loss_type={d.loss_type!r} is not one of {', '.join(DPO_LOSS_TYPES)}")
    if d.reference not in DPO_REFERENCES:
        errors.append(f"dpo.reference={d.reference!r} is not one of {', '.join(DPO_REFERENCES)}")
    if not (d.beta > 0 and math.isfinite(d.beta)):
        errors.append(f"dpo.beta={d.beta} must be a finite number > 0 (0.1 is the usual start)")
    if not 0.0 <= d.label_smoothing < 0.5:
        errors.append(f"dpo.label_smoothing={d.label_smoothing} must be in [0, 0.5) (the assumed share of flipped "
                      f"preference labels; 0 = plain DPO)")
    elif d.label_smoothing > 0 and d.loss_type == "ipo":
        errors.append("dpo.label_smoothing applies to the sigmoid losses only; set it to 0 with dpo.loss_type=\"ipo\"")
    if val.dataset == PREFERENCE and data.dataset != PREFERENCE:
        errors.append("validation.dataset=\"preference\" scores pairs with the DPO loss, which only a run with "
                      "data.dataset=\"preference\" trains; leave validation.dataset empty")
    if data.preference_layout not in PREFERENCE_LAYOUTS:  # (checked whatever the dataset: a typo fails early)
        errors.append(f"data.preference_layout={data.preference_layout!r} is not one of "
                      f"{', '.join(PREFERENCE_LAYOUTS)}")
    if data.dataset != PREFERENCE:
        return
    what = "data.dataset=\"preference\" (DPO)"
    if cfg.training.loss_chunk_tokens > 0:
        errors.append(f"{what} needs the logits for per-sequence log-probs, which the chunked loss never builds; "
                      f"set training.loss_chunk_tokens=0")
    if cfg.fault_tolerance.enable:
        errors.append(f"{what} does not run with fault_tolerance.enable yet (the reference pass is not shared "
                      f"between replica groups); turn it off")
    if data.preference_layout == "pack":
        missing = [k for k, on in (("data.document_masking", data.document_masking),
                                   ("data.reset_position_ids", data.reset_position_ids)) if not on]
        if missing:
            fix = " and ".join(f"{k}=true" for k in missing)
            errors.append(f"data.preference_layout=\"pack\" puts several sequences in a row, and each must attend "
                          f"only to itself at its own positions (as padded); set {fix}")
        if data.eod_mask_loss:
            errors.append(f"{what}: the loss is over the responses only, never on an end-of-document position; turn "
                          f"data.eod_mask_loss off")
    else:
        packing = [k for k, on in (("data.document_masking", data.document_masking),
                                   ("data.reset_position_ids", data.reset_position_ids),
                                   ("data.eod_mask_loss", data.eod_mask_loss)) if on]
        if packing:
            errors.append(f"{what}: with data.preference_layout=\"pad\" every row is one prompt and response, never "
                          f"packed documents; turn {' / '.join(packing)} off, or pack pairs with "
                          f"data.preference_layout=\"pack\"")
    if val.enable and not val.paths:
        errors.append(f"validation.enable with {what} needs validation.paths (JSONL files of held-out pairs): the "
                      f"pairs files have no split")
    if cfg.eval.enable and cfg.eval.perplexity_sets:
        errors.append(f"eval.perplexity_sets with {what}: in-loop perplexity scores token data through the training "
                      f"objective, DPO here; score the checkpoints with scripts/evaluate.py, or empty "
                      f"eval.perplexity_sets (eval.tasks work)")
    if val.dataset not in ("", PREFERENCE):
        errors.append(f"validation.dataset={val.dataset!r}: a DPO run scores pairs; leave validation.dataset empty")
