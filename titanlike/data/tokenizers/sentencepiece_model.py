"""sentencepiece `.model` files (Llama 2, Mistral, Gemma-style; Megatron's SentencePieceTokenizer)."""
from __future__ import annotations

import hashlib
from functools import cached_property
from pathlib import Path
from typing import Sequence

from titanlike.data.tokenizers.base import Tokenizer, TokenizerFileError


class SentencePieceTokenizer(Tokenizer):
    def __init__(self, path: str | Path):
        try:
            import sentencepiece as spm
        except ImportError as e:
            raise ImportError("the sentencepiece tokenizer format needs the `sentencepiece` package: "
                              "pip install sentencepiece") from e
        self.path = Path(path)
        self._sp = spm.SentencePieceProcessor()
        try:
            self._sp.Load(str(self.path))
        except (OSError, RuntimeError) as e:
            why = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise TokenizerFileError(f"{self.path}: not a sentencepiece model ({why})") from None
        self.vocab_size = self._sp.GetPieceSize()
        eos = self._sp.eos_id()
        if eos < 0:
            raise ValueError(f"{self.path}: the sentencepiece model has no EOS piece; name one with data.eos_token")
        self.eos_id = eos
        bos = self._sp.bos_id()
        self.bos_id = bos if bos >= 0 else eos

    def encode(self, text: str, bos: bool = False, eos: bool = False) -> list[int]:
        # Control pieces (<s>, </s>) are never produced from text by sentencepiece: markup in data stays data.
        ids = self._sp.EncodeAsIds(text)
        return ([self.bos_id] if bos else []) + ids + ([self.eos_id] if eos else [])

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return self._sp.Encode(list(texts))

    def decode(self, ids: Sequence[int]) -> str:
        return self._sp.DecodeIds([int(i) for i in ids])

    def token_to_id(self, name: str) -> int | None:
        tid = self._sp.PieceToId(name)
        return None if tid == self._sp.unk_id() and name != self._sp.IdToPiece(tid) else tid

    @cached_property
    def fingerprint(self) -> str:
        return hashlib.sha256(self.path.read_bytes()).hexdigest()

    def __repr__(self) -> str:
        return f"SentencePieceTokenizer({str(self.path)!r}, vocab_size={self.vocab_size}, eos={self.eos_id})"
