"""The tokenizer interface the data pipeline and trainer rely on."""
from __future__ import annotations

from typing import Sequence


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

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Plain encodings (no bos/eos) of many texts; subclasses override it when they can batch in parallel."""
        return [self.encode(t) for t in texts]

    @property
    def fingerprint(self) -> str:
        """A stable id of the vocabulary and merges: token caches are keyed by it."""
        raise NotImplementedError
