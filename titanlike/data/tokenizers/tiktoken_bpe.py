"""tiktoken BPE from a local rank file in the Llama 3 `tokenizer.model` format.

The file holds one "<base64 token bytes> <rank>" line per mergeable token (128,000 for Llama 3). The 256 special
tokens follow the base vocabulary in Llama 3's order, so <|begin_of_text|> = n_base + 0 and <|end_of_text|> =
n_base + 1 (128000 / 128001 for the real file), exactly as Meta's and HF's Llama 3 tokenizers number them.
"""
from __future__ import annotations

import base64
import hashlib
from functools import cached_property
from pathlib import Path
from typing import Sequence

from titanlike.data.tokenizers.base import Tokenizer, TokenizerFileError

# Llama 3's pre-tokenisation regex (splits before BPE); part of the tokenizer's definition, not tunable.
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
    r"\s*[\r\n]+|\s+(?!\S)|\s+"
)
NUM_RESERVED_SPECIAL_TOKENS = 256
_NAMED_SPECIALS = (
    "<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>", "<|reserved_special_token_1|>",
    "<|finetune_right_pad_id|>", "<|step_id|>", "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>",
    "<|eot_id|>", "<|python_tag|>",
)
# tiktoken's Rust core recurses on very long runs of one character class; cutting a document into pieces of this
# many characters keeps it safe at the cost of a possible extra split every 400k characters.
_MAX_CHARS_PER_CALL = 400_000


def llama3_special_tokens() -> list[str]:
    reserved = [f"<|reserved_special_token_{2 + i}|>"
                for i in range(NUM_RESERVED_SPECIAL_TOKENS - len(_NAMED_SPECIALS))]
    return list(_NAMED_SPECIALS) + reserved


def load_rank_file(path: Path) -> dict[bytes, int]:
    """Parse "<base64> <rank>" lines and check what tiktoken's Rust core assumes (unique ranks 0..n-1, every single
    byte a token): it panics on anything else, at load or at the first unencodable byte, with a Rust backtrace."""
    ranks: dict[bytes, int] = {}
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                token, rank = line.split()
                ranks[base64.b64decode(token, validate=True)] = int(rank)
            except ValueError as e:
                raise TokenizerFileError(f"{path}:{lineno}: not a tiktoken rank line '<base64> <rank>' "
                                         f"({e})") from None
    if not ranks:
        raise TokenizerFileError(f"{path}: not a tiktoken rank file (no '<base64> <rank>' line)")
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise TokenizerFileError(f"{path}: not a usable tiktoken rank file (its {len(ranks)} ranks are not "
                                 f"0..{len(ranks) - 1}, each once)")
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:
        raise TokenizerFileError(f"{path}: not a usable tiktoken rank file ({len(missing)} of the 256 single bytes "
                                 f"have no rank, e.g. {bytes([missing[0]])!r}: text holding them cannot be encoded)")
    return ranks


class TiktokenTokenizer(Tokenizer):
    def __init__(self, path: str | Path):
        try:
            import tiktoken
        except ImportError as e:
            raise ImportError("the tiktoken tokenizer format needs the `tiktoken` package: pip install tiktoken") from e
        self.path = Path(path)
        ranks = load_rank_file(self.path)
        n_base = len(ranks)
        self.special_tokens = {t: n_base + i for i, t in enumerate(llama3_special_tokens())}
        self._enc = tiktoken.Encoding(self.path.name, pat_str=LLAMA3_PATTERN, mergeable_ranks=ranks,
                                      special_tokens=self.special_tokens)
        self.vocab_size = n_base + len(self.special_tokens)
        self.bos_id = self.special_tokens["<|begin_of_text|>"]
        self.eos_id = self.special_tokens["<|end_of_text|>"]

    def _pieces(self, text: str) -> list[str]:
        return [text[i : i + _MAX_CHARS_PER_CALL] for i in range(0, len(text), _MAX_CHARS_PER_CALL)] or [""]

    def encode(self, text: str, bos: bool = False, eos: bool = False) -> list[int]:
        # encode_ordinary: special-token text inside a document is data, never a control token.
        ids = [i for piece in self._pieces(text) for i in self._enc.encode_ordinary(piece)]
        return ([self.bos_id] if bos else []) + ids + ([self.eos_id] if eos else [])

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        # Special-token text becomes the special token here (rendered chat templates write them as text).
        ids = [i for piece in self._pieces(text) for i in self._enc.encode(piece, allowed_special="all")]
        _, starts = self._enc.decode_with_offsets(ids)  # character start of each token
        ends = starts[1:] + [len(text)]
        return ids, [(s, max(s, e)) for s, e in zip(starts, ends)]

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        if all(len(t) <= _MAX_CHARS_PER_CALL for t in texts):
            return self._enc.encode_ordinary_batch(list(texts))
        return [self.encode(t) for t in texts]

    def decode(self, ids: Sequence[int]) -> str:
        return self._enc.decode(list(ids))

    def token_to_id(self, name: str) -> int | None:
        if name in self.special_tokens:
            return self.special_tokens[name]
        try:
            return self._enc.encode_single_token(name.encode("utf-8"))
        except KeyError:
            return None

    @cached_property
    def fingerprint(self) -> str:
        return hashlib.sha256(self.path.read_bytes() + b"|llama3-specials").hexdigest()

    def __repr__(self) -> str:
        return (f"TiktokenTokenizer({str(self.path)!r}, vocab_size={self.vocab_size}, bos={self.bos_id}, "
                f"eos={self.eos_id})")
