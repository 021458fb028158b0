"""Tokenizers behind one small interface, all loaded from local files (never the network).

`build_tokenizer(data_cfg)` resolves `data.tokenizer_type` (Megatron's names are accepted) and the file fields:
  * builtin: a byte-level BPE trained on the stdlib corpus (see titanlike/data/stdlib_corpus.py) the first time it
    is needed and cached as `<cache>/tokenizer/bpe<vocab>-<fingerprint>/tokenizer.json`; later runs just load it.
  * HuggingFaceTokenizer: an HF `tokenizer.json` (or a folder holding one).
  * GPT2BPETokenizer: GPT-2 `vocab.json` + `merges.txt` (data.vocab_file / data.merge_file), as Megatron uses.
  * TikTokenizer / Llama3Tokenizer: a tiktoken BPE rank file (a `tokenizer.model` of base64 ranks) with its 256
    special tokens (titanlike/data/tokenizers/tiktoken_bpe.py).
  * SentencePieceTokenizer / Llama2Tokenizer: a sentencepiece `.model`, with data.vocab_extra_ids T5 sentinels
    appended as HF's T5Tokenizer does (titanlike/data/tokenizers/sentencepiece_model.py).
  * BertWordPieceLowerCase / BertWordPieceCase: a BERT `vocab.txt` (data.vocab_file), as Megatron's BERT and T5
    read it, with [CLS] [SEP] [MASK] [PAD] and data.vocab_extra_ids T5 sentinels
    (titanlike/data/tokenizers/bert_wordpiece.py).
  * NullTokenizer: text of space-separated integer ids (Megatron's, for pre-tokenised data and tests).
"auto" picks one from the files given. Every tokenizer exposes bos_id, eos_id and eod_id (the separator appended
after each document; by default the EOS token), each overridable by token name in the config.

A file that is not what its format needs is one ValueError naming the path, what is wrong and the fix. The fix
names the settings of the caller: `data.*` keys, or what `data_cfg.knob_names` maps them to (scripts/preprocess_data.py
passes its --flags).
"""
from __future__ import annotations

import re
from pathlib import Path

from titanlike.config.validate_data import TOKENIZER_TYPES  # the config's list (also re-exported here)
from titanlike.data.tokenizers.base import Tokenizer, TokenizerFileError
from titanlike.data.tokenizers.hf import TOKENIZER_TRAIN_MAX_BYTES, HFTokenizer, builtin_tokenizer, gpt2_bpe_tokenizer


def _sniff_model_file(path: Path) -> str:
    """A `tokenizer.model` is either a tiktoken rank file (text lines "<base64> <rank>") or a sentencepiece proto."""
    with open(path, "rb") as f:
        head = f.readline(200)
    return "tiktoken" if re.fullmatch(rb"[A-Za-z0-9+/=]+ \d+\r?\n?", head) else "sentencepiece"


def knob(data_cfg, field: str) -> str:
    """How the caller spells a [data] field: "data.<field>" for training, a --flag for preprocessing."""
    return getattr(data_cfg, "knob_names", {}).get(field, f"data.{field}")


def resolve_tokenizer_kind(data_cfg) -> tuple[str, Path | None]:
    """(kind, main file) from data.tokenizer_type + data.tokenizer / tokenizer_model / vocab_file."""
    type_name = data_cfg.tokenizer_type
    kind = TOKENIZER_TYPES.get(type_name.lower())
    if kind is None:
        raise ValueError(f"{knob(data_cfg, 'tokenizer_type')}={type_name!r} is not known; use one of auto, builtin, "
                         "HuggingFaceTokenizer, GPT2BPETokenizer, TikTokenizer (Llama3Tokenizer), "
                         "SentencePieceTokenizer (Llama2Tokenizer), BertWordPieceLowerCase, BertWordPieceCase, "
                         "NullTokenizer")
    if kind in ("bert_lower", "bert_case"):
        return kind, None
    spec = data_cfg.tokenizer_model or data_cfg.tokenizer
    if kind == "builtin" or (kind == "auto" and spec == "builtin" and not data_cfg.vocab_file):
        return "builtin", None
    if kind in ("gpt2", "null") or (kind == "auto" and data_cfg.vocab_file):
        return ("null" if kind == "null" else "gpt2"), None
    path = Path(spec).expanduser()
    if path.is_dir():
        for name, k in (("tokenizer.json", "hf"), ("tokenizer.model", None)):
            if (path / name).is_file() and kind in ("auto", k or kind):
                path = path / name
                break
        else:
            if (path / "vocab.json").is_file() and (path / "merges.txt").is_file() and kind == "auto":
                return "gpt2", path
    if not path.is_file():
        raise FileNotFoundError(
            f"{_file_knob(data_cfg)}={spec!r}: no tokenizer file at {path}. Give the path of an HF tokenizer.json "
            "(or of a folder holding one), a tiktoken/sentencepiece tokenizer.model, or GPT-2 files via "
            f"{knob(data_cfg, 'vocab_file')} + {knob(data_cfg, 'merge_file')}; or leave it unset for the builtin "
            "byte-level BPE."
        )
    if kind == "auto":
        kind = "hf" if path.suffix == ".json" else _sniff_model_file(path)
    return kind, path


def _file_knob(data_cfg) -> str:
    return knob(data_cfg, "tokenizer_model" if data_cfg.tokenizer_model else "tokenizer")


_FORMATS = {"bert_lower": "a BERT vocab.txt", "bert_case": "a BERT vocab.txt",
            "hf": "a Hugging Face tokenizer.json", "tiktoken": "a tiktoken rank file",
            "sentencepiece": "a sentencepiece model", "gpt2": "GPT-2 vocab.json + merges.txt"}


def build_tokenizer(data_cfg, *, max_train_bytes: int | None = TOKENIZER_TRAIN_MAX_BYTES) -> Tokenizer:
    """The data config's tokenizer (see the module doc), with its bos/eos/eod overrides applied."""
    kind, path = resolve_tokenizer_kind(data_cfg)
    try:
        tok = _load(kind, path, data_cfg, max_train_bytes)
    except TokenizerFileError as e:  # garbage or the wrong format: say which file and what to set
        if kind == "builtin":  # our own cache file, damaged (a disk fault, a killed copy)
            raise ValueError(f"{e}: the cached builtin tokenizer is damaged; delete that file and it is rebuilt "
                             "on the next start") from None
        type_knob = knob(data_cfg, "tokenizer_type")
        auto = TOKENIZER_TYPES[data_cfg.tokenizer_type.lower()] == "auto"
        how = f"; {type_knob}=auto took it for {_FORMATS[kind]}" if auto else ""
        files = (f"{knob(data_cfg, 'vocab_file')} / {knob(data_cfg, 'merge_file')}" if kind == "gpt2"
                 else knob(data_cfg, "vocab_file") if kind.startswith("bert") else _file_knob(data_cfg))
        raise ValueError(f"{e}{how}: point {files} at the tokenizer file(s) the data and model use, or set "
                         f"{type_knob} to the file's format (HuggingFaceTokenizer, TikTokenizer, "
                         "SentencePieceTokenizer, GPT2BPETokenizer)") from None
    return apply_special_overrides(tok, data_cfg)


def _load(kind: str, path: Path | None, data_cfg, max_train_bytes: int | None) -> Tokenizer:
    if kind == "builtin":
        tok = builtin_tokenizer(data_cfg.builtin_vocab_size, data_cfg.cache_dir, max_train_bytes)
    elif kind == "hf":
        tok = HFTokenizer(path, bos_token=data_cfg.bos_token or None, eos_token=data_cfg.eos_token or None)
    elif kind == "gpt2":
        vocab, merges = data_cfg.vocab_file, data_cfg.merge_file
        if path is not None and not vocab:  # a folder holding vocab.json + merges.txt
            vocab, merges = path / "vocab.json", path / "merges.txt"
        v_knob, m_knob = knob(data_cfg, "vocab_file"), knob(data_cfg, "merge_file")
        if not vocab or not merges:
            raise ValueError(f"GPT2BPETokenizer needs {v_knob} (vocab.json) and {m_knob} (merges.txt)")
        for key, f in ((v_knob, vocab), (m_knob, merges)):
            if not Path(f).is_file():
                raise FileNotFoundError(f"{key}={str(f)!r}: no such file; GPT2BPETokenizer needs GPT-2's vocab.json "
                                        f"and merges.txt (set {v_knob} and {m_knob})")
        tok = gpt2_bpe_tokenizer(vocab, merges)
    elif kind in ("bert_lower", "bert_case"):
        from titanlike.data.tokenizers.bert_wordpiece import BertWordPieceTokenizer

        v_knob = knob(data_cfg, "vocab_file")
        if not data_cfg.vocab_file:
            raise ValueError(f"{data_cfg.tokenizer_type} needs {v_knob}: the BERT vocab.txt (one token a line)")
        tok = BertWordPieceTokenizer(data_cfg.vocab_file, lower_case=kind == "bert_lower",
                                     vocab_extra_ids=getattr(data_cfg, "vocab_extra_ids", 0))
    elif kind == "tiktoken":
        from titanlike.data.tokenizers.tiktoken_bpe import TiktokenTokenizer

        tok = TiktokenTokenizer(path)
    elif kind == "sentencepiece":
        from titanlike.data.tokenizers.sentencepiece_model import SentencePieceTokenizer

        tok = SentencePieceTokenizer(path, vocab_extra_ids=getattr(data_cfg, "vocab_extra_ids", 0))
    else:
        from titanlike.data.tokenizers.null import NullTokenizer

        tok = NullTokenizer(data_cfg.builtin_vocab_size)  # ids below data.builtin_vocab_size
    return tok


def apply_special_overrides(tok: Tokenizer, data_cfg) -> Tokenizer:
    """data.bos_token / eos_token / eod_token name tokens explicitly; an unknown name is an error, not a guess."""
    for attr, name in (("bos", data_cfg.bos_token), ("eos", data_cfg.eos_token), ("eod", data_cfg.eod_token)):
        if not name:
            continue
        tid = tok.token_to_id(name)
        if tid is None:
            raise ValueError(f"{knob(data_cfg, attr + '_token')}={name!r} is not a token of {tok!r}; give the exact "
                             "text of one of "
                             "its special tokens (e.g. <|end_of_text|>, </s>, <|endoftext|>) or leave it empty")
        setattr(tok, f"{attr}_id", tid)
    return tok
