"""Megatron's NullTokenizer: the text is already token ids ("12 7 993"); EOD is the id just past the vocabulary."""
from __future__ import annotations

import hashlib
from typing import Sequence

from titanlike.data.tokenizers.base import Tokenizer


class NullTokenizer(Tokenizer):
    def __init__(self, vocab_size: int):
        if vocab_size < 1:
            raise ValueError(f"NullTokenizer needs a vocabulary size >= 1 (--vocab-size), got {vocab_size}")
        self.base_vocab = int(vocab_size)
        self.vocab_size = self.base_vocab + 1  # + EOD, as in Megatron
        self.bos_id = self.eos_id = self.base_vocab

    def encode(self, text: str, bos: bool = False, eos: bool = False) -> list[int]:
        try:
            ids = [int(t) for t in text.split()]
        except ValueError as e:
            raise ValueError(f"NullTokenizer expects space-separated integers ({e})") from None
        if ids and not 0 <= min(ids) <= max(ids) < self.base_vocab:
            raise ValueError(f"NullTokenizer: id out of [0, {self.base_vocab})")
        return ([self.bos_id] if bos else []) + ids + ([self.eos_id] if eos else [])

    def decode(self, ids: Sequence[int]) -> str:
        return " ".join(str(int(i)) for i in ids)

    @property
    def fingerprint(self) -> str:
        return hashlib.sha256(f"null{self.base_vocab}".encode()).hexdigest()
