"""The benchmark matrix of scripts/bench/benchmark.py: axes with their defaults and parsers, expansion of command-line
comma lists and TOML [defaults]/[[case]] tables into checked cases, and each case's label."""
from __future__ import annotations

import itertools

from models import DEFAULT_MODEL
from titanlike.config.validate import CHOICES

# "RECIPE+experts": the recipe for the Linears plus float8 routed experts (float8.moe_experts, MoE models only)
EXPERTS = "+experts"
FLOAT8 = ("none", *CHOICES["float8.recipe"], *(r + EXPERTS for r in CHOICES["float8.recipe"]))


def float8_recipe(value: str) -> str:
    """The float8 axis value's recipe for the Linears ("none" stays "none")."""
    return value.removesuffix(EXPERTS)


def float8_experts(value: str) -> bool:
    """Whether the float8 axis value also puts the routed experts in float8."""
    return value.endswith(EXPERTS)
DEGREES = ("dp_replicate", "dp_shard", "tp", "pp", "cp", "ep")
AC_MODES = CHOICES["activation_checkpoint.mode"]


def on_off(v) -> bool:
    if isinstance(v, bool):
        return v
    if str(v).lower() in ("on", "true", "1", "yes"):
        return True
    if str(v).lower() in ("off", "false", "0", "no"):
        return False
    raise ValueError(f"expected on/off, got {v!r}")


# axis -> (parser, default)
AXES = {"model": (str, DEFAULT_MODEL), "flavor": (str, "1B"), "seq": (int, 4096), "batch": (int, 2), "nproc": (int, 1),
        "compile": (on_off, False), "float8": (str, "none"), "float8_all_gather": (on_off, True), "ac": (str, "none"),
        "ac_option": (str, "2"), "layout": (str, ""), "loss_chunk": (int, 0), "config": (str, ""),
        "peer_ac": (str, ""), "post": (str, ""), "dec_seq": (int, 0), "images": (int, 1)}
# images: llava's images per row (model.args.images_per_row; scripts/bench/bench_vision.py)
# dec_seq: t5's decoder tokens per row (0: what its span objective makes from seq, padded to a multiple of 8)
ENCODER_MODELS = ("bert", "t5")  # their peer is peer_hf.py: BertForPreTraining / T5ForConditionalGeneration
POST = ("", "sft", "lora", "dpo")  # post: "" pretraining; else the post-training case (scripts/bench/peer_trl.py)


def parse_layout(layout: str) -> dict[str, int]:
    """"tp=2:pp=2" -> {"tp": 2, "pp": 2}; "" -> {}."""
    out = {}
    for part in filter(None, layout.split(":")):
        key, _, value = part.partition("=")
        if key not in DEGREES or not value.lstrip("-").isdigit():
            raise ValueError(f"layout {layout!r}: expected KEY=N joined by ':' with KEY in {DEGREES}, e.g. tp=2:pp=2")
        out[key] = int(value)
    return out


def _is_float(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _check_case(case: dict) -> dict:
    unknown = set(case) - set(AXES)
    if unknown:
        raise ValueError(f"unknown benchmark axes {sorted(unknown)}; known: {sorted(AXES)}")
    case = {k: AXES[k][0](v) for k, v in case.items()}
    if case["float8"] not in FLOAT8:
        raise ValueError(f"float8={case['float8']!r}: choose one of {FLOAT8}")
    if case["ac"] not in AC_MODES:
        raise ValueError(f"ac={case['ac']!r}: choose one of {AC_MODES}")
    if case["ac"] == "memory_budget" and not (_is_float(case["ac_option"]) and 0 <= float(case["ac_option"]) <= 1):
        raise ValueError(f"ac=memory_budget: ac_option={case['ac_option']!r} must be the budget, a number in [0, 1]")
    parse_layout(case["layout"])
    if case["post"] not in POST:
        raise ValueError(f"post={case['post']!r}: choose one of {POST[1:]} (or \"\" for pretraining)")
    if case["dec_seq"] and case["model"] != "t5":
        raise ValueError(f"dec_seq={case['dec_seq']} is t5's decoder length; model={case['model']!r} has no decoder")
    from bench_vision import check_case as check_vision

    check_vision(case)
    if case["peer_ac"] and case["peer_ac"].partition(":")[0] not in AC_MODES:
        raise ValueError(f"peer_ac={case['peer_ac']!r}: MODE or MODE:OPTION with MODE in {AC_MODES} "
                         f"(\"\": the same as ac)")
    return case


def peer_ac(case: dict) -> tuple[str, str]:
    """(mode, option) of the peer's activation checkpointing: peer_ac ("MODE[:OPTION]") where given, else ac's."""
    if not case["peer_ac"]:
        return case["ac"], case["ac_option"]
    mode, _, option = case["peer_ac"].partition(":")
    return mode, option or case["ac_option"]


def _product(values: dict) -> list[dict]:
    """{axis: value or list} -> every combination, in the order given."""
    lists = {k: v if isinstance(v, list) else [v] for k, v in values.items()}
    return [dict(zip(lists, combo)) for combo in itertools.product(*lists.values())]


def expand_matrix(cli_axes: dict[str, str | None], toml_text: str | None = None) -> list[dict]:
    """Cases: axis defaults < the TOML's [defaults] < the command line (comma lists; None = not given) < each
    TOML [[case]]; list values expand into their product."""
    doc = {}
    if toml_text:
        try:
            import tomllib
        except ImportError:  # Python 3.10
            import tomli as tomllib

        doc = tomllib.loads(toml_text)
        unknown_tables = set(doc) - {"defaults", "case"}
        if unknown_tables:
            raise ValueError(f"benchmark matrix: unknown tables {sorted(unknown_tables)}; use [defaults] and [[case]]")
    base = {k: default for k, (_, default) in AXES.items()}
    base.update(doc.get("defaults", {}))
    base.update({k: [x.strip() for x in str(v).split(",")] for k, v in cli_axes.items() if v is not None})
    cases = []
    for spec in doc.get("case", [{}]):
        cases += [_check_case(c) for c in _product({**base, **spec})]
    return cases


def label(case: dict) -> str:
    parts = [*([case["post"]] if case["post"] else []), *([case["model"]] if case["model"] != DEFAULT_MODEL else []),
             case["flavor"], *([f"s{case['seq']}"] if case["model"] != "vit" else []),  # (vit: one image a row)
             *([f"d{case['dec_seq']}"] if case["dec_seq"] else []),
             *([f"i{case['images']}"] if case["model"] == "llava" else []),
             f"b{case['batch']}", f"n{case['nproc']}",
             "compile" if case["compile"] else "eager", "bf16" if case["float8"] == "none" else f"fp8-{case['float8']}"]
    if case["ac"] != "none":
        parts.append(f"ac-{case['ac']}" + (f"-{case['ac_option']}" if case["ac"] != "full" else ""))
    if case["layout"]:
        parts.append(case["layout"])
    if case["loss_chunk"]:
        parts.append(f"ce{case['loss_chunk']}")
    if case["peer_ac"]:
        parts.append(f"peer-ac-{case['peer_ac'].replace(':', '-')}")
    return " ".join(parts)


def encoder_flags(case: dict, data: str) -> list[str]:
    """titanlike's flags for BERT and T5 cases. t5 with dec_seq: the span objective pads the decoder to a multiple of
    model.args.decoder_multiple, so that multiple = dec_seq makes every row's decoder exactly dec_seq tokens (on plain
    data, e.g. mock, and the FLOPs count follows), and data.decoder_seq_length = dec_seq does it on Megatron's T5 data
    (data.dataset=t5). bert on mock or stdlib data (the builtin tokenizer, which has no [MASK]): the mask id is the
    vocabulary's last row (mask_token_id = -1, a spare row past the tokenizer's tokens) instead of the flavor's 103."""
    n = case["dec_seq"]
    if case["model"] == "t5" and n:
        return [f"--model.args={{decoder_multiple = {n}}}", f"--data.decoder_seq_length={n}"]
    if case["model"] == "bert" and data in ("mock", "stdlib"):
        return ["--model.args={mask_token_id = -1}"]
    return []


def vocab_of(case: dict, opts) -> int:
    """--vocab, or without it the flavor's own vocabulary for BERT and T5 (30522, 32128), 256 for vit (pixel byte
    values: mock draws its images below it) and 128256 for the rest."""
    if case["model"] == "vit":
        return 256
    if opts.vocab:
        return opts.vocab
    if case["model"] in ENCODER_MODELS:
        import models

        return models.get_spec(case["model"]).flavors[case["flavor"]].vocab_size
    return 128256
