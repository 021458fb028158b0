"""Data and validation-data rules of the config (called by validate.validate). The dataset kinds and tokenizer names
are the data package's own lists, so the config cannot accept one the loader lacks."""
from __future__ import annotations

from typing import Any

from titanlike.data.dataset import DATASETS

VALIDATION_SPLITS = ("train", "valid", "test")


def _check_paths(dataset: str, paths: list[str], split: str, key: str, errors: list[str]) -> None:
    if dataset in ("indexed", "text") and not paths:
        what = ("Megatron .bin/.idx prefixes, optionally weighted: \"0.3 /data/a_text_document 0.7 /data/b\""
                if dataset == "indexed" else "JSONL/Parquet/text files, globs or folders")
        errors.append(f"{key} is empty but the dataset is {dataset!r}: give {what}")
    elif dataset in ("stdlib", "mock") and paths:
        errors.append(f"{key}={paths} is set but the dataset is {dataset!r}, which reads no files; set "
                      "data.dataset=indexed (Megatron .bin/.idx prefixes) or data.dataset=text (JSONL/Parquet/text)")
    elif dataset == "indexed":
        from titanlike.data.gpt_dataset import parse_blend, parse_split

        for fn, arg in ((parse_blend, (paths, key)), (parse_split, (split,))):
            try:
                fn(*arg)
            except ValueError as e:
                errors.append(str(e))


def check_data(cfg: Any, errors: list[str]) -> None:
    d, v = cfg.data, cfg.validation
    if d.dataset not in DATASETS:
        errors.append(f"data.dataset={d.dataset!r} is not one of {', '.join(DATASETS)}")
        return
    _check_paths(d.dataset, d.paths, d.split, "data.paths", errors)
    from titanlike.data.tokenizers import TOKENIZER_TYPES  # the tokenizer builder's own list

    if d.tokenizer_type.lower() not in TOKENIZER_TYPES:
        errors.append(f"data.tokenizer_type={d.tokenizer_type!r} is not known; use auto, builtin, "
                      "HuggingFaceTokenizer, GPT2BPETokenizer, TikTokenizer, SentencePieceTokenizer or "
                      "NullTokenizer (Megatron's aliases of these are accepted too)")
    if d.tokenizer_model and d.tokenizer not in ("builtin", d.tokenizer_model):
        errors.append(f"data.tokenizer={d.tokenizer!r} and data.tokenizer_model={d.tokenizer_model!r} name "
                      "different files; set only one")
    if bool(d.vocab_file) != bool(d.merge_file):
        errors.append("GPT-2 BPE needs both data.vocab_file (vocab.json) and data.merge_file (merges.txt)")
    if v.split not in VALIDATION_SPLITS:
        errors.append(f"validation.split={v.split!r} is not one of {', '.join(VALIDATION_SPLITS)}")
    v_dataset = v.dataset or d.dataset
    if v.dataset and v.dataset not in DATASETS:
        errors.append(f"validation.dataset={v.dataset!r} is not one of {', '.join(DATASETS)} (or \"\" for "
                      "data.dataset)")
    elif v.paths:
        _check_paths(v_dataset, v.paths, "0,100,0", "validation.paths", errors)
    elif v.enable and v_dataset == "text":
        errors.append("validation.enable with a streaming text dataset needs validation.paths (held-out files): "
                      "text files have no split, so validation would score training documents")
    elif v.enable and v.dataset and v.dataset != d.dataset and v_dataset in ("indexed",):
        errors.append(f"validation.dataset={v.dataset!r} differs from data.dataset; give validation.paths too")
