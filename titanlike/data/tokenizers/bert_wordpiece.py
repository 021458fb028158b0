"""Megatron's BertWordPieceLowerCase / BertWordPieceCase: a BERT `vocab.txt` (one WordPiece token a line, the line
number its id), read by the `tokenizers` library's BertWordPieceTokenizer.

As Megatron's tokenizer, it adds "[BOS]" and "[EOS]" after the vocabulary when the file lacks them, then
`vocab_extra_ids` sentinels "<extra_id_0>", ... (T5's span markers; Megatron's --vocab-extra-ids); a vocabulary that
already holds "<extra_id_N>" tokens keeps them and their ids. The masked datasets (titanlike/data/bert_dataset.py,
t5_dataset.py) read `cls_id`, `sep_id`, `pad_id`, `mask_id`, `sentinel_ids` and `continuation` (which ids are "##"
word pieces, for whole-word masking); `require(...)` turns a missing one into one line naming the fix.
"""
from __future__ import annotations

import hashlib
import re
from functools import cached_property
from pathlib import Path
from typing import Sequence

import numpy as np

from titanlike.data.tokenizers.base import Tokenizer, TokenizerFileError

_SENTINEL = re.compile(r"<extra_id_(\d+)>")
_SPECIALS = {"cls": "[CLS]", "sep": "[SEP]", "pad": "[PAD]", "mask": "[MASK]", "unk": "[UNK]"}


class BertWordPieceTokenizer(Tokenizer):
    """WordPiece over a BERT vocab.txt; `lower_case` as Megatron's BertWordPieceLowerCase (True) / Case (False)."""

    def __init__(self, vocab_file: str | Path, lower_case: bool = True, vocab_extra_ids: int = 0):
        from tokenizers import BertWordPieceTokenizer as _WordPiece

        self.path, self.lower_case, self.vocab_extra_ids = Path(vocab_file), bool(lower_case), int(vocab_extra_ids)
        lines = self._read_lines()
        try:
            self._tok = _WordPiece(str(self.path), lowercase=self.lower_case, strip_accents=self.lower_case)
        except Exception as e:  # tokenizers raises a bare Exception for an unreadable vocabulary
            raise TokenizerFileError(f"{self.path}: not a BERT vocab.txt ({str(e).splitlines()[0]})") from None
        # Megatron's additions, in its order: [BOS], [EOS], then the sentinels not already in the vocabulary.
        have = set(lines)
        extra = [t for t in ("[BOS]", "[EOS]") if t not in have]
        extra += [f"<extra_id_{i}>" for i in range(self.vocab_extra_ids) if f"<extra_id_{i}>" not in have]
        if extra:
            self._tok.add_special_tokens(extra)
        # Lines that are special tokens of the vocabulary must stay whole: "[MASK]" in a text is not three pieces.
        self._tok.add_special_tokens([t for t in lines if t.startswith("[") and t.endswith("]") or _SENTINEL.match(t)])
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        ids = {k: self._tok.token_to_id(t) for k, t in _SPECIALS.items()}
        self.cls_id, self.sep_id, self.pad_id, self.mask_id, self.unk_id = (ids[k] for k in _SPECIALS)
        self.bos_id, self.eos_id = self._tok.token_to_id("[BOS]"), self._tok.token_to_id("[EOS]")
        vocab = self._tok.get_vocab(with_added_tokens=True)
        found = sorted((int(m.group(1)), i) for t, i in vocab.items() if (m := _SENTINEL.fullmatch(t)))
        self.sentinel_ids = [i for _, i in found]

    def _read_lines(self) -> list[str]:
        if not self.path.is_file():
            raise FileNotFoundError(f"{self.path}: no such vocab.txt")
        try:
            lines = self.path.read_text(encoding="utf-8").splitlines()
        except UnicodeDecodeError:
            raise TokenizerFileError(f"{self.path}: not a BERT vocab.txt (not UTF-8 text)") from None
        if not lines or any(" " in t.strip() for t in lines[:1000]) or lines[0].lstrip().startswith("{"):
            raise TokenizerFileError(f"{self.path}: not a BERT vocab.txt (expected one WordPiece token a line)")
        return [t.rstrip("\r") for t in lines]

    def require(self, what: str, dataset: str) -> None:
        """One line when the vocabulary lacks what `dataset` needs: "cls", "sep", "pad", "mask" or "sentinels"."""
        if what == "sentinels":
            if not self.sentinel_ids:
                raise ValueError(f"data.dataset={dataset!r} needs sentinel tokens <extra_id_0>, ... for its spans but "
                                 f"{self.path} has none: set data.vocab_extra_ids (Megatron's --vocab-extra-ids, "
                                 "e.g. 100) to add them")
            return
        if getattr(self, f"{what}_id") is None:
            raise ValueError(f"data.dataset={dataset!r} needs a {_SPECIALS[what]} token but {self.path} has none: "
                             f"add a line {_SPECIALS[what]} to the vocab.txt (BERT vocabularies hold [PAD], [UNK], "
                             "[CLS], [SEP], [MASK])")

    @cached_property
    def continuation(self) -> np.ndarray:
        """bool[vocab_size]: True for "##" pieces, which continue the word before them (whole-word masking)."""
        out = np.zeros(self.vocab_size, dtype=bool)
        for t, i in self._tok.get_vocab(with_added_tokens=True).items():
            out[i] = t.startswith("##")
        return out

    def encode(self, text: str, bos: bool = False, eos: bool = False) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids  # no [CLS]/[SEP]: the datasets add them
        return ([self.bos_id] if bos else []) + ids + ([self.eos_id] if eos else [])

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)

    def token_to_id(self, name: str) -> int | None:
        return self._tok.token_to_id(name)

    def id_to_token(self, i: int) -> str | None:
        return self._tok.id_to_token(int(i))

    @cached_property
    def fingerprint(self) -> str:
        h = hashlib.sha256(self.path.read_bytes())
        h.update(f"|lower={self.lower_case}|extra={self.vocab_extra_ids}".encode())
        return h.hexdigest()

    def __repr__(self) -> str:
        kind = "BertWordPieceLowerCase" if self.lower_case else "BertWordPieceCase"
        return f"{kind}({str(self.path)!r}, vocab_size={self.vocab_size}, sentinels={len(self.sentinel_ids)})"
