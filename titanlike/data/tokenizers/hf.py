"""Tokenizers built on HF `tokenizers`: a tokenizer.json, GPT-2 vocab.json + merges.txt, and the builtin
byte-level BPE trained on the stdlib corpus (cached after the first run)."""
from __future__ import annotations

import hashlib
import json
import logging
import time
from functools import cached_property
from pathlib import Path
from typing import Iterable, Sequence

from titanlike.data.cache import build_once, cache_root
from titanlike.data.stdlib_corpus import list_stdlib_files, read_texts
from titanlike.data.tokenizers.base import Tokenizer, TokenizerFileError

logger = logging.getLogger(__name__)

BUILTIN_BOS = "<|begin_of_text|>"
BUILTIN_EOS = "<|end_of_text|>"
# Training on the first ~8 MB (sorted file order) of the stdlib takes ~1-2 s and gives the same merges as more text
# would to within noise at a 2k vocabulary.
TOKENIZER_TRAIN_MAX_BYTES = 8_000_000
_BUILTIN_RECIPE = "bytelevel-bpe-v1"  # bump when the training recipe changes, so old caches are not reused

# Names that mark the start / end of a document across common HF tokenizers (tiktoken- and sentencepiece-based,
# GPT-2/Qwen...).
_BOS_NAMES = (BUILTIN_BOS, "<s>", "<|startoftext|>", "<bos>", "[BOS]", "<|endoftext|>")
_EOS_NAMES = (BUILTIN_EOS, "</s>", "<|endoftext|>", "<eos>", "[EOS]")


class HFTokenizer(Tokenizer):
    """An HF `tokenizers` fast tokenizer loaded from a tokenizer.json file."""

    def __init__(self, path: str | Path, bos_token: str | None = None, eos_token: str | None = None,
                 hf_tokenizer=None, fingerprint_files: Sequence[Path] = ()):
        self.path = Path(path)
        self._tok = hf_tokenizer if hf_tokenizer is not None else _load_tokenizer_json(self.path)
        self._fingerprint_files = tuple(fingerprint_files) or (self.path,)
        # Corpus text is data, not markup: a literal "<|end_of_text|>" in a document must not become the control
        # token. bos/eos are added only through the encode() flags. (Attribute exists in tokenizers >= 0.15.)
        if hasattr(self._tok, "encode_special_tokens"):
            self._tok.encode_special_tokens = True
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        hinted_bos, hinted_eos = _special_token_hints(self.path.parent)
        self.bos_id = self._find_id("bos", [bos_token, hinted_bos, *_BOS_NAMES], required=False)
        self.eos_id = self._find_id("eos", [eos_token, hinted_eos, *_EOS_NAMES], required=True)
        if self.bos_id is None:  # GPT-2 style vocabularies have a single document separator
            self.bos_id = self.eos_id

    def _find_id(self, kind: str, names: Iterable[str | None], required: bool) -> int | None:
        for name in names:
            if name and (tid := self._tok.token_to_id(name)) is not None:
                return tid
        if required:
            tried = ", ".join(n for n in dict.fromkeys(names) if n)
            raise ValueError(
                f"tokenizer {self.path}: found no {kind} token (tried {tried}). Add one of these as a special "
                "token, or put a tokenizer_config.json with a 'bos_token'/'eos_token' entry next to the file."
            )
        return None

    def encode(self, text: str, bos: bool = False, eos: bool = False) -> list[int]:
        # add_special_tokens=False: a file's own post-processor (e.g. one that prepends BOS) must not double them.
        ids = self._tok.encode(text, add_special_tokens=False).ids
        return ([self.bos_id] if bos else []) + ids + ([self.eos_id] if eos else [])

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        # Special tokens parsed (encode_special_tokens off for this call only); offsets as tokenizers reports them,
        # which is what transformers' fast tokenizers hand apply_chat_template.
        tok, before = self._tok, getattr(self._tok, "encode_special_tokens", None)
        if before is not None:
            tok.encode_special_tokens = False
        try:
            enc = tok.encode(text, add_special_tokens=False)
        finally:
            if before is not None:
                tok.encode_special_tokens = before
        return enc.ids, enc.offsets

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)

    def token_to_id(self, name: str) -> int | None:
        return self._tok.token_to_id(name)

    @cached_property
    def fingerprint(self) -> str:
        digest = hashlib.sha256()
        for f in self._fingerprint_files:
            digest.update(Path(f).read_bytes())
        return digest.hexdigest()

    def __repr__(self) -> str:
        return f"HFTokenizer({str(self.path)!r}, vocab_size={self.vocab_size}, bos={self.bos_id}, eos={self.eos_id})"


def _load_tokenizer_json(path: Path):
    from tokenizers import Tokenizer as _HFTok

    try:
        return _HFTok.from_file(str(path))
    except Exception as e:  # tokenizers raises a bare Exception (no path) for any unreadable file
        why = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise TokenizerFileError(f"{path}: not a Hugging Face tokenizer.json ({why})") from None


def _special_token_hints(folder: Path) -> tuple[str | None, str | None]:
    """bos/eos names from a tokenizer_config.json beside the tokenizer file, as HF model repos ship them."""
    cfg_path = folder / "tokenizer_config.json"
    if not cfg_path.is_file():
        return None, None
    try:
        cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None, None

    def name(v):  # either "<s>" or {"content": "<s>", ...}
        return v.get("content") if isinstance(v, dict) else v if isinstance(v, str) else None

    return name(cfg.get("bos_token")), name(cfg.get("eos_token"))


def train_bytelevel_bpe(texts: Iterable[str], vocab_size: int,
                        special_tokens: Sequence[str] = (BUILTIN_BOS, BUILTIN_EOS)):
    """Train a byte-level BPE (GPT-2 style pre-tokenisation, all 256 bytes in the base alphabet) -> HF Tokenizer."""
    from tokenizers import Tokenizer as _HFTok, decoders, models, pre_tokenizers, trainers

    tok = _HFTok(models.BPE())
    # add_prefix_space=False keeps decode(encode(x)) == x exactly; the regex split keeps merges inside words.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(special_tokens),  # first, so they get ids 0, 1, ...
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte encodable, so nothing is ever <unk>
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def builtin_tokenizer(
    vocab_size: int = 2048, cache_dir: str = "", max_train_bytes: int | None = TOKENIZER_TRAIN_MAX_BYTES
) -> HFTokenizer:
    """The builtin BPE: trained on the first `max_train_bytes` of the stdlib corpus once, then loaded from cache."""
    if vocab_size < 256 + 2 + 1:
        raise ValueError(f"data.builtin_vocab_size={vocab_size}: must exceed 258 (256 bytes + 2 special tokens)")
    corpus = list_stdlib_files(max_train_bytes)
    key = hashlib.sha256(f"{_BUILTIN_RECIPE}|{vocab_size}|{corpus.fingerprint}".encode()).hexdigest()[:16]
    path = cache_root(cache_dir) / "tokenizer" / f"bpe{vocab_size}-{key}" / "tokenizer.json"

    def build(tmp: Path) -> None:
        t0 = time.perf_counter()
        tok = train_bytelevel_bpe(read_texts(corpus), vocab_size)
        tok.save(str(tmp))
        logger.info("trained builtin BPE (vocab %d, %.1f MB of stdlib) in %.1fs -> %s",
                    vocab_size, corpus.total_bytes / 1e6, time.perf_counter() - t0, path)

    return HFTokenizer(build_once(path, build), bos_token=BUILTIN_BOS, eos_token=BUILTIN_EOS)


def gpt2_bpe_tokenizer(vocab_file: str | Path, merge_file: str | Path) -> HFTokenizer:
    """GPT-2's byte-level BPE from `vocab.json` + `merges.txt` (Megatron's GPT2BPETokenizer); EOD = <|endoftext|>."""
    from tokenizers import Tokenizer as _HFTok, decoders, models, pre_tokenizers

    vocab_file, merge_file = Path(vocab_file), Path(merge_file)
    try:
        tok = _HFTok(models.BPE.from_file(str(vocab_file), str(merge_file)))
    except Exception as e:  # tokenizers raises a bare Exception on malformed files
        why = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise TokenizerFileError(f"{vocab_file} / {merge_file}: not GPT-2 BPE files ({why}; expected a JSON object "
                                 "token -> id and a merges.txt of 'a b' pairs)") from None
    # GPT-2 pre-tokenisation: its regex split, bytes mapped to printable characters, no leading space added.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    return HFTokenizer(vocab_file, hf_tokenizer=tok, fingerprint_files=(vocab_file, merge_file))
