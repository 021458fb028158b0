"""Data and validation-data rules of the config (called by validate.validate), and the data vocabulary they check:
the dataset kinds, the tokenizer type names, Megatron's blend and split syntax. The config is the bottom layer, so
these live here and titanlike.data builds on them (its DATASETS must have exactly DATASET_NAMES' keys: a test checks),
which also lets the data package raise ConfigError."""
from __future__ import annotations

import math
from typing import Any

# titanlike.data.dataset.DATASETS
DATASET_NAMES = ("stdlib", "mock", "indexed", "text", "chat", "preference", "bert", "t5", "shapes", "image_folder",
                 "shapes_captions", "webdataset", "mock_image_text")
WDS_TARGETS = ("txt", "json", "cls")  # data.wds_target: titanlike/data/webdataset.py
WDS_LAYOUTS = ("pad", "pack")  # data.wds_layout: titanlike/data/webdataset_pack.py
BAD_SAMPLES = ("error", "skip")
SFT_LAYOUTS = ("pack", "pad")  # chat data: titanlike/data/sft.py
SFT_TRUNCATION = ("truncate", "drop")

# Megatron's --tokenizer-type names (and short ones) -> the kind titanlike.data.tokenizers builds.
TOKENIZER_TYPES = {
    "auto": "auto", "builtin": "builtin",
    "huggingfacetokenizer": "hf", "hf": "hf",
    "gpt2bpetokenizer": "gpt2", "gpt2": "gpt2",
    "tiktokenizer": "tiktoken", "llama3tokenizer": "tiktoken", "tiktoken": "tiktoken",
    "sentencepiecetokenizer": "sentencepiece", "gptsentencepiecetokenizer": "sentencepiece",
    "llama2tokenizer": "sentencepiece", "sentencepiece": "sentencepiece",
    "nulltokenizer": "null", "null": "null",
    "bertwordpiecelowercase": "bert_lower", "bertwordpiececase": "bert_case",  # a BERT vocab.txt (vocab_file)
}

VALIDATION_SPLITS = ("train", "valid", "test")


def parse_split(split: str) -> list[float]:
    """ "949,50,1" (or "949/50/1", or fewer parts) -> normalised [train, valid, test] fractions."""
    parts = [p for p in str(split).replace("/", ",").split(",") if p.strip()]
    try:
        values = [float(p) for p in parts]
    except ValueError:
        values = []
    if not 1 <= len(values) <= 3 or any(not math.isfinite(v) or v < 0 for v in values) or sum(values) <= 0:
        raise ValueError(f"data.split={split!r}: expected up to three non-negative numbers for train,valid,test "
                         "shares, e.g. \"949,50,1\" or \"98,2,0\"")
    values += [0.0] * (3 - len(values))
    total = sum(values)
    return [v / total for v in values]


def parse_blend(paths, key: str = "data.paths") -> tuple[list[str], list[float] | None]:
    """Megatron's blend: "0.3 a 0.7 b" (weights and prefixes alternating) or plain prefixes -> (prefixes, weights)."""
    items = " ".join(paths if isinstance(paths, (list, tuple)) else [paths]).split()
    if not items:
        raise ValueError(f"{key} is empty: give Megatron-style prefixes, e.g. --{key} \"0.3 /data/a 0.7 /data/b\"")

    def num(s):
        try:
            return float(s)
        except ValueError:
            return None

    nums = [num(s) for s in items]
    if all(n is None for n in nums):
        return items, None
    if len(items) % 2 or any(n is None for n in nums[0::2]) or any(n is not None for n in nums[1::2]):
        where = next((f"{items[i]!r} at position {i + 1} should be a weight" for i in range(0, len(items), 2)
                      if nums[i] is None), None)
        where = where or next((f"{items[i]!r} at position {i + 1} should be a prefix" for i in range(1, len(items), 2)
                               if nums[i] is not None), "the last weight has no prefix")
        raise ValueError(f"{key}={' '.join(items)!r}: cannot parse the blend ({where}); write "
                         "\"weight prefix weight prefix ...\", e.g. \"0.3 /data/a_text_document 0.7 /data/b\", "
                         "or prefixes only")
    weights = nums[0::2]
    if any(not math.isfinite(w) or w <= 0 for w in weights):
        raise ValueError(f"{key}: blend weights must be positive numbers, got {weights}")
    return items[1::2], weights


def _check_paths(dataset: str, paths: list[str], split: str, key: str, errors: list[str]) -> None:
    if dataset in ("indexed", "text", "chat", "preference", "bert", "t5", "image_folder", "webdataset") and not paths:
        what = {"indexed": "Megatron .bin/.idx prefixes, optionally weighted: "
                           "\"0.3 /data/a_text_document 0.7 /data/b\"",
                "bert": "sentence-split .bin/.idx prefixes (scripts/preprocess_data.py --split-sentences)",
                "t5": "sentence-split .bin/.idx prefixes (scripts/preprocess_data.py --split-sentences)",
                "text": "JSONL/Parquet/text files, globs or folders",
                "chat": "JSONL/Parquet conversation files, globs, or folders saved by datasets' save_to_disk",
                "preference": "JSONL files of {\"prompt\", \"chosen\", \"rejected\"} pairs",
                "image_folder": "one root folder in ImageNet's layout (ROOT/train/<class>/*.JPEG, ROOT/val/..)",
                "webdataset": ".tar shards: files, a brace pattern (\"/data/shards-{000000..000099}.tar\"), a glob "
                              "or a folder"}[dataset]
        errors.append(f"{key} is empty but the dataset is {dataset!r}: give {what}")
    elif dataset in ("stdlib", "mock", "shapes", "shapes_captions", "mock_image_text") and paths:
        errors.append(f"{key}={paths} is set but the dataset is {dataset!r}, which reads no files; set "
                      "data.dataset=indexed (Megatron .bin/.idx prefixes) or data.dataset=text (JSONL/Parquet/text)")
    elif dataset == "chat":
        try:
            parse_split(split)
        except ValueError as e:
            errors.append(str(e))
    elif dataset in ("indexed", "bert", "t5"):
        for fn, arg in ((parse_blend, (paths, key)), (parse_split, (split,))):
            try:
                fn(*arg)
            except ValueError as e:
                errors.append(str(e))


def check_data(cfg: Any, errors: list[str]) -> None:
    d, v = cfg.data, cfg.validation
    if d.dataset not in DATASET_NAMES:
        errors.append(f"data.dataset={d.dataset!r} is not one of {', '.join(DATASET_NAMES)}")
        return
    _check_paths(d.dataset, d.paths, d.split, "data.paths", errors)
    if d.tokenizer_type.lower() not in TOKENIZER_TYPES:
        errors.append(f"data.tokenizer_type={d.tokenizer_type!r} is not known; use auto, builtin, "
                      "HuggingFaceTokenizer, GPT2BPETokenizer, TikTokenizer, SentencePieceTokenizer or "
                      "NullTokenizer (Megatron's aliases of these are accepted too)")
    if d.tokenizer_model and d.tokenizer not in ("builtin", d.tokenizer_model):
        errors.append(f"data.tokenizer={d.tokenizer!r} and data.tokenizer_model={d.tokenizer_model!r} name "
                      "different files; set only one")
    bert_vocab = TOKENIZER_TYPES.get(d.tokenizer_type.lower(), "").startswith("bert")  # vocab.txt, no merges
    if bool(d.vocab_file) != bool(d.merge_file) and not bert_vocab:
        errors.append("GPT-2 BPE needs both data.vocab_file (vocab.json) and data.merge_file (merges.txt)")
    _check_chat(d, errors)
    _check_masked(d, errors)
    _check_images(d, errors)
    if v.split not in VALIDATION_SPLITS:
        errors.append(f"validation.split={v.split!r} is not one of {', '.join(VALIDATION_SPLITS)}")
    v_dataset = v.dataset or d.dataset
    if v.dataset and v.dataset not in DATASET_NAMES:
        errors.append(f"validation.dataset={v.dataset!r} is not one of {', '.join(DATASET_NAMES)} (or \"\" for "
                      "data.dataset)")
    elif v.paths:
        _check_paths(v_dataset, v.paths, "0,100,0", "validation.paths", errors)
    elif v.enable and v_dataset in ("text", "webdataset"):
        errors.append(f"validation.enable with data.dataset={v_dataset!r} needs validation.paths (held-out "
                      f"{'files' if v_dataset == 'text' else 'shards'}): they have no split, so validation would "
                      "score training samples")
    elif v.enable and v.dataset and v.dataset != d.dataset and v_dataset in ("indexed", "chat"):
        errors.append(f"validation.dataset={v.dataset!r} differs from data.dataset; give validation.paths too")


def _check_images(d: Any, errors: list[str]) -> None:
    """The webdataset / image keys (titanlike/data/webdataset.py); checked whatever the dataset."""
    if d.wds_target not in WDS_TARGETS:
        errors.append(f"data.wds_target={d.wds_target!r} is not one of {', '.join(WDS_TARGETS)} (the shard member "
                      "holding the target: caption, conversation or class)")
    if d.bad_samples not in BAD_SAMPLES:
        errors.append(f"data.bad_samples={d.bad_samples!r} is not one of {', '.join(BAD_SAMPLES)}")
    for key in ("image_size", "image_tokens"):
        if getattr(d, key) < 0:
            errors.append(f"data.{key}={getattr(d, key)} must be >= 0")
    if d.wds_layout not in WDS_LAYOUTS:
        errors.append(f"data.wds_layout={d.wds_layout!r} is not one of {', '.join(WDS_LAYOUTS)} (one sample a row, or "
                      "samples packed end to end)")
    if not 0 <= d.caption_digits <= 1:
        errors.append(f"data.caption_digits={d.caption_digits} must be in [0, 1] (the share of shapes_captions images "
                      "carrying a digit; 0 = none)")
    if d.images_per_row < 1:
        errors.append(f"data.images_per_row={d.images_per_row} must be >= 1 (image slots per row: mock_image_text, "
                      "webdataset llava rows)")


def _check_chat(d: Any, errors: list[str]) -> None:
    """The chat (supervised fine-tuning) keys; checked whatever the dataset, so a typo fails before it matters."""
    for key, allowed in (("sft_layout", SFT_LAYOUTS), ("sft_truncation", SFT_TRUNCATION)):
        if getattr(d, key) not in allowed:
            errors.append(f"data.{key}={getattr(d, key)!r} is not one of {', '.join(allowed)}")
    for key in ("messages_key", "prompt_key", "response_key"):
        if not getattr(d, key):
            errors.append(f"data.{key} is empty: name the record field (default {key.split('_')[0]!r})")
    if d.dataset == "chat" and d.prompt_key == d.response_key:
        errors.append(f"data.prompt_key and data.response_key are both {d.prompt_key!r}: name two different fields")


def _check_masked(d: Any, errors: list[str]) -> None:
    """The bert / t5 keys (titanlike/data/bert_dataset.py, t5_dataset.py); checked whatever the dataset."""
    for key in ("mask_prob", "noise_density"):
        if not 0 < getattr(d, key) < 1:
            errors.append(f"data.{key}={getattr(d, key)} must be in (0, 1) (the share of tokens masked, e.g. 0.15)")
    if not 0 <= d.short_seq_prob <= 1:
        errors.append(f"data.short_seq_prob={d.short_seq_prob} must be in [0, 1] (e.g. 0.1)")
    if d.mean_span_length < 1:
        errors.append(f"data.mean_span_length={d.mean_span_length} must be >= 1 (tokens per span, e.g. 5)")
    if d.decoder_seq_length < 2:
        errors.append(f"data.decoder_seq_length={d.decoder_seq_length} must be >= 2 (t5's decoder length, e.g. 128)")
    _check_ul2(d, errors)
    if d.vocab_extra_ids < 0:
        errors.append(f"data.vocab_extra_ids={d.vocab_extra_ids} must be >= 0 (sentinels to add, e.g. 100 for t5)")
    if d.dataset in ("bert", "t5") and not TOKENIZER_TYPES.get(d.tokenizer_type.lower(), "").startswith("bert"):
        errors.append(f"data.dataset={d.dataset!r} needs a BERT WordPiece vocabulary: set data.tokenizer_type="
                      "BertWordPieceLowerCase (or BertWordPieceCase) and data.vocab_file=<vocab.txt>")
    elif d.dataset in ("bert", "t5") and not d.vocab_file:
        errors.append(f"data.dataset={d.dataset!r} with data.tokenizer_type={d.tokenizer_type} needs "
                      "data.vocab_file (the BERT vocab.txt)")


def _check_ul2(d: Any, errors: list[str]) -> None:
    """data.t5_denoisers and the UL2 mixture (titanlike/data/t5_dataset.py); the mode tokens are checked against the
    tokenizer when the data is built."""
    if d.t5_denoisers not in ("span", "ul2"):
        errors.append(f"data.t5_denoisers={d.t5_denoisers!r}: choose \"span\" (T5's span corruption) or \"ul2\" "
                      "(UL2's mixture of denoisers)")
        return
    if d.t5_denoisers != "ul2":
        return
    if d.dataset != "t5":
        errors.append(f"data.t5_denoisers=\"ul2\" shapes Megatron's T5 samples; it needs data.dataset=\"t5\", not "
                      f"{d.dataset!r} (or set data.t5_denoisers=\"span\")")
    kinds, means, dens, probs = d.ul2_kinds, d.ul2_mean_span_lengths, d.ul2_noise_densities, d.ul2_probabilities
    if not kinds or not len(kinds) == len(means) == len(dens) == len(probs):
        errors.append(f"data.ul2_kinds / ul2_mean_span_lengths / ul2_noise_densities / ul2_probabilities have "
                      f"{len(kinds)} / {len(means)} / {len(dens)} / {len(probs)} entries: give one per denoiser")
        return
    if bad := [k for k in kinds if k not in ("R", "S", "X")]:
        errors.append(f"data.ul2_kinds has {bad}: each entry is \"R\" (regular spans), \"S\" (prefix LM) or \"X\" "
                      "(extreme: long spans or a high density)")
    if any(p < 0 for p in probs) or abs(sum(probs) - 1) > 1e-6:
        errors.append(f"data.ul2_probabilities={list(probs)} sum to {sum(probs):.6g}: give non-negative shares "
                      f"adding up to 1, one per data.ul2_kinds entry")
    if bad := [x for x in dens if not 0 < x < 1]:
        errors.append(f"data.ul2_noise_densities has {bad}: each must be in (0, 1) (e.g. 0.15, X: 0.5)")
    if bad := [m for k, m in zip(kinds, means) if k != "S" and m < 1]:
        errors.append(f"data.ul2_mean_span_lengths has {bad} for an R/X denoiser: each must be >= 1 (tokens per "
                      "span, e.g. 3, X: 32)")


def advise_data(cfg: Any) -> list[str]:
    """Data settings that work but may not do what was meant (validate.advise prints them)."""
    d = cfg.data
    if d.dataset == "webdataset" and d.wds_layout == "pack" and not (d.document_masking and d.reset_position_ids):
        return ["data.wds_layout='pack' without data.document_masking and data.reset_position_ids: packed samples "
                "attend to the ones before them in their row (their images too) or see shifted positions; set both "
                "to true to keep each sample alone, as it is at inference"]
    if d.dataset == "chat" and d.sft_layout == "pack" and not d.document_masking:
        return ["data.sft_layout='pack' without data.document_masking: packed conversations attend to the ones "
                "before them in their row; set data.document_masking=true (and data.reset_position_ids=true) to keep "
                "each one alone, as it is at inference"]
    return []
