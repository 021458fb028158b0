"""The tokenizer interface the data pipeline and trainer rely on."""
from __future__ import annotations

from typing import Sequence

import numpy as np

# A text longer than this is tokenised in pieces (encode_array): tokenizers' costs grow faster than linearly on one
# huge string (the builtin BPE: 5.7 s and ~1 GB for 3.8 MB of text whole, 1.4 s in 16 KiB pieces; a 100 MB JSONL
# line took minutes and 15 GiB), so a piece of PIECE_CHARS keeps time linear and memory bounded.
LONG_TEXT_CHARS = 1 << 20
PIECE_CHARS = 1 << 14


class TokenizerFileError(ValueError):
    """A tokenizer file that is not what its format needs ("<path>: not a ... (why)"). build_tokenizer adds the fix
    in its caller's terms: data.* keys for training, the --flags of scripts/preprocess_data.py."""


class Tokenizer:
    """The interface the data pipeline and trainer rely on; keep it this small."""

    vocab_size: int
    bos_id: int
    eos_id: int

    @property
    def eod_id(self) -> int:
        """The document separator joined between documents when packing (Megatron's `eod`); EOS unless overridden."""
        return getattr(self, "_eod_id", None) if getattr(self, "_eod_id", None) is not None else self.eos_id

    @eod_id.setter
    def eod_id(self, value: int) -> None:
        self._eod_id = value

    def token_to_id(self, name: str) -> int | None:
        """Id of a special/vocabulary token by its text, or None; used for the config's bos/eos/eod overrides."""
        return None

    def encode(self, text: str, bos: bool = False, eos: bool = False) -> list[int]:
        raise NotImplementedError

    def decode(self, ids: Sequence[int]) -> str:
        raise NotImplementedError

    def encode_array(self, text: str, piece_chars: int = PIECE_CHARS, long_chars: int = LONG_TEXT_CHARS
                     ) -> np.ndarray:
        """encode(text) as an int64 array; a text over `long_chars` characters is encoded piece by piece, cut
        before a space between two words: the tokenizers used here never join tokens across that space (regex
        pre-tokenizers start a word there; sentencepiece, with its default normalisation, starts one with the space
        as its "▁"), so the ids are those of the whole text. Only where the last half of a piece holds no such space
        is it cut elsewhere."""
        if len(text) <= long_chars:
            return np.asarray(self.encode(text), dtype=np.int64)
        return np.concatenate([np.asarray(self.encode(text[a:b]), dtype=np.int64)
                               for a, b in word_pieces(text, piece_chars)] or [np.zeros(0, np.int64)])

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """(ids, (start, end) character span of each id) of a rendered chat: special-token text ("<|im_end|>") becomes
        its special token, as transformers' tokenizer(text) does, unlike encode(), which keeps corpus text data. Chat
        templates (titanlike/data/chat.py) map the template's assistant spans to tokens through the spans."""
        raise ValueError(f"{type(self).__name__} cannot report where each token lies in the text, which chat "
                         "templates need (data.dataset='chat', generate --chat): use an HF tokenizer.json or a "
                         "tiktoken rank file as data.tokenizer (scripts/convert_hf.py export writes a tokenizer.json)")

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Plain encodings (no bos/eos) of many texts; subclasses override it when they can batch in parallel."""
        return [self.encode(t) for t in texts]

    @property
    def fingerprint(self) -> str:
        """A stable id of the vocabulary and merges: token caches are keyed by it."""
        raise NotImplementedError


def word_pieces(text: str, piece_chars: int) -> list[tuple[int, int]]:
    """(start, end) spans covering `text`, each at most `piece_chars` long, cut where possible before a space that
    has a non-space on both sides (searched back to half a piece)."""
    spans, start, n = [], 0, len(text)
    while n - start > piece_chars:
        hi = start + piece_chars
        cut, lo = hi, start + piece_chars // 2
        j = text.rfind(" ", lo, hi)
        while j != -1 and (text[j - 1].isspace() or text[j + 1].isspace()):
            j = text.rfind(" ", lo, j)
        if j > start:
            cut = j
        spans.append((start, cut))
        start = cut
    return spans + [(start, n)] if start < n else spans
