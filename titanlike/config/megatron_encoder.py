"""Megatron's `pretrain_bert.py` / `pretrain_t5.py` flags -> the bert / t5 family and their data (docs/megatron.md).

GPT-like blocks choose their family by the model flags (megatron_model.py); BERT and T5 are chosen by the script
(or translate_text's model_type), because their flags look like a GPT's. The sizes go onto the family's args and are
written as the nearest named flavor plus the fields that differ (megatron_model._name_shape, as for GPT). Megatron's
BERT is pre-LN with the binary (sentence-order) head on unless --bert-no-binary-head: titanlike's megatron-bert
layout. Megatron's T5 is not HF's: it keeps LayerNorm, learned positions and biased GELU MLPs, where titanlike's T5 is
HF's original T5 (RMS norms, relative position buckets, no biases, ReLU FFN, tied head); the sizes carry over, the
layer recipe does not, and the translation says so.
"""
from __future__ import annotations

import dataclasses

from models import MODELS
from titanlike.config import megatron_model
from titanlike.config.megatron_model import number
from titanlike.config.megatron_shell import MegatronError

SCRIPTS = {"pretrain_bert.py": "bert", "pretrain_t5.py": "t5"}
FAMILIES = tuple(SCRIPTS.values())
# Megatron's layouts: pre-LN BERT; T5Model's (learned positions, LayerNorm, biased GELU MLPs, a tied head with a bias)
_BASE = {"bert": "megatron-bert-345m", "t5": "megatron-t5-220m"}
VALUED = {"--mask-prob", "--short-seq-prob", "--encoder-seq-length", "--decoder-seq-length", "--vocab-extra-ids",
          "--encoder-num-layers", "--decoder-num-layers"}
SWITCHES = {"--bert-no-binary-head", "--split-sentences"}
FLAGS = VALUED | SWITCHES
# Megatron model flags that bert / t5 can follow here; any other model flag (RoPE, SwiGLU, RMSNorm, ...) describes a
# layer the family does not build.
_SIZES = {"--num-layers", "--hidden-size", "--num-attention-heads", "--ffn-hidden-size", "--kv-channels",
          "--max-position-embeddings", "--init-method-std", "--hidden-dropout", "--attention-dropout"}


def family_of(script: str, model_type: str | None) -> str | None:
    """bert / t5 from an explicit model type, else from the launched script's name; None: a GPT-like block."""
    if model_type is not None:
        if model_type not in (*FAMILIES, "gpt"):
            raise MegatronError(f"model type {model_type!r}: give bert, t5 or gpt (pretrain_gpt.py's families)")
        return None if model_type == "gpt" else model_type
    return SCRIPTS.get(script.rsplit("/", 1)[-1])


def foreign(name: str) -> str:
    """Why a BERT/T5 flag in a pretrain_gpt.py block is not translated."""
    return ("a pretrain_bert.py / pretrain_t5.py flag, but this block is translated as pretrain_gpt.py's: give the "
            "launch of pretrain_bert.py or pretrain_t5.py (or the model type) to translate it")


def build(f: dict[str, list[str]], t, family: str) -> None:
    """Set model.* and the family's data.* keys of `t` (a Translation) from the flags `f`."""
    one = lambda k: " ".join(f[k])  # noqa: E731
    _data(f, t, family, one)
    for k in f:
        if k in megatron_model.FLAGS and k not in _SIZES:
            t.unmapped.append((k, f"titanlike's {family} builds its own layers (docs/{family}.md): this flag "
                                  f"describes one it does not have"))
    layers = "--num-layers" if "--num-layers" in f else "--encoder-num-layers"
    if "--num-layers" in f and "--encoder-num-layers" in f:
        raise MegatronError("--num-layers and --encoder-num-layers both given: Megatron takes one of them; drop one")
    shape = (layers, "--hidden-size", "--num-attention-heads")
    if not any(k in f for k in shape):
        t.set("model.name", family)
        t.said.append(f"{family} (by the script); no model-shape flags: the model is the config's (without --config: "
                      f"{family}'s {_BASE[family]} flavor)")
        t.set("model.flavor", _BASE[family])
        if family == "bert":  # the flavor's head is off; Megatron's on unless --bert-no-binary-head
            t.set("model.args", {"binary_head": "--bert-no-binary-head" not in f})
        return
    missing = [k for k in shape if k not in f]
    if missing:
        raise MegatronError(f"{missing[0]} is missing: Megatron needs --num-layers (or --encoder-num-layers), "
                            f"--hidden-size and --num-attention-heads together; add it")
    spec = MODELS[family]
    dim, heads = number("--hidden-size", one("--hidden-size"), int), number("--num-attention-heads",
                                                                           one("--num-attention-heads"), int)
    ffn = number("--ffn-hidden-size", one("--ffn-hidden-size"), int) if "--ffn-hidden-size" in f else 4 * dim
    kv = number("--kv-channels", one("--kv-channels"), int) if "--kv-channels" in f else None
    n_layers = number(layers, one(layers), int)
    base = dataclasses.asdict(spec.flavors[_BASE[family]])
    if family == "bert":
        if kv is not None and kv * heads != dim:
            t.unmapped.append(("--kv-channels", f"{kv} x {heads} heads != --hidden-size {dim}: bert's heads are "
                                                f"hidden-size / heads wide ({dim // heads})"))
        if "--decoder-num-layers" in f:
            t.unmapped.append(("--decoder-num-layers", "bert has no decoder"))
        new = {"dim": dim, "n_heads": heads, "ffn_dim": ffn, "n_layers": n_layers,
               "binary_head": "--bert-no-binary-head" not in f}
        if "--init-method-std" in f:
            new["init_std"] = number("--init-method-std", one("--init-method-std"), float)
        if "--hidden-dropout" in f:
            new["hidden_dropout"] = number("--hidden-dropout", one("--hidden-dropout"), float)
        if "--attention-dropout" in f:
            t.unmapped.append(("--attention-dropout", "bert has no attention dropout (model.args.hidden_dropout "
                                                      "is the residual branches')"))
        elif "--hidden-dropout" not in f:
            t.notes.append(("--hidden-dropout", "left out (as --attention-dropout): Megatron's default is 0.1; "
                                                "this run trains without dropout (add --hidden-dropout to keep it)"))
        why = "pretrain_bert.py: Megatron's BERT is pre-LN (titanlike's megatron-bert layout)"
    else:
        dec = "--decoder-num-layers"
        new = {"dim": dim, "n_heads": heads, "head_dim": kv or dim // heads, "ffn_dim": ffn, "n_layers": n_layers,
               "n_decoder_layers": number(dec, one(dec), int) if dec in f else n_layers}
        if "--max-position-embeddings" in f:  # the learned table's rows, shared by encoder and decoder
            new["max_position_rows"] = number("--max-position-embeddings", one("--max-position-embeddings"), int)
        if "--decoder-seq-length" in f:  # the longest decoder input the model takes
            new["max_decoder_len"] = number("--decoder-seq-length", one("--decoder-seq-length"), int)
        for k in ("--init-method-std", "--hidden-dropout", "--attention-dropout"):
            if k in f:
                t.unmapped.append((k, "titanlike's t5 initialises as HF's T5 (model.args.init_factor) and trains "
                                      "without dropout"))
        why = ("pretrain_t5.py: Megatron's T5Model layout (titanlike's megatron variant: LayerNorm, learned "
               "positions, biased GELU MLPs, a tied head with its bias), so megatron-core T5 checkpoints import")
    try:
        args = spec.args_cls(**{**base, **new})
    except (ValueError, TypeError) as e:
        raise MegatronError(f"the model flags fit no {family} shape: {e}") from None
    t.said.append(f"family {family}: {why}")
    if "--max-position-embeddings" in f and family == "bert":
        t.notes.append(("--max-position-embeddings", "titanlike sizes positions to training.seq_len"))
    megatron_model._name_shape(family, args, t)


def _data(f: dict, t, family: str, one) -> None:
    if "--encoder-seq-length" in f:
        if "--seq-length" in f and one("--seq-length") != one("--encoder-seq-length"):
            raise MegatronError("--seq-length and --encoder-seq-length differ: Megatron reads one encoder length; "
                                "give one")
        t.set("training.seq_len", number("--encoder-seq-length", one("--encoder-seq-length"), int))
    if "--decoder-seq-length" in f:
        if family == "t5":
            t.set("data.decoder_seq_length", number("--decoder-seq-length", one("--decoder-seq-length"), int))
        else:
            t.unmapped.append(("--decoder-seq-length", "bert has no decoder"))
    if "--vocab-extra-ids" in f:
        t.set("data.vocab_extra_ids", number("--vocab-extra-ids", one("--vocab-extra-ids"), int))
    if "--mask-prob" in f:  # Megatron's masked_lm_prob: the masked share (bert) or the span noise density (t5)
        t.set("data.mask_prob" if family == "bert" else "data.noise_density",
              number("--mask-prob", one("--mask-prob"), float))
    if "--short-seq-prob" in f:
        t.set("data.short_seq_prob", number("--short-seq-prob", one("--short-seq-prob"), float))
    if family == "bert":
        t.set("data.binary_head", "--bert-no-binary-head" not in f)
    elif "--bert-no-binary-head" in f:
        t.notes.append(("--bert-no-binary-head", "t5 has no binary head: nothing to turn off"))
    if "--split-sentences" in f:
        t.unmapped.append(("--split-sentences", "a flag of tools/preprocess_data.py, not of the training script: "
                                                "run scripts/preprocess_data.py --split-sentences and give the "
                                                "..._text_sentence prefix as --data-path"))


def finish(f: dict, t, family: str) -> None:
    """After the data flags: Megatron's BERT/T5 datasets read sentence-split prefixes (data.dataset = family)."""
    data = t.values.get("data", {})
    if data.get("dataset") == "indexed":
        data["dataset"] = family
        plain = [p for p in data.get("paths", []) if not p.endswith("_sentence") and not _is_weight(p)]
        if plain:
            t.notes.append(("--data-path", f"{plain[0]}: {family} data must be sentence-split (preprocess_data.py "
                                           f"--split-sentences writes ..._text_sentence); titanlike refuses a prefix "
                                           f"without a sentence index at start-up"))


def _is_weight(word: str) -> bool:
    try:
        float(word)
        return True
    except ValueError:
        return False
