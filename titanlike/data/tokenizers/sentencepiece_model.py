"""sentencepiece `.model` files (Llama 2, Mistral, Gemma-style; Megatron's SentencePieceTokenizer; T5's spiece.model).

`vocab_extra_ids` (data.vocab_extra_ids) appends T5's sentinels "<extra_id_0>".."<extra_id_{n-1}>" after the model's
pieces as Hugging Face's T5Tokenizer does: in reverse, so <extra_id_0> is the last id (vocab_size - 1) and
<extra_id_i> is vocab_size - 1 - i, the ids the published T5 checkpoints were trained with (and models/t5's
`sentinel_top - i`). Sentinel pieces the model already holds keep their ids. The masked datasets
(titanlike/data/t5_dataset.py) read `sentinel_ids` (in span order), `pad_id`, `continuation`, `decoder_start_id`
and `require(...)`, as for the BERT WordPiece vocabulary.
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


class SentencePieceTokenizer(Tokenizer):
    def __init__(self, path: str | Path, vocab_extra_ids: int = 0):
        try:
            import sentencepiece as spm
        except ImportError as e:
            raise ImportError("the sentencepiece tokenizer format needs the `sentencepiece` package: "
                              "pip install sentencepiece") from e
        self.path, self.vocab_extra_ids = Path(path), int(vocab_extra_ids)
        self._sp = spm.SentencePieceProcessor()
        try:
            self._sp.Load(str(self.path))
        except (OSError, RuntimeError) as e:
            why = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise TokenizerFileError(f"{self.path}: not a sentencepiece model ({why})") from None
        self._n_pieces = self._sp.GetPieceSize()
        own = {int(m.group(1)): i for i in range(self._n_pieces) if (m := _SENTINEL.fullmatch(self._sp.IdToPiece(i)))}
        missing = [k for k in range(self.vocab_extra_ids - 1, -1, -1) if k not in own]  # HF's order: highest first
        self._added = {f"<extra_id_{k}>": self._n_pieces + j for j, k in enumerate(missing)}
        self._added_names = {i: t for t, i in self._added.items()}
        self.vocab_size = self._n_pieces + len(self._added)
        found = {**own, **{k: self._added[f"<extra_id_{k}>"] for k in missing}}
        self.sentinel_ids = [found[k] for k in sorted(found)]
        eos = self._sp.eos_id()
        if eos < 0:
            raise ValueError(f"{self.path}: the sentencepiece model has no EOS piece; name one with data.eos_token")
        self.eos_id = eos
        bos = self._sp.bos_id()
        self._has_bos = bos >= 0
        self.bos_id = bos if bos >= 0 else eos
        pad = self._sp.pad_id()
        self.pad_id = pad if pad >= 0 else None

    @property
    def decoder_start_id(self) -> int:
        """The token a T5 decoder input starts with: BOS when the model has one (or data.bos_token names one), else
        PAD, as HF's T5 (decoder_start_token_id = pad_token_id; T5's spiece.model has no BOS)."""
        if self._has_bos or self.bos_id != self.eos_id or self.pad_id is None:
            return self.bos_id
        return self.pad_id

    def require(self, what: str, dataset: str) -> None:
        """One line when the model lacks what `dataset` needs: "pad" or "sentinels" (t5); BERT's [CLS] [SEP] [MASK]
        are not sentencepiece pieces."""
        if what == "sentinels":
            if not self.sentinel_ids:
                raise ValueError(f"data.dataset={dataset!r} needs sentinel tokens <extra_id_0>, ... for its spans but "
                                 f"{self.path} has none: set data.vocab_extra_ids (e.g. 100, as T5's tokenizer) to "
                                 "append them")
        elif what == "pad":
            if self.pad_id is None:
                raise ValueError(f"data.dataset={dataset!r} needs a pad piece but the sentencepiece model {self.path} "
                                 "has none: train it with pad_id set (T5's spiece.model: pad 0, eos 1, unk 2)")
        else:
            raise ValueError(f"data.dataset={dataset!r} needs BERT's [CLS] [SEP] [MASK] tokens, which a sentencepiece "
                             "model lacks: set data.tokenizer_type=BertWordPieceLowerCase (or BertWordPieceCase) and "
                             "data.vocab_file=<vocab.txt>")

    @cached_property
    def continuation(self) -> np.ndarray:
        """bool[vocab_size]: True for pieces that continue the word before them (no leading "▁"); whole-word
        masking keeps them with their word."""
        sp = self._sp
        out = np.zeros(self.vocab_size, dtype=bool)
        for i in range(self._n_pieces):
            if not (sp.IsControl(i) or sp.IsUnknown(i) or sp.IsUnused(i) or sp.IsByte(i)):
                out[i] = not sp.IdToPiece(i).startswith("▁")
        out[self.sentinel_ids] = False
        return out

    def encode(self, text: str, bos: bool = False, eos: bool = False) -> list[int]:
        # Control pieces (<s>, </s>) and sentinels are never produced from text: markup in data stays data.
        ids = self._sp.EncodeAsIds(text)
        return ([self.bos_id] if bos else []) + ids + ([self.eos_id] if eos else [])

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return self._sp.Encode(list(texts))

    def decode(self, ids: Sequence[int]) -> str:
        if not self._added:
            return self._sp.DecodeIds([int(i) for i in ids])
        out, run = [], []  # the appended sentinels are not pieces of the model: decode the runs between them
        for i in [*map(int, ids), None]:
            if i is None or i in self._added_names:
                text = self._sp.DecodeIds(run)
                # sentencepiece drops the first piece's "▁" (its dummy prefix); after a sentinel it is a real
                # space, which transformers' T5Tokenizer keeps too
                if out and run and self._sp.IdToPiece(run[0]).startswith("▁") and not text.startswith(" "):
                    text = " " + text
                out += [text] + ([self._added_names[i]] if i is not None else [])
                run = []
            else:
                run.append(i)
        return "".join(out)

    def token_to_id(self, name: str) -> int | None:
        if name in self._added:
            return self._added[name]
        tid = self._sp.PieceToId(name)
        return None if tid == self._sp.unk_id() and name != self._sp.IdToPiece(tid) else tid

    def id_to_token(self, i: int) -> str | None:
        i = int(i)
        return self._added_names.get(i) or (self._sp.IdToPiece(i) if 0 <= i < self._n_pieces else None)

    @property
    def added_tokens(self) -> list[str]:
        """The appended sentinels in id order (the HF export adds them after the model's pieces)."""
        return [self._added_names[i] for i in sorted(self._added_names)]

    @cached_property
    def fingerprint(self) -> str:
        h = hashlib.sha256(self.path.read_bytes())
        if self._added:  # unchanged without extras, so caches of plain runs stay valid
            h.update(f"|extra={self.vocab_extra_ids}".encode())
        return h.hexdigest()

    def __repr__(self) -> str:
        return (f"SentencePieceTokenizer({str(self.path)!r}, vocab_size={self.vocab_size}, eos={self.eos_id}, "
                f"sentinels={len(self.sentinel_ids)})")
